"""The reference agent's heartbeats: end to end (built executable, detached daemon, TLS, BMDB), and its retry rule."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent.build import build_agent_executable
from agent.grpc_messages import RpcError
from agent.heartbeat import (
    MIN_RETRY_DELAY,
    STREAM_REFUSED_RETRY_AFTER,
    STREAM_RETRY_AFTER,
    HeartbeatLoop,
    retry_delay,
)
from agent.reference import LOG_FILE, STATE_DIR_VARIABLE
from bmdb.store import BMDB
from foundation.procfs import processes_with_variable
from foundation.tls import local_certificates
from processes.heartbeat_server import SERVICE, build_server
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2, takeover_pb2
from tests.processes import kill_processes_mentioning, process_trees


async def start_server(
    bmdb: BMDB, tmp_path: Path, port: int = 0, service: HeartbeatService | None = None
) -> tuple[grpc.aio.Server, int]:
    certificates = local_certificates(tmp_path / "tls")
    service = service or HeartbeatService(bmdb, interval=0.2, max_skew=60.0)
    server, bound = build_server(
        service, f"127.0.0.1:{port}", (certificates.server_certificate, certificates.server_key)
    )
    await server.start()
    return server, bound


async def heartbeat_after(bmdb: BMDB, machine_id, after: datetime | None, limit: float = 30.0) -> datetime:
    """The machine's heartbeat time once it is later than after."""
    for _ in range(int(limit / 0.1)):
        record = await bmdb.get_machine(machine_id)
        assert record is not None
        if record.agent_heartbeat_at and (after is None or record.agent_heartbeat_at > after):
            return record.agent_heartbeat_at
        await asyncio.sleep(0.1)
    raise AssertionError(f"no heartbeat after {after} within {limit}s")


def agents_running(state_dir: Path) -> int:
    """How many agents run with that state directory."""
    return process_trees(processes_with_variable(f"{STATE_DIR_VARIABLE}={state_dir}".encode()))


def agent_running(state_dir: Path) -> bool:
    return agents_running(state_dir) > 0


@dataclass
class AgentMachine:
    """A machine for the built agent: its BMDB id, the heartbeat server it is told, its state directory."""

    machine_id: uuid.UUID
    server: grpc.aio.Server
    port: int
    init: takeover_pb2.TakeoverInit
    state_dir: Path
    executable: Path

    async def take_over(self) -> takeover_pb2.TakeoverResponse:
        """Run the agent as a takeover does; it answers, detaches and stays."""
        completed = await asyncio.to_thread(
            subprocess.run,
            [str(self.executable)],
            input=self.init.SerializeToString(),
            capture_output=True,
            env={STATE_DIR_VARIABLE: str(self.state_dir), "PATH": "/usr/bin:/bin"},
            timeout=30,
            check=True,
        )
        return takeover_pb2.TakeoverResponse.FromString(completed.stdout)


@pytest.fixture
async def agent_machine(tmp_path: Path, bmdb: BMDB) -> AsyncIterator[AgentMachine]:
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    server, port = await start_server(bmdb, tmp_path)
    ca_der = x509.load_pem_x509_certificate(
        local_certificates(tmp_path / "tls").ca_certificate.read_bytes()
    ).public_bytes(Encoding.DER)
    # Refusals after an accepted heartbeat stop the agent after 3 s here, where Shepherd says its heartbeat timeout.
    init = takeover_pb2.TakeoverInit(
        machine_id=str(machine_id),
        endpoint=f"127.0.0.1:{port}",
        ca_certificate=ca_der,
        refused_for_seconds_before_stopping=3,
    )
    state_dir = tmp_path / "agent-state"
    state_dir.mkdir()
    machine = AgentMachine(machine_id, server, port, init, state_dir, build_agent_executable(tmp_path / "agent"))
    try:
        yield machine
    finally:
        kill_processes_mentioning(str(state_dir))
        await machine.server.stop(None)


async def test_agent_detaches_sends_heartbeats_survives_an_outage_and_yields_to_a_newer_agent(
    tmp_path, bmdb, agent_machine
):
    machine_id, state_dir = agent_machine.machine_id, agent_machine.state_dir
    # The SSH session would end once it answered: the agent detached.
    response = await agent_machine.take_over()
    assert response.WhichOneof("result") == "success"
    assert agent_running(state_dir)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), response.success.key)
    first = await heartbeat_after(bmdb, machine_id, None)

    # The server goes away for a while; the agent keeps trying and catches up when it is back.
    await agent_machine.server.stop(None)
    await asyncio.sleep(1.0)
    assert agent_running(state_dir)
    agent_machine.server, _ = await start_server(bmdb, tmp_path, agent_machine.port)
    await heartbeat_after(bmdb, machine_id, first)

    # BMDB names another key (a newer agent, or a wrong BMDB): this one is refused, goes on for as long as the
    # takeover told it (Shepherd's heartbeat timeout), then stops.
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"\x01" * 32)
    refused_at = time.monotonic()
    for _ in range(300):
        if not agent_running(state_dir):
            break
        await asyncio.sleep(0.1)
    assert not agent_running(state_dir) and time.monotonic() - refused_at >= 3
    log = (state_dir / LOG_FILE).read_text()
    assert "after being accepted: retrying for 3s" in log
    assert "stopped: heartbeat refused (" in log and "s: a newer agent has taken over" in log


