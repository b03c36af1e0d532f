"""Heartbeats written together: each still gets its own answer, as if it had been written alone."""

from __future__ import annotations

import asyncio
import socket
import uuid
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from sqlalchemy.exc import OperationalError

from agent.heartbeat import signed_heartbeat
from bmdb.heartbeat_batcher import HeartbeatBatcher
from bmdb.store import BMDB, Heartbeat, HeartbeatsNotRecorded
from foundation.settings import Settings
from processes import heartbeat_auth
from processes.heartbeat_server import run_heartbeat_server
from processes.heartbeat_service import HeartbeatRejected, HeartbeatService
from proto import agent_api_pb2_grpc


async def started_agent(bmdb: BMDB, name: str) -> tuple[uuid.UUID, Ed25519PrivateKey, bytes]:
    machine_id, _ = await bmdb.admit_machine("sim", name)
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
    return machine_id, key, public


async def test_one_statement_answers_each_heartbeat_in_it_on_its_own(bmdb):
    now = datetime.now(UTC)
    fresh, _, fresh_key = await started_agent(bmdb, "node-0001")
    replayed, _, replayed_key = await started_agent(bmdb, "node-0002")
    impostor, _, _ = await started_agent(bmdb, "node-0003")
    forgotten, _, forgotten_key = await started_agent(bmdb, "node-0004")
    await bmdb.forget_agent(forgotten, "recovery")
    assert await bmdb.record_heartbeat(replayed, replayed_key, now)
    batcher = HeartbeatBatcher(bmdb)
    outcomes = await asyncio.gather(
        batcher.record(Heartbeat(fresh, fresh_key, now)),
        batcher.record(Heartbeat(replayed, replayed_key, now - timedelta(seconds=1))),
        batcher.record(Heartbeat(impostor, b"x" * 32, now)),
        batcher.record(Heartbeat(forgotten, forgotten_key, now)),
        batcher.record(Heartbeat(uuid.uuid4(), fresh_key, now)),
    )
    assert outcomes == [True, False, False, False, False]
    assert (batcher.statements, batcher.heartbeats) == (1, 5), "all in one statement"
    record = await bmdb.get_machine(replayed)
    assert record is not None and record.agent_heartbeat_at is not None


async def test_two_heartbeats_of_one_machine_are_checked_against_each_other_in_order(bmdb):
    machine_id, _, key = await started_agent(bmdb, "node-0001")
    now = datetime.now(UTC)
    batcher = HeartbeatBatcher(bmdb)
    older_first = await asyncio.gather(
        batcher.record(Heartbeat(machine_id, key, now)),
        batcher.record(Heartbeat(machine_id, key, now + timedelta(seconds=1))),
    )
    assert older_first == [True, True]
    newer_first = await asyncio.gather(
        batcher.record(Heartbeat(machine_id, key, now + timedelta(seconds=3))),
        batcher.record(Heartbeat(machine_id, key, now + timedelta(seconds=2))),
    )
    assert newer_first == [True, False], "the later-sent one came first: the other is a replay"
    assert batcher.statements == 4, "a machine is in a statement once"


async def test_a_bmdb_failure_answers_every_heartbeat_of_the_statement_and_the_next_one_reconnects(bmdb):
    machine_id, _, key = await started_agent(bmdb, "node-0001")
    other, _, other_key = await started_agent(bmdb, "node-0002")
    now = datetime.now(UTC)
    batcher = HeartbeatBatcher(bmdb)
    assert await batcher.record(Heartbeat(machine_id, key, now))
    async with bmdb.engine.connect() as conn:
        await conn.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE query LIKE '%%INSERT INTO machine_agent_heartbeat%%' AND pid <> pg_backend_pid()"
        )
    outcomes = await asyncio.gather(
        batcher.record(Heartbeat(machine_id, key, now + timedelta(seconds=1))),
        batcher.record(Heartbeat(other, other_key, now)),
        return_exceptions=True,
    )
    assert all(isinstance(outcome, HeartbeatsNotRecorded) for outcome in outcomes), outcomes
    assert "BMDB failed while recording heartbeats" in str(outcomes[0])
    # Nothing was lost for good: the agents send again, and the next statement opens a new connection.
    assert await batcher.record(Heartbeat(machine_id, key, now + timedelta(seconds=1)))
    assert await batcher.record(Heartbeat(other, other_key, now))


