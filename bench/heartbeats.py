"""Benchmark: heartbeat ingestion by one heartbeat server process, against raw psycopg.

Registers --machines machines (100,000 by default), each with an agent key of
its own, in a local PostgreSQL, and measures in one run:

raw psycopg  the heartbeat's conditional upsert written straight through
             psycopg, one statement a heartbeat over 10 connections, then 100
             heartbeats a statement: what PostgreSQL takes here, the baseline.
server       the real heartbeat server (TLS unless --plaintext), its agent keys
             loaded at start as in production, fed by a separate process
             (bench.heartbeat_load) whose agents send signed heartbeats back to
             back, at most --concurrency in flight over --channels connections,
             for --seconds: on --concurrency Heartbeats streams, each sending
             its next heartbeat when the last is answered, and as unary
             Heartbeat calls (--call stream,unary or both, one after the
             other against the same server). --call connect sends unary calls
             each on a connection opened for it and closed after it, as agents
             that hold no connection between heartbeats, connect-resumed the
             same with TLS sessions resumed; the server's CPU a heartbeat of
             each call is then set against the stream's. The server's own CPU
             is measured apart from the load's.

Then it times refusals one at a time: a wrong key on a real id against an
unknown id, which must not be told apart, as unary calls and as messages of
one stream, the two taking turns; and what an idle fleet costs a server
process in memory, for each count of --idle-agents, each case against a fresh
`shepherd heartbeat-server` with the keys loaded, its resident memory read from
/proc before and while another process holds the agents idle:

unary        a connection an agent, one unary heartbeat done on each: what a
             connection costs alone;
stream       a connection an agent, a stream open on each with one heartbeat
             answered: an agent of today;
shared       the same streams over --idle-channels connections: what a stream
             costs alone.

Each case is held by a fresh bare gRPC server too (bench.heartbeat_floor), with
the same TLS and options and a handler that does nothing: the floor, which the
server's figure is set against; --floor-option NAME=VALUE adds a third, the
floor with gRPC core options added, set against the floor.

--idle-only runs this part alone (with the registration it needs). Run:

    python -m bench.heartbeats [--machines 100000] [--seconds 20] [--concurrency 200] [--channels 8]
                               [--call both] [--plaintext] [--processes 1] [--refusals 1000]
                               [--idle-agents 2000,5000,10000] [--idle-channels 8] [--idle-only]
                               [--floor-option grpc.NAME=VALUE ...]

With --processes N above 1 the server is `shepherd heartbeat-server --processes N`
instead, its processes' CPU summed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent.heartbeat import signed_heartbeat
from bench.bmdb_rows import BenchMachine, insert_machines
from bench.heartbeat_floor import core_option
from bench.heartbeat_load import LoadSeen, agent_key, machine_id
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB, RECORD_HEARTBEATS
from foundation.procfs import children_of
from foundation.settings import Settings
from foundation.tls import local_certificates
from processes.heartbeat_server import build_server
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2, agent_api_pb2_grpc
from proto.signing import NONCE_SIZE, signing_payload

DEFAULTS = Settings()
CALL_TIMEOUT = 10.0
RAW_CONNECTIONS = 10
RAW_BATCH = 100
RAW_SECONDS = 5.0

Heartbeat = Callable[..., Awaitable[agent_api_pb2.HeartbeatResponse]]

# The heartbeat's conditional upsert, one machine: written only if the key is the agent's and sent_at is newer.
RAW_UPSERT = """
    INSERT INTO machine_agent_heartbeat AS last (machine_id, agent_heartbeat_at, agent_sent_at)
    SELECT machine_id, now(), %(sent_at)s FROM machine_agent_started
    WHERE machine_id = %(machine_id)s AND agent_public_key = %(key)s
    ON CONFLICT (machine_id) DO UPDATE SET agent_heartbeat_at = now(), agent_sent_at = excluded.agent_sent_at
        WHERE last.agent_sent_at IS NULL OR last.agent_sent_at < excluded.agent_sent_at
    RETURNING last.machine_id