async def test_an_agent_never_recorded_stops_when_a_newer_agent_takes_the_machine(bmdb, agent_machine):
    # The first takeover's worker dies before recording the key: that agent is refused, and keeps trying.
    await agent_machine.take_over()
    await asyncio.sleep(1.0)
    assert agent_running(agent_machine.state_dir)
    # The retried takeover starts a newer agent on the machine: the stray one sees it and stops.
    newer = await agent_machine.take_over()
    await bmdb.record_agent_started(agent_machine.machine_id, datetime.now(UTC), newer.success.key)
    await heartbeat_after(bmdb, agent_machine.machine_id, None)
    log = agent_machine.state_dir / LOG_FILE
    for _ in range(300):
        if "a newer agent has taken over this machine" in log.read_text():
            break
        await asyncio.sleep(0.1)
    assert "stopped: a newer agent has taken over this machine" in log.read_text()
    # It logs before it exits, and its one-file bootloader then removes what it unpacked.
    for _ in range(100):
        if agents_running(agent_machine.state_dir) == 1:
            break
        await asyncio.sleep(0.1)
    assert agents_running(agent_machine.state_dir) == 1, "only the newer agent runs"


async def test_an_agent_whose_key_is_removed_by_a_stop_ends_before_its_next_heartbeat(bmdb, agent_machine):
    response = await agent_machine.take_over()
    await bmdb.record_agent_started(agent_machine.machine_id, datetime.now(UTC), response.success.key)
    await heartbeat_after(bmdb, agent_machine.machine_id, None)
    stopped = await asyncio.to_thread(
        subprocess.run,
        [str(agent_machine.executable), "--stop"],
        capture_output=True,
        env={STATE_DIR_VARIABLE: str(agent_machine.state_dir), "PATH": "/usr/bin:/bin"},
        timeout=30,
        check=True,
    )
    assert stopped.stdout.decode().startswith("stopped: removed the agent key")
    for _ in range(300):
        if not agent_running(agent_machine.state_dir):
            break
        await asyncio.sleep(0.1)
    assert not agent_running(agent_machine.state_dir)
    assert "the machine is being decommissioned" in (agent_machine.state_dir / LOG_FILE).read_text()


def test_retry_delays_grow_to_the_cap_with_jitter_that_sets_agents_apart():
    cap = 300.0
    first, second = random.Random(1), random.Random(2)
    delays = [retry_delay(n, 5.0, cap, first) for n in range(1, 200)]
    assert all(MIN_RETRY_DELAY <= delay <= cap for delay in delays)
    assert all(delay <= 5.0 * 2 ** (n - 1) for n, delay in enumerate(delays[:6], 1))
    assert max(delays[20:]) > cap / 2  # the window reached the cap
    # Two agents that failed at the same moment retry at different moments.
    assert [round(d, 3) for d in delays[:20]] != [round(retry_delay(n, 5.0, cap, second), 3) for n in range(1, 21)]


def refused(code: str) -> RpcError:
    """What a call refused with a status raises."""
    return RpcError(code, f"test {code}")


def test_the_agent_never_gives_up_and_stops_only_when_refused_for_its_heartbeat_timeout():
    answers: list[str | None] = (
        ["UNAVAILABLE"] * 500  # most of a day of outage, as the agent sees it
        + ["UNAUTHENTICATED"] * 3  # Shepherd has not recorded the key yet: keep trying
        + [None, "INTERNAL", None]
        + ["UNAUTHENTICATED"] * 4  # a heartbeat server on a wrong or restored BMDB, for a while: keep trying
        + [None]
        + ["UNAUTHENTICATED"] * 1000  # refused past the heartbeat timeout: a newer agent runs
    )
    now = [0.0]
    slept: list[float] = []
    log: list[str] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    def call(request: agent_api_pb2.HeartbeatRequest, timeout: float) -> agent_api_pb2.HeartbeatResponse:
        code = answers.pop(0)
        if code is not None:
            raise refused(code)
        return agent_api_pb2.HeartbeatResponse(next_heartbeat_in_ms=30_000)

    loop = HeartbeatLoop(
        str(uuid.uuid4()),
        Ed25519PrivateKey.generate(),
        "h:1",
        (),
        log=log.append,
        sleep=sleep,
        monotonic=lambda: now[0],
        refused_for_before_stopping=600.0,
    )
    reason = loop.run(call)
    assert reason.startswith("heartbeat refused (test UNAUTHENTICATED) for ")
    assert reason.endswith("s: a newer agent has taken over")
    assert 600 <= int(reason.split(" for ")[1].split("s:")[0]) <= 600 + 300
    assert 900 < len(answers) < 1000, "it stopped after the heartbeat timeout, not at the first refusal"
    # Far past the hour after which agents used to give up.
    assert sum(slept[:503]) > 10 * 3600 and max(slept) <= 300.0
    assert len(set(slept[100:503])) > 300  # jittered, not in step
    # The log grows with the logarithm of the outage, not with it.
    assert len(log) < 40 and "heartbeat accepted again after 4 failure(s)" in log