async def test_requests_checked_together_each_get_their_own_refusal(bmdb):
    machine_id, key, _ = await started_agent(bmdb, "node-0001")
    replayed, replayed_key, _ = await started_agent(bmdb, "node-0002")
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    await service.check_and_record(signed_heartbeat(str(replayed), replayed_key, now_ms=now_ms).SerializeToString())

    async def answer(request_bytes: bytes) -> str:
        try:
            await service.check_and_record(request_bytes)
        except HeartbeatRejected as rejection:
            return rejection.result
        return "accepted"

    requests = [
        signed_heartbeat(str(machine_id), key, now_ms=now_ms),
        signed_heartbeat(str(replayed), replayed_key, now_ms=now_ms - 1),
        signed_heartbeat(str(machine_id), Ed25519PrivateKey.generate(), now_ms=now_ms + 1),
        signed_heartbeat(str(replayed), replayed_key, now_ms=now_ms - 3_600_000),
    ]
    answers = await asyncio.gather(*(answer(request.SerializeToString()) for request in requests))
    assert answers == ["accepted", "replayed", "unauthenticated", "stale"]
    await service.close()


async def test_a_server_loads_the_agents_keys_at_start_and_reads_none_for_them(bmdb, monkeypatch):
    agents = [await started_agent(bmdb, f"node-{n:04d}") for n in range(3)]
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    assert await service.load_keys() == 3

    async def no_read(machine_id: uuid.UUID) -> bytes | None:
        raise AssertionError(f"the key of {machine_id} was read from BMDB")

    monkeypatch.setattr(bmdb, "agent_public_key", no_read)
    for machine_id, key, _ in agents:
        await service.check_and_record(signed_heartbeat(str(machine_id), key).SerializeToString())
    await service.close()


async def test_signature_checks_done_together_keep_each_verdict_with_its_request(bmdb):
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    checks = heartbeat_auth.SignatureChecks()
    requests = [signed_heartbeat(str(uuid.uuid4()), key if n % 3 else other) for n in range(30)]
    verdicts = await asyncio.gather(*(checks.signed_by(public, request) for request in requests))
    assert verdicts == [n % 3 != 0 for n in range(30)]
    checks.close()


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@h/db", "postgres://u@h/db", "postgresql://u@h/db?x=1"])
def test_the_heartbeat_connection_takes_every_form_of_the_bmdb_url(url):
    from bmdb.connection_errors import libpq_url

    assert libpq_url(url).startswith("postgresql://u@h/db")


async def test_a_server_that_cannot_load_the_keys_at_start_serves_and_reads_each_at_its_first_heartbeat(
    bmdb, bmdb_url, monkeypatch, caplog
):
    machine_id, key, _ = await started_agent(bmdb, "node-0001")

    async def unavailable(self: BMDB, limit: int) -> dict[uuid.UUID, bytes]:
        raise OperationalError("SELECT agent keys", {}, Exception("the server closed the connection"))

    monkeypatch.setattr(BMDB, "agent_public_keys", unavailable)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings(heartbeat_plaintext=True, heartbeat_listen=f"127.0.0.1:{port}", metrics_listen="")
    stop = asyncio.Event()
    serving = asyncio.create_task(run_heartbeat_server(settings, bmdb_url, stop=stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            response = await stub.Heartbeat(signed_heartbeat(str(machine_id), key), wait_for_ready=True, timeout=30)
        assert response.next_heartbeat_in_ms == settings.heartbeat_interval * 1000
    finally:
        stop.set()
        await serving
    assert "could not load the agents' keys" in caplog.text