"""
# The server's own statement, many a statement: what the server's batches could reach at most.
RAW_UPSERT_MANY = RECORD_HEARTBEATS


def register(url: str, count: int) -> list[tuple[uuid.UUID, bytes]]:
    """Machines as they are after a takeover: admitted, provided, agent started with its key. (id, key) each."""
    agents = [
        (machine_id(n), agent_key(n).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)) for n in range(count)
    ]
    insert_machines(url, [BenchMachine(machine, "sim", str(machine), key) for machine, key in agents])
    return agents


async def raw_psycopg_rate(url: str, agents: list[tuple[uuid.UUID, bytes]], per_statement: int) -> float:
    """Heartbeats a second PostgreSQL records through psycopg alone, RAW_CONNECTIONS at once."""
    # Sent long ago, a microsecond apart: every write is newer than the last, and older than the server's later.
    sent_base = datetime.now(UTC) - timedelta(hours=1)
    sequence = iter(range(10**9))
    written = 0
    deadline = time.perf_counter() + RAW_SECONDS

    async def writer() -> None:
        nonlocal written
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            while time.perf_counter() < deadline:
                numbers = [next(sequence) for _ in range(per_statement)]
                batch = [(agents[n % len(agents)], sent_base + timedelta(microseconds=n)) for n in numbers]
                if per_statement == 1:
                    ((machine, key), sent_at) = batch[0]
                    parameters: dict[str, object] = {"machine_id": machine, "key": key, "sent_at": sent_at}
                    await conn.execute(RAW_UPSERT, parameters, prepare=True)
                else:
                    # One machine once a statement, as the server's batches are.
                    latest = sorted({machine: (key, sent_at) for (machine, key), sent_at in batch}.items())
                    parameters = {
                        "machine_ids": [machine for machine, _ in latest],
                        "keys": [key for _, (key, _) in latest],
                        "sent_at": [sent_at for _, (_, sent_at) in latest],
                    }
                    await conn.execute(RAW_UPSERT_MANY, parameters, prepare=True)
                written += len(batch)

    start = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(RAW_CONNECTIONS)))
    return written / (time.perf_counter() - start)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def status_mib(pid: int, field: str) -> float:
    """A memory figure of /proc/PID/status (VmHWM: peak resident, VmRSS: resident now), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib(pid: int) -> float:
    return status_mib(pid, "VmHWM")


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_seconds(data_dir: Path) -> float | None:
    """CPU time of the PostgreSQL server and its backends; None where /proc cannot tell."""
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            # The command name may hold spaces and parentheses: the fields start after its last ")".
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(entry.name) == postmaster or int(fields[1]) == postmaster:
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def microseconds_per_call(action: Callable[[], object], calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        action()
    return (time.perf_counter() - start) / calls * 1e6


def signature_costs() -> tuple[float, float]:
    """Microseconds to sign a heartbeat (agent side) and to check its signature (server side)."""
    key = Ed25519PrivateKey.generate()
    public = key.public_key()
    payload = signing_payload(str(uuid.uuid4()), int(time.time() * 1000), os.urandom(NONCE_SIZE))
    signature = key.sign(payload)
    return microseconds_per_call(lambda: key.sign(payload)), microseconds_per_call(
        lambda: public.verify(signature, payload)
    )


# How a refusal is asked for and timed: a request in, the seconds its refusal took out.
Refuse = Callable[[agent_api_pb2.HeartbeatRequest], Awaitable[float]]


async def refusal_timing(stub: agent_api_pb2_grpc.AgentCallbackStub, machine_ids: list[str], samples: int) -> None:
    """What a prober with a clock sees: the time to refuse a wrong key on a real id, against an unknown id, as unary
    calls and as the messages of one stream."""
    wrong_key = Ed25519PrivateKey.generate()
    strangers = [str(uuid.uuid4()) for _ in range(10)]
    kinds: dict[str, Callable[[int], agent_api_pb2.HeartbeatRequest]] = {
        "a real id, wrong key": lambda n: signed_heartbeat(machine_ids[n % len(machine_ids)], wrong_key),
        "an unknown id, asked before": lambda n: signed_heartbeat(strangers[n % len(strangers)], wrong_key),
        "an unknown id, new": lambda n: signed_heartbeat(str(uuid.uuid4()), wrong_key),
    }
    stream = stub.Heartbeats()
    calls: dict[str, Refuse] = {
        "unary calls": lambda request: refused(stub.Heartbeat, request),
        "messages of one stream": lambda request: refused_on_stream(stream, request),
    }
    try:
        for stranger in strangers:  # each is then an id the server knows to have no agent
            await calls["unary calls"](signed_heartbeat(stranger, wrong_key))
        durations: dict[tuple[str, str], list[float]] = {(call, kind): [] for call in calls for kind in kinds}
        # One at a time, the kinds and the calls taking turns: each sees the same server, unloaded, as a careful
        # prober would.
        for n in range(samples):
            for call, refuse in calls.items():
                for kind, request in kinds.items():
                    durations[call, kind].append(await refuse(request(n)))
    finally:
        stream.cancel()
    print(f"refusal time, {samples:,} of each kind and call one at a time (median, its ratio to a wrong key on a real")
    print("  id on the same call; 10th and 90th percentiles):")
    for call in calls:
        print(f"  {call}:")
        baseline = statistics.median(durations[call, "a real id, wrong key"])
        for kind in kinds:
            times = durations[call, kind]
            median = statistics.median(times)
            deciles = statistics.quantiles(times, n=10)
            spread = f"{deciles[0] * 1e6:,.0f}-{deciles[-1] * 1e6:,.0f} µs"
            print(f"    {kind:28} {median * 1e6:7,.0f} µs  {median / baseline:.2f}   {spread}")


async def refused(heartbeat: Heartbeat, request: agent_api_pb2.HeartbeatRequest) -> float:
    start = time.perf_counter()
    try:
        await heartbeat(request, timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.UNAUTHENTICATED:
            code, details = error.code().name, error.details()
            raise SystemExit(f"a refusal timed was {code}, not UNAUTHENTICATED: {details}") from None
        return time.perf_counter() - start
    raise SystemExit("a heartbeat that should have been refused was accepted")


async def refused_on_stream(stream: grpc.aio.StreamStreamCall, request: agent_api_pb2.HeartbeatRequest) -> float:
    """The time from sending a message on the stream to reading its answer, which must be NOT_ACCEPTED."""
    start = time.perf_counter()
    await stream.write(request)
    answer = await asyncio.wait_for(stream.read(), CALL_TIMEOUT)
    elapsed = time.perf_counter() - start
    if answer is grpc.aio.EOF:
        raise SystemExit(f"the stream whose refusals were timed ended: {await stream.code()}")
    assert isinstance(answer, agent_api_pb2.HeartbeatResponse)
    if answer.outcome != agent_api_pb2.HeartbeatResponse.Outcome.NOT_ACCEPTED:
        outcome = agent_api_pb2.HeartbeatResponse.Outcome.Name(answer.outcome)
        raise SystemExit(f"a refusal timed on the stream was {outcome}, not NOT_ACCEPTED: {answer.message}")
    return elapsed


class InProcessServer:
    """The heartbeat server in this process, as one `shepherd heartbeat-server` process runs it."""

    def __init__(self, url: str) -> None:
        self.bmdb = BMDB(url)
        # Every agent of the load connects from this host's one address: no cap on streams an address.
        self.service = HeartbeatService(
            self.bmdb,
            interval=DEFAULTS.heartbeat_interval,
            max_skew=DEFAULTS.heartbeat_max_skew,
            max_streams_per_address=0,
        )
        self.server: grpc.aio.Server | None = None
        # Statements and heartbeats written before the load being reported.
        self._counted = (0, 0)

    async def start(self, tls: tuple[Path, Path] | None) -> str:
        loaded_at = time.perf_counter()
        loaded = await self.service.load_keys()
        print(f"the server loaded {loaded:,} agent keys in {time.perf_counter() - loaded_at:.1f} s")
        self.server, port = build_server(self.service, "127.0.0.1:0", tls)
        await self.server.start()
        return f"127.0.0.1:{port}"

    def cpu_seconds(self) -> float:
        return cpu_seconds()

    def peak_rss(self) -> str:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        now_mib = status_mib(os.getpid(), "VmRSS")
        return f"{peak_mib:,.0f} MiB, {now_mib:,.0f} MiB now (this process: the server, and the baseline before it)"

    def rss_mib(self) -> float:
        return status_mib(os.getpid(), "VmRSS")

    def batching(self) -> str:
        batcher = self.service.batcher
        statements, heartbeats = batcher.statements - self._counted[0], batcher.heartbeats - self._counted[1]
        self._counted = (batcher.statements, batcher.heartbeats)
        return f"{statements:,}, {heartbeats / max(statements, 1):.1f} heartbeats each"

    async def stop(self) -> None:
        if self.server is not None:
            self.service.end_streams()
            await self.server.stop(grace=None)
        await self.service.close()
        await self.bmdb.close()


class ServerProcesses:
    """`shepherd heartbeat-server --processes N`, as an operator starts it; the CPU of all its processes."""

    def __init__(self, url: str, processes: int, tmp: Path, *, quiet: bool = False) -> None:
        self.url, self.processes, self.tmp = url, processes, tmp
        # Quiet: the server's log goes to a file, so a table being printed is not broken up by it.
        self.quiet = quiet
        self.command: asyncio.subprocess.Process | None = None

    async def start(self, tls: tuple[Path, Path] | None) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            target = f"127.0.0.1:{probe.getsockname()[1]}"
        env = {
            **os.environ,
            "SHEPHERD_DATABASE_URL": self.url,
            "SHEPHERD_STATE_DIR": str(self.tmp / "state"),
            "SHEPHERD_METRICS_LISTEN": "",
            # One address sends everything here, and holds every idle agent's stream.
            "SHEPHERD_HEARTBEAT_PEER_RATE": "0",
            "SHEPHERD_HEARTBEAT_MAX_STREAMS_PER_ADDRESS": "0",
            "SHEPHERD_HEARTBEAT_MAX_CONNECTIONS_PER_ADDRESS": "0",
        }
        if tls is None:
            env["SHEPHERD_HEARTBEAT_PLAINTEXT"] = "true"
        else:
            env["SHEPHERD_HEARTBEAT_TLS_CERTIFICATE_PATH"], env["SHEPHERD_HEARTBEAT_TLS_KEY_PATH"] = map(str, tls)
        command = [sys.executable, "-m", "shepherd", "heartbeat-server", "--processes", str(self.processes)]
        log = (self.tmp / "heartbeat-server.log").open("ab") if self.quiet else None
        self.command = await asyncio.create_subprocess_exec(*command, "--listen", target, env=env, stderr=log)
        if log is not None:
            log.close()
        # One process serves in the command's own; more are its children.
        expected = 1 if self.processes == 1 else self.processes + 1
        while len(self._pids()) < expected or not await self._listening(target):
            if self.command.returncode is not None:
                raise SystemExit("shepherd heartbeat-server stopped")
            await asyncio.sleep(0.5)
        if not self.quiet:
            print(f"shepherd heartbeat-server --processes {self.processes} listens on {target}")
        return target

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(pid) for pid in self._pids())

    def batching(self) -> str:
        return "in the server processes, not seen from here"

    def servers(self) -> list[int]:
        """The processes that serve: the command's children, or the command itself when it serves alone."""
        assert self.command is not None
        if self.processes == 1:
            return [self.command.pid]
        return children_of(self.command.pid, mentioning="spawn_main")

    def peak_rss(self) -> str:
        return ", ".join(f"{peak_rss_mib(pid):,.0f}" for pid in self.servers()) + " MiB (each server process)"

    async def stop(self) -> None:
        if self.command is not None and self.command.returncode is None:
            self.command.terminate()
            await self.command.wait()

    def _pids(self) -> list[int]:
        assert self.command is not None
        return [self.command.pid, *children_of(self.command.pid)]

    @staticmethod
    async def _listening(target: str) -> bool:
        host, port = target.rsplit(":", 1)
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return False
        writer.close()
        return True


class FloorProcess:
    """bench.heartbeat_floor: a bare gRPC server with the heartbeat server's TLS and options, in a process of its
    own, core options of extra added to them."""

    def __init__(self, extra: list[tuple[str, int]]) -> None:
        self.extra = extra
        self.command: asyncio.subprocess.Process | None = None

    async def start(self, tls: tuple[Path, Path] | None) -> str:
        command = [sys.executable, "-m", "bench.heartbeat_floor"]
        if tls is not None:
            command += ["--certificate", str(tls[0]), "--key", str(tls[1])]
        for name, value in self.extra:
            command += ["--option", f"{name}={value}"]
        self.command = await asyncio.create_subprocess_exec(*command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.command.stdout is not None
        port = (await self.command.stdout.readline()).strip()
        if not port:
            raise SystemExit("the bare gRPC server did not start")
        return f"127.0.0.1:{int(port)}"

    def servers(self) -> list[int]:
        assert self.command is not None
        return [self.command.pid]

    async def stop(self) -> None:
        if self.command is not None and self.command.returncode is None:
            assert self.command.stdin is not None
            self.command.stdin.close()
            await self.command.wait()


async def measure(url: str, pg_data: Path, tmp: Path, args: argparse.Namespace) -> bool:
    """Run the baseline and the server under load, print both; False if any heartbeat was rejected."""
    setup = time.perf_counter()
    agents = register(url, args.machines)
    print(f"registered {len(agents):,} machines in {time.perf_counter() - setup:.1f} s")
    tls = None
    ca_certificate = None
    if not args.plaintext:
        certificates = local_certificates(tmp / "tls")
        tls = (certificates.server_certificate, certificates.server_key)
        ca_certificate = certificates.ca_certificate
    if args.idle_only:
        await idle_memory(args, url, tmp, tls, ca_certificate)
        return True
    raw_single = await raw_psycopg_rate(url, agents, 1)
    raw_many = await raw_psycopg_rate(url, agents, RAW_BATCH)
    server = InProcessServer(url) if args.processes == 1 else ServerProcesses(url, args.processes, tmp)
    try:
        target = await server.start(tls)
        clean = True
        cpu_each: dict[str, float] = {}
        for call in args.call:
            load = await start_load(args, target, ca_certificate, call)
            cpu_before, pg_before = server.cpu_seconds(), postgres_cpu_seconds(pg_data)
            load_before = process_cpu_seconds(load.pid)
            assert load.stdin is not None and load.stdout is not None
            load.stdin.write(b"go\n")
            await load.stdin.drain()
            answer = await load.stdout.readline()
            cpu, pg_after = server.cpu_seconds() - cpu_before, postgres_cpu_seconds(pg_data)
            load_cpu = process_cpu_seconds(load.pid) - load_before
            if await load.wait() != 0 or not answer:
                raise SystemExit("the load process failed")
            seen = LoadSeen(**json.loads(answer))
            pg_cpu = None if pg_before is None or pg_after is None else pg_after - pg_before
            report(args, call, seen, cpu, pg_cpu, load_cpu, server, raw_single, raw_many)
            cpu_each[call] = cpu / max(seen.accepted, 1)
            clean = clean and not seen.rejected
        compare_cpu(cpu_each)
        channel = open_channel(target, ca_certificate)
        try:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            await refusal_timing(stub, [str(machine) for machine, _ in agents[:1000]], args.refusals)
        finally:
            await channel.close()
    finally:
        await server.stop()
    if args.idle_agents:
        await idle_memory(args, url, tmp, tls, ca_certificate)
    return clean


IDLE_CASES = {
    "unary": "a connection each, one unary call done",
    "stream": "a connection each, a stream open",
    "shared": "a stream each over {channels} connections",
}
# How long the server is left to settle before its memory is read: the last answers written, gRPC's buffers
# released.
SETTLE_SECONDS = 3.0


@dataclass(frozen=True)
class PerAgent:
    """What an agent costs, in KiB, from resident memory read before and while counts of agents were held.

    slope is the memory the largest count added over the smallest's, an agent: what one more agent costs, one-off
    costs (the first connection's buffers, the allocator's arenas) left out. low and high are the least and most
    KiB an agent of any one count, (with them - before) / count: the spread of the figures the slope stands among.
    """

    slope: float
    low: float
    high: float


def per_agent(samples: dict[int, tuple[float, float]]) -> PerAgent:
    """From {agents: (MiB before, MiB with them)}, at least one count; the slope of one count is its own KiB an
    agent."""
    each = [(during - before) * 1024 / count for count, (before, during) in samples.items()]
    low, high = min(samples), max(samples)
    if low == high:
        return PerAgent(slope=each[0], low=each[0], high=each[0])
    # Each count's memory with the agents above its own server's before: the servers are fresh, and differ a little.
    above = {count: during - before for count, (before, during) in samples.items()}
    return PerAgent(slope=(above[high] - above[low]) * 1024 / (high - low), low=min(each), high=max(each))


async def idle_memory(
    args: argparse.Namespace, url: str, tmp: Path, tls: tuple[Path, Path] | None, ca_certificate: Path | None
) -> None:
    """What idle agents cost a server process in memory, each case against a fresh one, beside what they cost a
    bare gRPC server with the same TLS (the floor), fresh too."""
    transport = "plain text" if args.plaintext else "TLS"
    hosts: dict[str, Callable[[], ServerProcesses | FloorProcess]] = {
        "server": lambda: ServerProcesses(url, 1, tmp, quiet=True),
        "floor": lambda: FloorProcess([]),
    }
    if args.floor_option:
        hosts["floor+"] = lambda: FloorProcess(args.floor_option)
    print(
        f"idle agents: each case a fresh shepherd heartbeat-server (one process, {transport}, {args.machines:,}"
        " keys loaded), and a fresh bare gRPC server with the same TLS and options as its floor, the agents held by"
        " another process after one heartbeat each; RSS from /proc, KiB an agent = (with them - before) / agents:"
    )
    if args.floor_option:
        options = ", ".join(f"{name}={value}" for name, value in args.floor_option)
        print(f"  floor+ is the floor with {options}, its ratio to the floor's")
    header = f"  {'agents':>7}  {'held as':46} {'server before':>13} {'with them':>10} {'an agent':>10}"
    header += f" {'floor':>10} {'ratio':>6}" + (f" {'floor+':>10} {'ratio':>6}" if args.floor_option else "")
    print(header + f" {'fds':>7}")
    samples: dict[tuple[str, str], dict[int, tuple[float, float]]] = {
        (host, case): {} for host in hosts for case in IDLE_CASES
    }
    for count in args.idle_agents:
        for case, label in IDLE_CASES.items():
            line = f"  {count:7,}  {label.format(channels=args.idle_channels):46}"
            kib: dict[str, float] = {}
            for host, make in hosts.items():
                before, during, fds, refused = await idle_case(args, make(), tls, ca_certificate, case, count)
                if refused:
                    raise SystemExit(f"{host}: idle agents refused, the memory is not theirs: {refused}")
                samples[host, case][count] = (before, during)
                kib[host] = (during - before) * 1024 / count
                if host == "server":
                    line += f" {before:9,.0f} MiB {during:6,.0f} MiB {kib[host]:6,.1f} KiB"
                    server_fds = fds
                elif host == "floor":
                    line += f" {kib[host]:6,.1f} KiB {kib['server'] / kib[host]:6.2f}"
                else:
                    line += f" {kib[host]:6,.1f} KiB {kib[host] / kib['floor']:6.2f}"
            print(f"{line} {server_fds:7,}")
    print("  an agent: the slope from the smallest count to the largest (the range of the counts' own figures):")
    for case, label in IDLE_CASES.items():
        figures = {host: per_agent(samples[host, case]) for host in hosts}
        line = f"  {label.format(channels=args.idle_channels):46}"
        for host, figure in figures.items():
            line += f"  {host} {figure.slope:5,.1f} KiB ({figure.low:,.1f}-{figure.high:,.1f})"
        ratio = figures["server"].slope / figures["floor"].slope
        print(f"{line}  server/floor {ratio:.2f}")
    stream = per_agent(samples["server", "stream"])
    base = max(before for before, _ in samples["server", "stream"].values())
    print(f"  sized from an agent of today ({stream.slope:,.1f} KiB) and the server's {base:,.0f} MiB before:")
    for fleet in (10_000, 100_000, 1_000_000):
        print(f"    {fleet:9,} agents on one process: {base + stream.slope * fleet / 1024:9,.0f} MiB")


async def idle_case(
    args: argparse.Namespace,
    host: ServerProcesses | FloorProcess,
    tls: tuple[Path, Path] | None,
    ca_certificate: Path | None,
    case: str,
    count: int,
) -> tuple[float, float, int, dict[str, int]]:
    """A fresh server's RSS in MiB before and while count idle agents are held, its open files then, and the
    agents refused."""
    try:
        target = await host.start(tls)
        (pid,) = host.servers()
        await asyncio.sleep(SETTLE_SECONDS)
        before = status_mib(pid, "VmRSS")
        channels = args.idle_channels if case == "shared" else count
        command = [sys.executable, "-m", "bench.heartbeat_load", "--target", target, "--machines", str(args.machines)]
        command += ["--requests", "0", "--seconds", "0", "--concurrency", "1", "--channels", str(channels)]
        command += ["--idle", str(count), "--call", "unary" if case == "unary" else "stream"]
        if ca_certificate is not None:
            command += ["--ca", str(ca_certificate)]
        load = await asyncio.create_subprocess_exec(*command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert load.stdin is not None and load.stdout is not None
        line = await load.stdout.readline()
        if not line:
            raise SystemExit("the idle-agent process failed")
        held = json.loads(line)
        await asyncio.sleep(SETTLE_SECONDS)
        during = status_mib(pid, "VmRSS")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        load.stdin.write(b"done\n")
        await load.stdin.drain()
        await load.wait()
        return before, during, fds, held["refused"]
    finally:
        await host.stop()


async def start_load(
    args: argparse.Namespace, target: str, ca_certificate: Path | None, call: str
) -> asyncio.subprocess.Process:
    """The load process, once it has signed its requests and connected."""
    command = [sys.executable, "-m", "bench.heartbeat_load", "--target", target, "--machines", str(args.machines)]
    command += ["--requests", str(int(args.seconds * args.expected_rate)), "--seconds", str(args.seconds)]
    command += ["--call", call]
    command += ["--concurrency", str(args.concurrency), "--channels", str(args.channels)]
    if ca_certificate is not None:
        command += ["--ca", str(ca_certificate)]
    load = await asyncio.create_subprocess_exec(*command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert load.stdout is not None
    if (await load.stdout.readline()).strip() != b"ready":
        raise SystemExit("the load process did not start")
    return load


def compare_cpu(cpu_each: dict[str, float]) -> None:
    """The server's CPU a heartbeat of each call against the stream's of the same run, and what a fleet of 100,000
    agents at the default interval needs of it in cores."""
    if "stream" not in cpu_each or len(cpu_each) < 2:
        return
    rate = 100_000 / DEFAULTS.heartbeat_interval
    print(f"server CPU a heartbeat, each call against the stream's; cores for 100,000 agents at {rate:,.0f}/s:")
    for call, seconds in cpu_each.items():
        print(f"  {call:16} {seconds * 1e6:6,.0f} µs  {seconds / cpu_each['stream']:5.2f}  {seconds * rate:5.2f} cores")


def open_channel(target: str, ca_certificate: Path | None) -> grpc.aio.Channel:
    if ca_certificate is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca_certificate.read_bytes()))


def report(
    args: argparse.Namespace,
    call: str,
    seen: LoadSeen,
    cpu: float,
    pg_cpu: float | None,
    load_cpu: float,
    server: InProcessServer | ServerProcesses,
    raw_single: float,
    raw_many: float,
) -> None:
    elapsed, accepted = seen.elapsed, seen.accepted
    rate = accepted / elapsed
    needed = 100_000 / DEFAULTS.heartbeat_interval
    sign_us, verify_us = signature_costs()
    transport = "plain text" if args.plaintext else "TLS"
    print(f"raw psycopg, the same conditional upsert, {RAW_CONNECTIONS} connections, {RAW_SECONDS:.0f} s each:")
    print(f"  one a statement        {raw_single:9,.0f} heartbeats/s")
    print(f"  {RAW_BATCH} a statement        {raw_many:9,.0f} heartbeats/s")
    load = {
        "stream": f"{args.concurrency} streams over {args.channels} connections",
        "unary": f"unary calls, at most {args.concurrency} in flight, over {args.channels} connections",
        "connect": f"unary calls, at most {args.concurrency} in flight, each on a connection of its own",
        "connect-resumed": f"unary calls, at most {args.concurrency} in flight, each on a connection of its own"
        " resuming a TLS session",
    }[call]
    print(
        f"heartbeat server, {args.processes} process{'es' if args.processes > 1 else ''}, {args.machines:,} machines,"
        f" {transport}, load from another process: {load}, {elapsed:.1f} s:"
    )
    print(
        f"  accepted     {rate:,.0f} heartbeats/s ({accepted:,} in all), {rate / raw_single:.2f} of raw psycopg's"
        f" one a statement, {rate / raw_many:.2f} of {RAW_BATCH} a statement"
    )
    print(f"  latency      p50 {seen.p50 * 1000:.1f} ms, p99 {seen.p99 * 1000:.1f} ms")
    rejected = ", ".join(f"{code} {n}" for code, n in sorted(seen.rejected.items())) or "none"
    print(f"  rejected     {sum(seen.rejected.values())} ({rejected})")
    print(f"  statements   {server.batching()}")
    print(f"  peak RSS     {server.peak_rss()}")
    per = max(accepted, 1)
    print(f"  CPU          server {cpu / elapsed:.0%} of a core, {cpu / per * 1e6:,.0f} µs a heartbeat")
    if pg_cpu is not None:
        print(f"               PostgreSQL {pg_cpu / elapsed:.0%} of a core, {pg_cpu / per * 1e6:,.0f} µs a heartbeat")
    print(f"               load process {load_cpu / elapsed:.0%} of a core, {load_cpu / per * 1e6:,.0f} µs a heartbeat")
    print(f"               ed25519: sign {sign_us:.0f} µs (agent), verify {verify_us:.0f} µs (server)")
    print(
        f"  100,000 machines at one heartbeat per {DEFAULTS.heartbeat_interval:.0f} s need {needed:,.0f}/s:"
        f" {rate / needed:.2f} of that, room for about {rate * DEFAULTS.heartbeat_interval:,.0f} machines"
    )
    if seen.ran_out:
        print("  (the load process sent every request it had signed before the time was up)")


CALLS = ("stream", "unary", "connect", "connect-resumed")


def calls(text: str) -> list[str]:
    """--call: the calls the load makes, one after the other against the same server."""
    named = ["stream", "unary"] if text == "both" else [part.strip() for part in text.split(",") if part.strip()]
    unknown = [call for call in named if call not in CALLS]
    if unknown or not named or len(set(named)) < len(named):
        raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(CALLS)} at most once, comma-separated")
    return named


def agent_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError("counts are positive")
    return [count for count in counts if count]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.heartbeats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=200, help="heartbeats in flight at most")
    parser.add_argument("--channels", type=int, default=8, help="gRPC connections the agents share")
    parser.add_argument(
        "--call",
        type=calls,
        default="both",
        help=f"how the load sends, in turn, comma-separated: {', '.join(CALLS)}, or both (stream,unary)",
    )
    parser.add_argument("--plaintext", action="store_true", help="serve without TLS")
    parser.add_argument(
        "--idle-agents",
        type=agent_counts,
        default="2000,5000,10000",
        help="counts of idle agents held to price their memory, comma-separated (0: none)",
    )
    parser.add_argument("--idle-channels", type=int, default=8, help="connections the shared idle streams share")
    parser.add_argument("--idle-only", action="store_true", help="measure the idle agents' memory only")
    parser.add_argument(
        "--floor-option",
        type=core_option,
        action="append",
        default=[],
        help="NAME=VALUE: also hold the idle agents on the floor with this gRPC core option added (repeatable)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="over 1: run shepherd heartbeat-server --processes N instead"
    )
    parser.add_argument(
        "--refusals", type=int, default=1000, help="refusals timed of each kind, after the load (2 at least)"
    )
    parser.add_argument(
        "--expected-rate", type=int, default=8000, help="heartbeats a second to sign beforehand, at most"
    )
    args = parser.parse_args()
    if (
        min(args.machines, args.concurrency, args.channels, args.refusals, args.expected_rate, args.processes) < 1
        or args.idle_channels < 1
        or (args.idle_only and not args.idle_agents)
        or args.seconds <= 0
    ):
        parser.error("every number must be positive")
    if args.refusals < 2:
        parser.error("--refusals must be at least 2: its spread is told in percentiles")
    # An idle agent is a connection, and a file descriptor, in the server and in the load: both inherit this.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        # On Ctrl-C asyncio.run cancels measure(), whose finally stops the server, and raises
        # KeyboardInterrupt here; the with statements then stop PostgreSQL and remove the directory.
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            pg_data = tmp / "pg"
            with LocalPostgres(pg_data) as url:
                migrate.upgrade(url)
                clean = asyncio.run(measure(url, pg_data, tmp, args))
    except KeyboardInterrupt:
        raise SystemExit("interrupted") from None
    if not clean:
        raise SystemExit("heartbeats were rejected: the numbers above are not a clean measurement")


if __name__ == "__main__":
    main()