def test_an_agent_whose_key_was_never_recorded_stops_once_a_newer_agent_runs_on_its_machine():
    # Its takeover's worker died before recording the key: Shepherd refuses it, and it cannot tell why.
    calls: list[str] = []
    checks = iter([None] * 5 + ["a newer agent has taken over this machine"])

    def call(request: agent_api_pb2.HeartbeatRequest, timeout: float) -> agent_api_pb2.HeartbeatResponse:
        calls.append(request.machine_id)
        raise refused("UNAUTHENTICATED")

    loop = HeartbeatLoop(
        str(uuid.uuid4()),
        Ed25519PrivateKey.generate(),
        "h:1",
        (),
        sleep=lambda _: None,
        stop_reason=lambda: next(checks),
    )
    assert loop.run(call) == "a newer agent has taken over this machine"
    assert len(calls) == 5


async def test_an_agent_whose_clock_is_an_hour_behind_follows_the_servers_time(tmp_path, bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
    server, port = await start_server(bmdb, tmp_path)
    ca_der = x509.load_pem_x509_certificate(
        local_certificates(tmp_path / "tls").ca_certificate.read_bytes()
    ).public_bytes(Encoding.DER)
    lines: list[str] = []
    waits: list[float] = []

    class Enough(Exception):
        pass

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            raise Enough

    endpoint = f"127.0.0.1:{port}"
    behind = lambda: time.time() - 3600  # noqa: E731
    loop = HeartbeatLoop(str(machine_id), key, endpoint, [ca_der], log=lines.append, sleep=sleep, clock=behind)
    try:
        with pytest.raises(Enough):
            await asyncio.to_thread(loop.run)
    finally:
        await server.stop(None)
    # Refused once as stale, corrected at once, then two heartbeats accepted in a row: signed and still in order.
    assert lines == ["this machine's clock is 3600s behind the heartbeat server's: heartbeats follow it"]
    assert waits == [0.2, 0.2]
    assert await heartbeat_after(bmdb, machine_id, None)


async def test_the_built_agent_sends_its_heartbeats_on_one_stream(bmdb, tmp_path, agent_machine):
    await agent_machine.server.stop(None)
    service = HeartbeatService(bmdb, interval=0.2, max_skew=60.0)
    agent_machine.server, _ = await start_server(bmdb, tmp_path, agent_machine.port, service)
    response = await agent_machine.take_over()
    await bmdb.record_agent_started(agent_machine.machine_id, datetime.now(UTC), response.success.key)
    first = await heartbeat_after(bmdb, agent_machine.machine_id, None)
    await heartbeat_after(bmdb, agent_machine.machine_id, first)
    assert service.calls["stream"] >= 2 and service.calls["unary"] == 0
    assert service.streams == 1, "one stream, kept open across heartbeats"
    # Between heartbeats the agent blocks on its socket in its one thread: no helper thread wakes it up.
    processes = processes_with_variable(f"{STATE_DIR_VARIABLE}={agent_machine.state_dir}".encode())
    assert processes and all(thread_count(pid) == 1 for pid in processes)


def thread_count(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for process {pid}")


async def machine_with_agent_key(bmdb: BMDB) -> tuple[uuid.UUID, Ed25519PrivateKey]:
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
    return machine_id, key


def ca_of(tmp_path: Path) -> bytes:
    pem = local_certificates(tmp_path / "tls").ca_certificate.read_bytes()
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


class Enough(Exception):
    pass


def sleeps_until(count: int, waits: list[float]):
    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == count:
            raise Enough

    return sleep


async def test_an_agent_falls_back_to_unary_calls_on_a_server_without_the_stream(tmp_path, bmdb):
    machine_id, key = await machine_with_agent_key(bmdb)
    certificates = local_certificates(tmp_path / "tls")
    service = HeartbeatService(bmdb, interval=0.2, max_skew=60.0)
    # An older server: the unary Heartbeat only.
    server = grpc.aio.server()
    unary = grpc.unary_unary_rpc_method_handler(
        service.handle, request_deserializer=None, response_serializer=agent_api_pb2.HeartbeatResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Heartbeat": unary}),))
    pair = (certificates.server_key.read_bytes(), certificates.server_certificate.read_bytes())
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair]))
    await server.start()
    lines: list[str] = []
    waits: list[float] = []
    loop = HeartbeatLoop(
        str(machine_id), key, f"127.0.0.1:{port}", [ca_of(tmp_path)], log=lines.append, sleep=sleeps_until(3, waits)
    )
    try:
        with pytest.raises(Enough):
            await asyncio.to_thread(loop.run)
    finally:
        await server.stop(None)
    assert lines == ["the heartbeat server has no heartbeat stream (an older Shepherd): using unary calls"]
    assert waits == [0.2, 0.2, 0.2], "accepted at once, without a failure counted"
    assert service.calls == {"unary": 3} and service.results == {"accepted": 3}
    assert STREAM_RETRY_AFTER >= 3600, "the stream is tried again only after a long while"


