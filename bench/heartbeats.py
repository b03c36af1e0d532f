"""Benchmark: heartbeat ingestion by one heartbeat server process.

Registers the given number of machines, each with an agent key of its own, in
a local PostgreSQL; serves the real heartbeat server (TLS unless --plaintext)
on a loopback port; and has one simulated agent per machine send signed
heartbeats back to back over a few shared gRPC channels, at most --concurrency
in flight, for --seconds. The agents run on the server's event loop, so the
rate is a lower bound of what the server alone takes. Run:

    python -m bench.heartbeats [--machines 1000] [--seconds 20] [--concurrency 200] [--plaintext] [--refusals 1000]

Then it times refusals one at a time: a wrong key on a real id against an
unknown id, which must not be told apart.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from activities.fleet import each_at_most
from agent.heartbeat import signed_heartbeat
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.tls import local_certificates
from processes.heartbeat_server import HeartbeatService, build_server
from proto import agent_api_pb2, agent_api_pb2_grpc
from proto.signing import NONCE_SIZE, signing_payload

DEFAULTS = Settings()
# Registration is three short transactions per machine; about the BMDB pool's size keeps it busy without queueing.
REGISTER_CONCURRENCY = 20
CALL_TIMEOUT = 10.0

Heartbeat = Callable[..., Awaitable[agent_api_pb2.HeartbeatResponse]]


@dataclass
class Agent:
    machine_id: str
    key: Ed25519PrivateKey


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)


async def register(bmdb: BMDB, count: int) -> list[Agent]:
    """Machines as they are after a takeover: admitted, provided, agent started with its key."""

    async def one(n: int) -> Agent:
        machine_id, _ = await bmdb.admit_machine("sim", f"node-{n:06d}")
        await bmdb.record_provided(machine_id, address="10.0.0.1", ssh_port=22, location="bench")
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
        return Agent(str(machine_id), key)

    return await each_at_most(range(1, count + 1), REGISTER_CONCURRENCY, one)


async def heartbeat_back_to_back(
    agent: Agent, heartbeat: Heartbeat, slots: asyncio.Semaphore, deadline: float, results: Results
) -> None:
    last_sent_ms = 0
    while True:
        async with slots:
            if time.perf_counter() >= deadline:
                return
            # The server refuses a heartbeat not newer than the machine's last one as a replay.
            last_sent_ms = max(int(time.time() * 1000), last_sent_ms + 1)
            request = signed_heartbeat(agent.machine_id, agent.key, now_ms=last_sent_ms)
            start = time.perf_counter()
            try:
                await heartbeat(request, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as error:
                results.rejected[error.code().name] += 1
                continue
            results.latencies.append(time.perf_counter() - start)


def open_channels(target: str, count: int, ca_certificate: Path | None) -> list[grpc.aio.Channel]:
    # Channels with equal arguments share one connection unless each keeps its own subchannel pool.
    options = [("grpc.use_local_subchannel_pool", 1)]
    if ca_certificate is None:
        return [grpc.aio.insecure_channel(target, options=options) for _ in range(count)]
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_certificate.read_bytes())
    return [grpc.aio.secure_channel(target, credentials, options=options) for _ in range(count)]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


async def measure(url: str, pg_data: Path, tmp: Path, args: argparse.Namespace) -> Results:
    bmdb = BMDB(url)
    server: grpc.aio.Server | None = None
    channels: list[grpc.aio.Channel] = []
    try:
        setup = time.perf_counter()
        agents = await register(bmdb, args.machines)
        print(f"registered {len(agents)} machines in {time.perf_counter() - setup:.1f} s")
        service = HeartbeatService(bmdb, interval=DEFAULTS.heartbeat_interval, max_skew=DEFAULTS.heartbeat_max_skew)
        tls = None
        ca_certificate = None
        if not args.plaintext:
            certificates = local_certificates(tmp / "tls")
            tls = (certificates.server_certificate, certificates.server_key)
            ca_certificate = certificates.ca_certificate
        server, port = build_server(service, "127.0.0.1:0", tls)
        await server.start()
        channels = open_channels(f"127.0.0.1:{port}", args.channels, ca_certificate)
        # Connections and TLS handshakes happen once per channel: not part of the steady state measured.
        await asyncio.gather(*(channel.channel_ready() for channel in channels))
        calls = [agent_api_pb2_grpc.AgentCallbackStub(channel).Heartbeat for channel in channels]

        results = Results()
        slots = asyncio.Semaphore(args.concurrency)
        cpu_before, pg_before = cpu_seconds(), postgres_cpu_seconds(pg_data)
        start = time.perf_counter()
        deadline = start + args.seconds
        await asyncio.gather(
            *(
                heartbeat_back_to_back(agent, calls[n % len(calls)], slots, deadline, results)
                for n, agent in enumerate(agents)
            )
        )
        elapsed = time.perf_counter() - start
        cpu, pg_after = cpu_seconds() - cpu_before, postgres_cpu_seconds(pg_data)
        pg_cpu = None if pg_before is None or pg_after is None else pg_after - pg_before
        report(args, results, elapsed, cpu, pg_cpu, service.results["accepted"])
        await refusal_timing(calls[0], agents, args.refusals)
        return results
    finally:
        for channel in channels:
            await channel.close()
        if server is not None:
            await server.stop(grace=None)
        await bmdb.close()


async def refusal_timing(heartbeat: Heartbeat, agents: list[Agent], samples: int) -> None:
    """What a prober with a clock sees: the time to refuse a wrong key on a real id, against an unknown id."""
    wrong_key = Ed25519PrivateKey.generate()
    strangers = [str(uuid.uuid4()) for _ in range(10)]
    kinds: dict[str, Callable[[int], agent_api_pb2.HeartbeatRequest]] = {
        "a real id, wrong key": lambda n: signed_heartbeat(agents[n % len(agents)].machine_id, wrong_key),
        "an unknown id, asked before": lambda n: signed_heartbeat(strangers[n % len(strangers)], wrong_key),
        "an unknown id, new": lambda n: signed_heartbeat(str(uuid.uuid4()), wrong_key),
    }
    for stranger in strangers:  # each is then an id the server knows to have no agent
        await refused(heartbeat, signed_heartbeat(stranger, wrong_key))
    durations: dict[str, list[float]] = {kind: [] for kind in kinds}
    # One at a time, the kinds taking turns: each sees the same server, unloaded, as a careful prober would.
    for n in range(samples):
        for kind, request in kinds.items():
            durations[kind].append(await refused(heartbeat, request(n)))
    baseline = statistics.median(durations["a real id, wrong key"])
    print(f"refusal time, {samples:,} of each kind one at a time (median; ratio to a wrong key on a real id):")
    for kind, times in durations.items():
        median = statistics.median(times)
        print(f"  {kind:28} {median * 1e6:7,.0f} µs  {median / baseline:.2f}")


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


def report(
    args: argparse.Namespace,
    results: Results,
    elapsed: float,
    cpu: float,
    pg_cpu: float | None,
    accepted_by_server: int,
) -> None:
    accepted = len(results.latencies)
    rate = accepted / elapsed
    needed = args.machines / DEFAULTS.heartbeat_interval
    latencies = sorted(results.latencies) or [0.0]
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    sign_us, verify_us = signature_costs()
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    transport = "plain text" if args.plaintext else "TLS"
    print(
        f"heartbeat ingestion, {args.machines} machines, {transport}, at most {args.concurrency} in flight"
        f" over {args.channels} channel{'s' if args.channels != 1 else ''}, {elapsed:.1f} s:"
    )
    print(f"  accepted     {rate:,.0f} heartbeats/s ({accepted:,} in all; the server counted {accepted_by_server:,})")
    print(f"  latency      p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    rejected = ", ".join(f"{code} {n}" for code, n in results.rejected.most_common()) or "none"
    print(f"  rejected     {sum(results.rejected.values())} ({rejected})")
    print(f"  peak RSS     {peak_rss_mib:,.0f} MiB (server and agents)")
    per_heartbeat = f"{cpu / max(accepted, 1) * 1e6:,.0f} µs per heartbeat"
    print(f"  CPU          this process {cpu / elapsed:.0%} of a core, {per_heartbeat} (server and agents)")
    if pg_cpu is not None:
        print(
            f"               PostgreSQL {pg_cpu / elapsed:.0%} of a core,"
            f" {pg_cpu / max(accepted, 1) * 1e6:,.0f} µs per heartbeat"
        )
    print(f"               ed25519: sign {sign_us:.0f} µs (agent), verify {verify_us:.0f} µs (server)")
    headroom = f"{rate / needed:,.1f}x headroom" if rate >= needed else f"only {rate / needed:.0%} of that"
    print(
        f"  fleet needs  {needed:,.1f} heartbeats/s at one per {DEFAULTS.heartbeat_interval:.0f} s: {headroom},"
        f" room for about {rate * DEFAULTS.heartbeat_interval:,.0f} machines"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.heartbeats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=200, help="heartbeats in flight at most")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels (connections) the agents share")
    parser.add_argument("--plaintext", action="store_true", help="serve without TLS")
    parser.add_argument("--refusals", type=int, default=1000, help="refusals timed of each kind, after the load")
    args = parser.parse_args()
    if min(args.machines, args.concurrency, args.channels, args.refusals) < 1 or args.seconds <= 0:
        parser.error("--machines, --concurrency, --channels, --refusals and --seconds must be positive")
    try:
        # On Ctrl-C asyncio.run cancels measure(), whose finally stops the server, and raises
        # KeyboardInterrupt here; the with statements then stop PostgreSQL and remove the directory.
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            pg_data = tmp / "pg"
            with LocalPostgres(pg_data) as url:
                migrate.upgrade(url)
                results = asyncio.run(measure(url, pg_data, tmp, args))
    except KeyboardInterrupt:
        raise SystemExit("interrupted") from None
    if results.rejected:
        raise SystemExit("heartbeats were rejected: the numbers above are not a clean measurement")


if __name__ == "__main__":
    main()
