"""Floods at the heartbeat port from senders with no agent key: the BMDB reads they may cause are bounded by their
address (an IPv6 sender by its /64) and overall, and the machines they name fill no log."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.heartbeat import signed_heartbeat
from bmdb.store import BMDB
from processes import heartbeat_service
from processes.heartbeat_admission import AddressRates, address_of
from processes.heartbeat_server import build_server
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2_grpc
from tests.test_heartbeat_server import Agent, agent, counted_costs  # noqa: F401


async def served(service: HeartbeatService) -> AsyncIterator[agent_api_pb2_grpc.AgentCallbackStub]:
    server, port = build_server(service, "127.0.0.1:0", None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield agent_api_pb2_grpc.AgentCallbackStub(channel)
    finally:
        await server.stop(None)
        await service.close()


async def refusals(stub: agent_api_pb2_grpc.AgentCallbackStub, requests: list) -> list[grpc.StatusCode]:
    codes = []
    for request in requests:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Heartbeat(request)
        codes.append(refused.value.code())
    return codes


@pytest.mark.parametrize(("per_address", "overall"), [(2.0, 0.0), (0.0, 2.0)])
async def test_fresh_ids_and_bad_signatures_cause_only_the_reads_their_budget_allows(
    bmdb: BMDB,
    agent: Agent,  # noqa: F811
    monkeypatch,
    per_address: float,
    overall: float,
):
    costs = counted_costs(bmdb, monkeypatch)
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, key_reads_per_address=per_address, key_reads=overall)
    async for stub in served(service):
        # The agent's own heartbeat reads its key once, and is cached from then on.
        await stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))
        started = time.monotonic()
        fresh = [signed_heartbeat(str(uuid.uuid4()), agent.key) for _ in range(30)]
        forged = [signed_heartbeat(str(agent.machine_id), Ed25519PrivateKey.generate()) for _ in range(30)]
        codes = await refusals(stub, fresh + forged)
        took = time.monotonic() - started
        # Each refused alike, whether BMDB was read or the budget was spent.
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        # A burst of twice the rate, and the rate for as long as it took, and the agent's first read.
        assert len(costs.reads) <= 1 + 2 * 2.0 + 2.0 * took + 1, (len(costs.reads), took)
        assert service.agent_keys.reads_refused >= 60 - len(costs.reads)
        # The agent itself is not held up: its key is cached, so it needs no read.
        await stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key))


def test_an_ipv6_host_counts_as_its_64_in_the_limits():
    first, second = "ipv6:[2001:db8:1:2::7]:51234", "ipv6:[2001:db8:1:2:ffff:ee::1]:40000"
    assert address_of(first) == address_of(second) == "2001:db8:1:2::/64"
    assert address_of("ipv6:[2001:db8:1:3::7]:1") == "2001:db8:1:3::/64"
    assert address_of(first, 128) == "2001:db8:1:2::7/128" != address_of(second, 128)
    assert address_of("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert address_of("ipv6:[::ffff:10.0.0.7]:51234") == "10.0.0.7", "an IPv4 peer on a dual-stack socket"
    assert address_of("unix:/run/shepherd.sock") == "/run/shepherd.sock"
    # One host taking a fresh address of its /64 for every request still draws on one bucket.
    rates = AddressRates(rate=1.0, burst=2.0)
    allowed = [rates.allow(address_of(f"ipv6:[2001:db8:1:2::{n:x}]:1")) for n in range(1, 11)]
    assert allowed == [True, True] + [False] * 8


async def test_stale_requests_under_many_ids_name_a_few_machines_and_count_the_rest(bmdb: BMDB, caplog):
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    hour_ago = int((time.time() - 3600) * 1000)
    key = Ed25519PrivateKey.generate()
    caplog.set_level(logging.WARNING, logger=heartbeat_service.log.name)

    async def stale(count: int) -> None:
        for _ in range(count):
            with pytest.raises(heartbeat_service.HeartbeatRejected) as refused:
                request = signed_heartbeat(str(uuid.uuid4()), key, now_ms=hour_ago)
                await service.check_and_record(request.SerializeToString())
            assert refused.value.result == "stale"

    try:
        await stale(100)
        named = [r for r in caplog.records if "the clock of machine" in r.getMessage()]
        assert len(named) == heartbeat_service.SKEW_LINES
        # The next window names the count of those left unnamed, then names machines again.
        service._skew_window -= heartbeat_service.SKEW_LINES_EVERY
        caplog.clear()
        await stale(1)
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0].startswith(f"{100 - heartbeat_service.SKEW_LINES} more machines' clocks were off")
        assert "the clock of machine" in lines[1] and len(lines) == 2
    finally:
        await service.close()