async def test_an_agent_told_to_retry_later_on_its_stream_backs_off_as_the_server_says(tmp_path, bmdb):
    machine_id, key = await machine_with_agent_key(bmdb)
    service = HeartbeatService(bmdb, interval=0.2, max_skew=60.0, max_in_flight=0)
    server, port = await start_server(bmdb, tmp_path, service=service)
    lines: list[str] = []
    waits: list[float] = []
    loop = HeartbeatLoop(
        str(machine_id), key, f"127.0.0.1:{port}", [ca_of(tmp_path)], log=lines.append, sleep=sleeps_until(2, waits)
    )
    try:
        with pytest.raises(Enough):
            await asyncio.to_thread(loop.run)
    finally:
        await server.stop(None)
    assert all(2.5 <= wait <= 5.0 for wait in waits), waits
    assert lines[0].startswith("heartbeat failed 1 time(s) (RETRY_LATER: the heartbeat server is handling")
    assert service.calls == {"stream": 2} and service.streams == 0


@pytest.mark.parametrize("cap", ["global", "per address"])
async def test_an_agent_refused_a_stream_by_a_cap_sends_unary_calls_meanwhile_and_tries_a_stream_later(
    tmp_path, bmdb, cap: str
):
    machine_id, key = await machine_with_agent_key(bmdb)
    if cap == "global":
        service = HeartbeatService(bmdb, interval=0.2, max_skew=60.0, max_streams=0)
    else:
        service = HeartbeatService(bmdb, interval=0.2, max_skew=60.0, max_streams_per_address=1)
    server, port = await start_server(bmdb, tmp_path, service=service)
    credentials = grpc.ssl_channel_credentials(local_certificates(tmp_path / "tls").ca_certificate.read_bytes())
    # Another agent of the same address holds the one stream it may have.
    neighbour = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)
    held = neighbour.stream_stream(f"/{SERVICE}/Heartbeats")()
    lines: list[str] = []
    waits: list[float] = []
    loop = HeartbeatLoop(
        str(machine_id), key, f"127.0.0.1:{port}", [ca_of(tmp_path)], log=lines.append, sleep=sleeps_until(3, waits)
    )
    try:
        if cap == "per address":
            for _ in range(100):
                if service.streams == 1:
                    break
                await asyncio.sleep(0.05)
            assert service.streams == 1, "the neighbour's stream is open"
        clock = time.monotonic()
        with pytest.raises(Enough):
            await asyncio.to_thread(loop.run)
        assert time.monotonic() - clock < STREAM_REFUSED_RETRY_AFTER / 2
    finally:
        held.cancel()
        await neighbour.close()
        await server.stop(None)
    [refused] = lines
    assert refused.startswith("the heartbeat server refused a heartbeat stream (")
    assert "setting heartbeat_max_streams" in refused and "using unary calls for " in refused
    assert STREAM_REFUSED_RETRY_AFTER / 2 <= float(refused.rsplit(" ", 1)[1].rstrip("s")) <= STREAM_REFUSED_RETRY_AFTER
    # The heartbeats went on at once, on the unary call: none failed, none waited a back-off.
    assert waits == [0.2, 0.2, 0.2]
    assert service.calls["unary"] == 3 and service.results["accepted"] == 3
    # The agent's stream was refused once (and, at the global cap, its neighbour's too).
    if cap == "global":
        assert service.results["too_many_streams"] == 2
    else:
        assert service.results["too_many_streams_from_address"] == 1


def test_an_agent_refused_a_stream_by_a_cap_tries_a_stream_again_after_a_while():
    assert 60 <= STREAM_REFUSED_RETRY_AFTER <= STREAM_RETRY_AFTER
