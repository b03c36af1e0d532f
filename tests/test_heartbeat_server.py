"""The heartbeat server over real gRPC (TLS) with a real BMDB: who gets in, who does not."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent.heartbeat import signed_heartbeat
from bmdb.store import BMDB
from foundation.tls import local_certificates
from processes import heartbeat_auth, heartbeat_service
from processes.heartbeat_server import SERVICE, build_server
from processes.heartbeat_service import HeartbeatService
from proto import SERVER_TIME_METADATA, agent_api_pb2, agent_api_pb2_grpc


@dataclass
class Agent:
    machine_id: uuid.UUID
    key: Ed25519PrivateKey


@dataclass
class HeartbeatEndpoint:
    channel: grpc.aio.Channel
    stub: agent_api_pb2_grpc.AgentCallbackStub
    service: HeartbeatService


@pytest.fixture
async def agent(bmdb: BMDB) -> Agent:
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
    return Agent(machine_id, key)


@pytest.fixture
async def endpoint(bmdb: BMDB, tmp_path) -> AsyncIterator[HeartbeatEndpoint]:
    certificates = local_certificates(tmp_path / "tls")
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    server, port = build_server(service, "127.0.0.1:0", (certificates.server_certificate, certificates.server_key))
    await server.start()
    credentials = grpc.ssl_channel_credentials(root_certificates=certificates.ca_certificate.read_bytes())
    channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)
    yield HeartbeatEndpoint(channel, agent_api_pb2_grpc.AgentCallbackStub(channel), service)
    await channel.close()
    await server.stop(None)


async def heartbeat_at(bmdb: BMDB, machine_id: uuid.UUID) -> datetime | None:
    record = await bmdb.get_machine(machine_id)
    assert record is not None
    return record.agent_heartbeat_at


async def rejected(endpoint: HeartbeatEndpoint, request: agent_api_pb2.HeartbeatRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await endpoint.stub.Heartbeat(request)
    return caught.value


async def test_signed_heartbeat_is_recorded(endpoint, agent, bmdb):
    assert await heartbeat_at(bmdb, agent.machine_id) is None
    response = await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))
    assert response.next_heartbeat_in_ms == 30_000
    assert await heartbeat_at(bmdb, agent.machine_id) is not None
    assert endpoint.service.results["accepted"] == 1


async def test_unknown_machine_and_wrong_key_get_the_same_answer(endpoint, agent, bmdb):
    stranger = await rejected(endpoint, signed_heartbeat(str(uuid.uuid4()), agent.key))
    wrong_key = await rejected(endpoint, signed_heartbeat(str(agent.machine_id), Ed25519PrivateKey.generate()))
    assert stranger.code() == wrong_key.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stranger.details() == wrong_key.details()
    assert await heartbeat_at(bmdb, agent.machine_id) is None


async def test_bad_signature_is_unauthenticated(endpoint, agent, bmdb):
    request = signed_heartbeat(str(agent.machine_id), agent.key)
    request.sent_at_unix_ms += 1  # the signature covered the old time
    assert (await rejected(endpoint, request)).code() == grpc.StatusCode.UNAUTHENTICATED
    assert await heartbeat_at(bmdb, agent.machine_id) is None


async def test_stale_timestamp_is_refused(endpoint, agent, bmdb):
    ten_minutes_ago = int(datetime.now(UTC).timestamp() * 1000) - 600_000
    error = await rejected(endpoint, signed_heartbeat(str(agent.machine_id), agent.key, now_ms=ten_minutes_ago))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "clock" in (error.details() or "")
    assert await heartbeat_at(bmdb, agent.machine_id) is None


async def test_a_stale_refusal_tells_the_servers_time_and_the_skew_is_logged_once(endpoint, agent, bmdb, caplog):
    an_hour_behind = int(datetime.now(UTC).timestamp() * 1000) - 3_600_000
    for _ in range(3):
        error = await rejected(endpoint, signed_heartbeat(str(agent.machine_id), agent.key, now_ms=an_hour_behind))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        told = dict(error.trailing_metadata())[SERVER_TIME_METADATA]
        assert abs(int(told) - datetime.now(UTC).timestamp() * 1000) < 5_000
    warnings = [r.getMessage() for r in caplog.records if "the server's (at most" in r.getMessage()]
    assert len(warnings) == 1 and f"machine {agent.machine_id} is 3600s behind" in warnings[0]
    # In the server's time, the same agent is accepted.
    await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key, now_ms=int(told)))
    assert await heartbeat_at(bmdb, agent.machine_id) is not None


async def test_replayed_and_older_requests_are_refused(endpoint, agent, bmdb):
    now = int(datetime.now(UTC).timestamp() * 1000)
    first = signed_heartbeat(str(agent.machine_id), agent.key, now_ms=now)
    await endpoint.stub.Heartbeat(first)
    recorded = await heartbeat_at(bmdb, agent.machine_id)
    assert (await rejected(endpoint, first)).code() == grpc.StatusCode.ALREADY_EXISTS
    older = signed_heartbeat(str(agent.machine_id), agent.key, now_ms=now - 1000)
    assert (await rejected(endpoint, older)).code() == grpc.StatusCode.ALREADY_EXISTS
    assert await heartbeat_at(bmdb, agent.machine_id) == recorded


async def test_an_agent_forgotten_or_replaced_after_its_key_was_cached_is_refused(endpoint, agent, bmdb):
    await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))
    await bmdb.forget_agent(agent.machine_id, "test recovery")
    forgotten = await rejected(endpoint, signed_heartbeat(str(agent.machine_id), agent.key))
    assert forgotten.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await heartbeat_at(bmdb, agent.machine_id) is None

    new_key = Ed25519PrivateKey.generate()
    public = new_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(agent.machine_id, datetime.now(UTC), public)
    await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), new_key))
    replaced = await rejected(endpoint, signed_heartbeat(str(agent.machine_id), agent.key))
    assert replaced.code() == grpc.StatusCode.UNAUTHENTICATED
    # Replaced again while the new agent's key is cached: the old key is refused, the newest accepted.
    newest_key = Ed25519PrivateKey.generate()
    public = newest_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(agent.machine_id, datetime.now(UTC), public)
    assert (await rejected(endpoint, signed_heartbeat(str(agent.machine_id), new_key))).code() == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), newest_key))
    assert endpoint.service.results == {"accepted": 3, "unauthenticated": 3}


async def test_more_agents_than_cached_keys_are_all_accepted(bmdb, agent, tmp_path):
    others = []
    for n in range(2, 5):
        machine_id, _ = await bmdb.admit_machine("sim", f"node-{n:04d}")
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
        others.append(Agent(machine_id, key))
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, key_cache_size=2)
    server, port = build_server(service, "127.0.0.1:0", None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            now = int(datetime.now(UTC).timestamp() * 1000)
            for round_ in range(3):
                for each in [agent, *others]:
                    await stub.Heartbeat(signed_heartbeat(str(each.machine_id), each.key, now_ms=now + round_))
    finally:
        await server.stop(None)
    assert service.results == {"accepted": 12}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"machine_id": "not-a-uuid"}, "machine_id"),
        ({"nonce": b""}, "nonce"),
        ({"signature": b""}, "signature"),
        ({"sent_at_unix_ms": 0}, "sent_at_unix_ms"),
    ],
)
async def test_missing_or_malformed_fields_are_named(endpoint, agent, bmdb, change, field):
    request = signed_heartbeat(str(agent.machine_id), agent.key)
    for name, value in change.items():
        setattr(request, name, value)
    error = await rejected(endpoint, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")
    assert await heartbeat_at(bmdb, agent.machine_id) is None


async def raw_call(endpoint: HeartbeatEndpoint, payload: bytes) -> grpc.aio.AioRpcError:
    call = endpoint.channel.unary_unary(f"/{SERVICE}/Heartbeat", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(payload)
    return caught.value


async def test_bytes_that_are_no_request_and_oversized_requests(endpoint, agent, bmdb):
    assert (await raw_call(endpoint, b"\xff\xff\xff\xff")).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await raw_call(endpoint, b"\x0a" + b"\x80" * 5000)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server keeps serving after all that.
    await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))
    assert await heartbeat_at(bmdb, agent.machine_id) is not None
    assert endpoint.service.results["malformed"] == 1


async def test_plain_text_only_when_asked(bmdb, agent):
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    server, port = build_server(service, "127.0.0.1:0", None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            await stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))
    finally:
        await server.stop(None)


async def test_a_second_server_cannot_take_a_port_one_listens_on(bmdb):
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    first, port = build_server(service, "127.0.0.1:0", None)
    await first.start()
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: the port is taken"):
            build_server(service, f"127.0.0.1:{port}", None)
    finally:
        await first.stop(None)


async def test_the_command_says_in_one_line_that_it_cannot_listen(bmdb_url, shepherd_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = {
            "SHEPHERD_DATABASE_URL": bmdb_url,
            "SHEPHERD_HEARTBEAT_PLAINTEXT": "true",
            "SHEPHERD_HEARTBEAT_LISTEN": f"127.0.0.1:{port}",
        }
        code, out, err = await shepherd_cli(env, "heartbeat-server")
    assert (code, out) == (1, "")
    assert err == (
        f"shepherd heartbeat-server: cannot listen on 127.0.0.1:{port}: the port is taken, or the address is not "
        "this host's (setting heartbeat_listen)\n"
    )


@dataclass
class Costs:
    """What the server paid: the machines whose key it read from BMDB, the keys it checked signatures with."""

    reads: list[uuid.UUID]
    verified: list[bytes]


def counted_costs(bmdb: BMDB, monkeypatch: pytest.MonkeyPatch, read_delay: float = 0.0) -> Costs:
    costs = Costs([], [])
    read = bmdb.agent_public_key
    signed_by = heartbeat_auth._signed_by

    async def counted_read(machine_id: uuid.UUID) -> bytes | None:
        costs.reads.append(machine_id)
        await asyncio.sleep(read_delay)
        return await read(machine_id)

    def counted_verification(key: bytes, request: agent_api_pb2.HeartbeatRequest) -> bool:
        costs.verified.append(key)
        return signed_by(key, request)

    monkeypatch.setattr(bmdb, "agent_public_key", counted_read)
    monkeypatch.setattr(heartbeat_auth, "_signed_by", counted_verification)
    return costs


@asynccontextmanager
async def served(service: HeartbeatService) -> AsyncIterator[HeartbeatEndpoint]:
    """The service on a loopback port without TLS, and a channel to it."""
    server, port = build_server(service, "127.0.0.1:0", None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield HeartbeatEndpoint(channel, agent_api_pb2_grpc.AgentCallbackStub(channel), service)
    finally:
        await server.stop(None)


async def test_a_flood_of_unknown_ids_costs_one_bmdb_read_a_window_and_a_verification_each(agent, bmdb, monkeypatch):
    costs = counted_costs(bmdb, monkeypatch)
    reads, verified = costs.reads, costs.verified
    stranger = uuid.uuid4()
    async with served(HeartbeatService(bmdb, interval=30.0, max_skew=60.0, unknown_for=60.0)) as endpoint:
        for _ in range(20):
            error = await rejected(endpoint, signed_heartbeat(str(stranger), agent.key))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert reads == [stranger], "BMDB is asked once a window about an id it does not know"
        assert len(verified) == 20 and set(verified) == {heartbeat_auth.DUMMY_KEY}, "verified like a wrong key"
        # The machine's own agent is not held up by the strangers.
        await endpoint.stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))
    assert await heartbeat_at(bmdb, agent.machine_id) is not None


async def test_a_new_agent_heard_before_its_key_was_recorded_is_let_in_a_second_later(endpoint, bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0002")
    key = Ed25519PrivateKey.generate()
    # The agent's first heartbeat overtook the takeover's record of its key.
    error = await rejected(endpoint, signed_heartbeat(str(machine_id), key))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
    await asyncio.sleep(heartbeat_auth.UNKNOWN_FOR_SECONDS)
    # Its next try, well within a heartbeat interval (30 s here), is accepted.
    await endpoint.stub.Heartbeat(signed_heartbeat(str(machine_id), key))
    assert await heartbeat_at(bmdb, machine_id) is not None


async def test_one_address_sending_too_fast_is_slowed_and_the_log_says_so_once(bmdb, agent, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shepherd.heartbeat")
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, peer_rate=0.001, peer_burst=3)
    server, port = build_server(service, "127.0.0.1:0", None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            codes = []
            for _ in range(8):
                try:
                    await stub.Heartbeat(signed_heartbeat(str(uuid.uuid4()), agent.key))
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
    finally:
        await server.stop(None)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5
    assert (service.results["unauthenticated"], service.results["rate_limited"]) == (3, 5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("heartbeat rejected")]
    assert len(lines) == 2, "one line a kind of rejection, however many there are"


async def test_more_requests_at_once_than_the_server_takes_are_told_to_come_back(bmdb, agent):
    class Slow(HeartbeatService):
        async def check_and_record(self, request_bytes: bytes) -> agent_api_pb2.HeartbeatResponse:
            await asyncio.sleep(0.5)
            return await super().check_and_record(request_bytes)

    service = Slow(bmdb, interval=30.0, max_skew=60.0)
    server, port = build_server(service, "127.0.0.1:0", None, maximum_concurrent_rpcs=2)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            results = await asyncio.gather(
                *(stub.Heartbeat(signed_heartbeat(str(uuid.uuid4()), agent.key)) for _ in range(6)),
                return_exceptions=True,
            )
    finally:
        await server.stop(None)
    codes = sorted(r.code().name for r in results if isinstance(r, grpc.aio.AioRpcError))
    assert codes.count("RESOURCE_EXHAUSTED") == 4 and codes.count("UNAUTHENTICATED") == 2


async def test_every_refusal_costs_one_check_and_one_read_or_the_time_of_one(bmdb, agent, monkeypatch):
    """What a prober could time: an unknown id and a wrong key must cost the same, cached or not."""
    costs = counted_costs(bmdb, monkeypatch, read_delay=0.05)
    reads, verified = costs.reads, costs.verified
    waits: list[float] = []

    async def recorded_sleep(seconds: float) -> None:
        waits.append(seconds)

    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, sleep=recorded_sleep)
    public = agent.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    async def refused(machine_id: uuid.UUID, key: Ed25519PrivateKey) -> tuple[int, list[bytes], list[float]]:
        for seen in (reads, verified, waits):
            seen.clear()
        with pytest.raises(heartbeat_service.HeartbeatRejected) as caught:
            await service.check_and_record(signed_heartbeat(str(machine_id), key).SerializeToString())
        assert caught.value.result == "unauthenticated"
        return len(reads), list(verified), list(waits)

    await service.check_and_record(signed_heartbeat(str(agent.machine_id), agent.key).SerializeToString())
    assert await refused(agent.machine_id, Ed25519PrivateKey.generate()) == (1, [public], []), (
        "a wrong key on a real id: its cached key checked, BMDB read, and no second check of the same key"
    )
    stranger = uuid.uuid4()
    assert await refused(stranger, agent.key) == (1, [heartbeat_auth.DUMMY_KEY], [])
    reads_, verified_, waits_ = await refused(stranger, agent.key)
    assert (reads_, verified_) == (0, [heartbeat_auth.DUMMY_KEY]), "not read again, still checked"
    assert waits_ == [service.key_read_time.seconds] and service.key_read_time.seconds >= 0.05, (
        "answered after as long as a BMDB read takes"
    )


async def test_a_stand_in_asks_less_when_its_waits_last_longer_than_asked():
    asked: list[float] = []

    async def late_sleep(seconds: float) -> None:
        asked.append(seconds)
        await asyncio.sleep(seconds + 0.002)

    stand_in = heartbeat_auth.StandIn(late_sleep)
    stand_in.add(0.004)
    for _ in range(40):
        await stand_in.wait()
    assert asked[0] == 0.004
    # Every wait lasted at least 2 ms longer than asked, so the average overshoot is at least 72% of that.
    assert asked[-1] < 0.004 - 0.002 * 0.72
