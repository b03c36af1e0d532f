"""The Heartbeats stream over real gRPC (TLS) with a real BMDB: one answer a heartbeat, each its own outcome."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent.heartbeat import signed_heartbeat
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.tls import local_certificates
from processes.heartbeat_server import SERVICE, build_server, run_heartbeat_server
from processes.heartbeat_service import NOT_ACCEPTED, STOPPING, TOO_MANY_STREAMS, HeartbeatService
from proto import STREAM_REFUSED_METADATA, agent_api_pb2, agent_api_pb2_grpc

Outcome = agent_api_pb2.HeartbeatResponse.Outcome
Request = agent_api_pb2.HeartbeatRequest
Response = agent_api_pb2.HeartbeatResponse


@dataclass
class Agent:
    machine_id: uuid.UUID
    key: Ed25519PrivateKey

    def heartbeat(self, now_ms: int) -> Request:
        return signed_heartbeat(str(self.machine_id), self.key, now_ms=now_ms)


@dataclass
class Served:
    channel: grpc.aio.Channel
    stub: agent_api_pb2_grpc.AgentCallbackStub
    service: HeartbeatService
    server: grpc.aio.Server
    port: int
    credentials: grpc.ChannelCredentials


async def started_agents(bmdb: BMDB, count: int) -> list[Agent]:
    agents = []
    for n in range(count):
        machine_id, _ = await bmdb.admit_machine("sim", f"node-{n:04d}")
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
        agents.append(Agent(machine_id, key))
    return agents


@pytest.fixture
def serve(bmdb: BMDB, tmp_path: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Served]]:
    """A heartbeat server over TLS with the given service settings, and a channel to it."""
    certificates = local_certificates(tmp_path / "tls")

    @contextlib.asynccontextmanager
    async def served(service: HeartbeatService | None = None) -> AsyncIterator[Served]:
        service = service or HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
        server, port = build_server(service, "127.0.0.1:0", (certificates.server_certificate, certificates.server_key))
        await server.start()
        credentials = grpc.ssl_channel_credentials(root_certificates=certificates.ca_certificate.read_bytes())
        channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)
        try:
            yield Served(channel, agent_api_pb2_grpc.AgentCallbackStub(channel), service, server, port, credentials)
        finally:
            await channel.close()
            await server.stop(None)

    return served


@pytest.fixture
async def endpoint(serve) -> AsyncIterator[Served]:
    async with serve() as served:
        yield served


async def exchange(stream: grpc.aio.StreamStreamCall, request: Request) -> Response:
    """Send one heartbeat on the stream and read its answer, as an agent does."""
    await stream.write(request)
    response = await stream.read()
    assert isinstance(response, Response)
    return response


def now_ms() -> int:
    return int(datetime.now(UTC).timestamp() * 1000)


async def heartbeat_at(bmdb: BMDB, machine_id: uuid.UUID) -> datetime | None:
    record = await bmdb.get_machine(machine_id)
    assert record is not None
    return record.agent_heartbeat_at


# Each refusal, made for the agent at `now`, with the checks on its answer.
REFUSALS: dict[str, Callable[[Agent, int, Request], Request]] = {
    "replayed": lambda agent, now, before: before,
    "wrong key": lambda agent, now, before: signed_heartbeat(str(agent.machine_id), Ed25519PrivateKey.generate()),
    "unknown machine": lambda agent, now, before: signed_heartbeat(str(uuid.uuid4()), agent.key),
    "stale": lambda agent, now, before: agent.heartbeat(now - 600_000),
    "malformed": lambda agent, now, before: Request(
        machine_id=str(agent.machine_id), sent_at_unix_ms=now, nonce=b"short", signature=before.signature
    ),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
async def test_a_refusal_in_the_middle_of_streams_is_answered_alone_and_its_neighbours_are_accepted(
    endpoint, bmdb, refusal
):
    agents = await started_agents(bmdb, 6)
    start = now_ms()
    answers: dict[int, list[Response]] = {n: [] for n in range(len(agents))}

    async def agent_stream(n: int) -> None:
        agent = agents[n]
        stream = endpoint.stub.Heartbeats()
        before = None
        for step in range(8):
            request = agent.heartbeat(start + step)
            if n == 0 and step == 4:
                assert before is not None
                request = REFUSALS[refusal](agent, start + step, before)
            answers[n].append(await exchange(stream, request))
            before = request
        await stream.done_writing()
        assert await stream.read() is grpc.aio.EOF

    # Six agents at once, so their heartbeats share the batched statements.
    await asyncio.gather(*(agent_stream(n) for n in range(len(agents))))
    assert endpoint.service.batcher.heartbeats > endpoint.service.batcher.statements, "heartbeats were batched"
    for n, responses in answers.items():
        expected = [Outcome.ACCEPTED] * 8
        if n == 0:
            expected[4] = {
                "replayed": Outcome.REPLAYED,
                "wrong key": Outcome.NOT_ACCEPTED,
                "unknown machine": Outcome.NOT_ACCEPTED,
                "stale": Outcome.STALE,
                "malformed": Outcome.MALFORMED,
            }[refusal]
        assert [response.outcome for response in responses] == expected, f"agent {n}"
        accepted = [r for r in responses if r.outcome == Outcome.ACCEPTED]
        assert {(r.next_heartbeat_in_ms, r.message, r.server_time_unix_ms) for r in accepted} == {(30_000, "", 0)}
    refused = answers[0][4]
    if refusal in ("wrong key", "unknown machine"):
        # One answer for both, to the byte: nothing tells whether the machine exists.
        assert refused == Response(outcome=Outcome.NOT_ACCEPTED, message=NOT_ACCEPTED)
    elif refusal == "stale":
        assert abs(refused.server_time_unix_ms - now_ms()) < 5_000
        assert "server_time_unix_ms" in refused.message
    elif refusal == "malformed":
        assert "nonce must be 16 bytes" in refused.message
    elif refusal == "replayed":
        assert "already accepted" in refused.message
    assert endpoint.service.results["accepted"] == 47
    assert endpoint.service.calls == {"stream": 48}
    for agent in agents:
        assert await heartbeat_at(bmdb, agent.machine_id) is not None


async def test_a_machine_id_that_is_no_uuid_and_bytes_that_are_no_request_are_malformed_and_the_stream_goes_on(
    endpoint, bmdb
):
    (agent,) = await started_agents(bmdb, 1)
    raw = endpoint.channel.stream_stream(f"/{SERVICE}/Heartbeats", request_serializer=None, response_deserializer=None)
    stream = raw()
    start = now_ms()
    no_uuid = Request(machine_id="not-a-uuid", sent_at_unix_ms=start, nonce=b"n" * 16, signature=b"s" * 64)
    for payload, outcome, message in (
        (no_uuid.SerializeToString(), Outcome.MALFORMED, "machine_id must be the UUID from TakeoverInit"),
        (b"\xff\xff\xff\xff", Outcome.MALFORMED, "the request is not a HeartbeatRequest"),
        (agent.heartbeat(start).SerializeToString(), Outcome.ACCEPTED, ""),
    ):
        await stream.write(payload)
        answer = Response.FromString(await stream.read())
        assert (answer.outcome, answer.message) == (outcome, message)
    # A message over the size limit is no heartbeat: the stream ends as the unary call would.
    await stream.write(b"\x0a" + b"\x80" * 5000)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert endpoint.service.results == {"malformed": 2, "accepted": 1}


async def test_more_heartbeats_at_once_than_the_server_takes_are_told_to_retry_later(serve, bmdb):
    (agent,) = await started_agents(bmdb, 1)

    class Slow(HeartbeatService):
        async def verify_and_record(self, request_bytes: bytes) -> None:
            await asyncio.sleep(0.5)
            await super().verify_and_record(request_bytes)

    async with serve(Slow(bmdb, interval=30.0, max_skew=60.0, max_in_flight=2)) as served:
        streams = [served.stub.Heartbeats() for _ in range(6)]
        holding = [
            asyncio.create_task(exchange(stream, signed_heartbeat(str(uuid.uuid4()), agent.key)))
            for stream in streams[:2]
        ]
        for _ in range(200):
            if served.service.in_flight == 2:
                break
            await asyncio.sleep(0.01)
        assert served.service.in_flight == 2
        turned_away = await asyncio.gather(
            *(exchange(stream, signed_heartbeat(str(uuid.uuid4()), agent.key)) for stream in streams[2:])
        )
        # The unary call shares the same cap.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.Heartbeat(signed_heartbeat(str(uuid.uuid4()), agent.key))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [answer.outcome for answer in await asyncio.gather(*holding)] == [Outcome.NOT_ACCEPTED] * 2
        assert [answer.outcome for answer in turned_away] == [Outcome.RETRY_LATER] * 4
        assert all(2_500 <= answer.next_heartbeat_in_ms <= 5_000 for answer in turned_away), "a back-off"
        assert len({answer.next_heartbeat_in_ms for answer in turned_away}) > 1, "spread over the agents"
        # The streams told to retry are still open, and take the next heartbeat once there is room.
        assert (await exchange(streams[2], agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        assert served.service.results["busy"] == 5
        assert served.service.in_flight == 0


async def test_streams_beyond_the_cap_are_refused_until_one_closes(serve, bmdb):
    agents = await started_agents(bmdb, 3)
    async with serve(HeartbeatService(bmdb, interval=30.0, max_skew=60.0, max_streams=2)) as served:
        first, second = served.stub.Heartbeats(), served.stub.Heartbeats()
        for stream, agent in ((first, agents[0]), (second, agents[1])):
            assert (await exchange(stream, agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        third = served.stub.Heartbeats()
        await third.write(agents[2].heartbeat(now_ms()))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await third.read()
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "streams open" in (caught.value.details() or "")
        # Unary calls are not streams: they still get in.
        await served.stub.Heartbeat(agents[2].heartbeat(now_ms()))
        await first.done_writing()
        assert await first.read() is grpc.aio.EOF
        for _ in range(100):
            if served.service.streams < 2:
                break
            await asyncio.sleep(0.01)
        fourth = served.stub.Heartbeats()
        assert (await exchange(fourth, agents[2].heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        assert served.service.results["too_many_streams"] == 1


async def test_the_per_address_limit_counts_the_messages_of_a_stream(serve, bmdb):
    (agent,) = await started_agents(bmdb, 1)
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, peer_rate=0.001, peer_burst=3)
    async with serve(service) as served:
        stream = served.stub.Heartbeats()
        outcomes = [(await exchange(stream, agent.heartbeat(now_ms() + n))).outcome for n in range(5)]
    assert outcomes == [Outcome.ACCEPTED] * 3 + [Outcome.RETRY_LATER] * 2
    assert service.results == {"accepted": 3, "rate_limited": 2}


async def test_an_unknown_id_asked_again_on_a_stream_waits_as_long_as_a_bmdb_read(serve, bmdb):
    """The equal-time refusal holds a message: each is answered before the next is read."""
    (agent,) = await started_agents(bmdb, 1)
    waits: list[float] = []

    async def recorded_sleep(seconds: float) -> None:
        waits.append(seconds)

    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, sleep=recorded_sleep)
    stranger = str(uuid.uuid4())
    async with serve(service) as served:
        stream = served.stub.Heartbeats()
        answers = [await exchange(stream, signed_heartbeat(stranger, agent.key)) for _ in range(3)]
    assert {(answer.outcome, answer.message) for answer in answers} == {(Outcome.NOT_ACCEPTED, NOT_ACCEPTED)}
    assert len(waits) == 2 and waits[0] == service.key_read_time.seconds > 0, "read once, then waited for as long"


async def test_at_shutdown_the_streams_are_closed_as_unavailable_so_the_agents_connect_again(endpoint, bmdb):
    (agent,) = await started_agents(bmdb, 1)
    stream = endpoint.stub.Heartbeats()
    assert (await exchange(stream, agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
    endpoint.service.end_streams()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAVAILABLE, STOPPING)
    assert endpoint.service.streams == 0


class Relay:
    """A TCP relay on 127.0.0.1 whose connections reach the server from another loopback address: the server sees
    that address as the peer, as it would a second host's (gRPC cannot choose a client's source address)."""

    def __init__(self, source: str, server_port: int) -> None:
        self.source, self.server_port = source, server_port
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[int]:
        relay = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        try:
            yield relay.sockets[0].getsockname()[1]
        finally:
            self.drop()
            relay.close()
            for pipe in list(self._pipes):
                pipe.cancel()

    def drop(self) -> None:
        """Cut every connection without a goodbye, as a machine that loses power or its network does."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _connect(self, agent_reader: asyncio.StreamReader, agent_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(
            "127.0.0.1", self.server_port, local_addr=(self.source, 0)
        )
        self._writers += [agent_writer, server_writer]
        for reader, writer in ((agent_reader, server_writer), (server_reader, agent_writer)):
            pipe = asyncio.create_task(self._pipe(reader, writer))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def connected_from(
    served: Served, source: str
) -> AsyncIterator[tuple[agent_api_pb2_grpc.AgentCallbackStub, Relay]]:
    """A stub whose calls reach the server from the loopback address `source`, and the relay they go through."""
    relay = Relay(source, served.port)
    async with relay.listening() as port, grpc.aio.secure_channel(f"127.0.0.1:{port}", served.credentials) as channel:
        yield agent_api_pb2_grpc.AgentCallbackStub(channel), relay


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait, briefly, for the server to catch up with what the client saw."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not so within 2 s: {what}")


async def refusal_of(stream: grpc.aio.StreamStreamCall, request: Request) -> grpc.aio.AioRpcError:
    await stream.write(request)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    return caught.value


async def refused_at_open(stream: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """The refusal of a stream the server turns away as it opens, before any message. Nothing is written: a write
    racing the server's refusal fails in gRPC's core, which then reports INTERNAL instead of the server's status."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    return caught.value


async def test_streams_from_one_address_beyond_its_cap_are_refused_and_other_addresses_still_get_in(
    serve, bmdb, caplog
):
    agents = await started_agents(bmdb, 6)
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, max_streams_per_address=2)
    caplog.set_level(logging.WARNING, logger="shepherd.heartbeat")
    async with serve(service) as served, connected_from(served, "127.0.0.2") as (neighbour, _):
        first, second = served.stub.Heartbeats(), served.stub.Heartbeats()
        for stream, agent in ((first, agents[0]), (second, agents[1])):
            assert (await exchange(stream, agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        refusals = [await refused_at_open(served.stub.Heartbeats()) for _ in range(2)]
        for refusal in refusals:
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refusal.details() == (
                "this address has 2 heartbeat streams open, the most one address may"
                " (setting heartbeat_max_streams_per_address): send unary Heartbeat calls, and try a stream again later"
            )
            # What tells the agent to send unary calls meanwhile rather than back off.
            assert (STREAM_REFUSED_METADATA, "full") in tuple(refusal.trailing_metadata() or ())
        # Another address has a cap of its own, untouched by the first's.
        theirs = [neighbour.Heartbeats(), neighbour.Heartbeats()]
        for stream, agent in zip(theirs, agents[3:5], strict=True):
            assert (await exchange(stream, agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        assert served.service.streams_by_address == {"127.0.0.1": 2, "127.0.0.2": 2}
        # Unary calls are not streams: they still get in.
        await served.stub.Heartbeat(agents[2].heartbeat(now_ms()))
        # Once one of its streams closes, the address may open another.
        await first.done_writing()
        assert await first.read() is grpc.aio.EOF
        await until(lambda: served.service.streams_by_address["127.0.0.1"] == 1, "the closed stream uncounted")
        third = served.stub.Heartbeats()
        assert (await exchange(third, agents[5].heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        assert served.service.streams_by_address == {"127.0.0.1": 2, "127.0.0.2": 2}
    assert service.results["too_many_streams_from_address"] == 2
    assert "too_many_streams" not in service.results
    # Logged as the global cap's refusal is: once, then not again within REJECTION_LOG_EVERY.
    logged = [r.getMessage() for r in caplog.records if "heartbeat_max_streams_per_address" in r.getMessage()]
    assert logged == [
        "a heartbeat stream from 127.0.0.1 refused: it has 2 streams open (setting heartbeat_max_streams_per_address)"
    ]


async def test_a_cap_of_zero_leaves_an_address_only_the_global_cap(serve, bmdb):
    agents = await started_agents(bmdb, 4)
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0, max_streams=3, max_streams_per_address=0)
    async with serve(service) as served:
        streams = [served.stub.Heartbeats() for _ in range(3)]
        for stream, agent in zip(streams, agents[:3], strict=True):
            assert (await exchange(stream, agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        refusal = await refused_at_open(served.stub.Heartbeats())
        assert (refusal.code(), refusal.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_MANY_STREAMS)
        assert (STREAM_REFUSED_METADATA, "full") in tuple(refusal.trailing_metadata() or ())
    assert service.results["too_many_streams"] == 1


class Controlled(HeartbeatService):
    """A service whose next heartbeat can be made to fail (a fault of ours) or to wait (being recorded)."""

    fault = False
    holding: asyncio.Event | None = None

    async def verify_and_record(self, request_bytes: bytes) -> None:
        if self.fault:
            raise RuntimeError("a fault in the heartbeat server")
        if self.holding is not None:
            await self.holding.wait()
        await super().verify_and_record(request_bytes)


async def agent_closes(served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent) -> None:
    await stream.done_writing()
    assert await stream.read() is grpc.aio.EOF


async def agent_cancels(served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent) -> None:
    stream.cancel()


async def connection_drops(served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent) -> None:
    relay.drop()


async def message_too_large(served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent) -> None:
    refusal = await refusal_of(stream, Request(machine_id="x" * 5000))
    assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def fault_of_ours(served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent) -> None:
    assert isinstance(served.service, Controlled)
    served.service.fault = True
    refusal = await refusal_of(stream, agent.heartbeat(now_ms()))
    assert refusal.code() == grpc.StatusCode.UNKNOWN
    served.service.fault = False


async def server_ends_streams(served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent) -> None:
    served.service.end_streams()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def server_stops_mid_heartbeat(
    served: Served, stream: grpc.aio.StreamStreamCall, relay: Relay, agent: Agent
) -> None:
    """The server stopped with no grace while a heartbeat is being recorded: its handler is cancelled there."""
    assert isinstance(served.service, Controlled)
    served.service.holding = asyncio.Event()
    await stream.write(agent.heartbeat(now_ms()))
    await until(lambda: served.service.in_flight == 1, "the heartbeat being recorded")
    await served.server.stop(None)


ENDINGS = {
    "the agent closes it": agent_closes,
    "the agent cancels it": agent_cancels,
    "its connection drops": connection_drops,
    "a message too large": message_too_large,
    "a fault of ours": fault_of_ours,
    "the server ends the streams": server_ends_streams,
    "the server stops mid-heartbeat": server_stops_mid_heartbeat,
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_an_address_gets_its_streams_back_however_they_end(serve, bmdb, ending):
    agents = await started_agents(bmdb, 3)
    service = Controlled(bmdb, interval=30.0, max_skew=60.0, max_streams_per_address=1)
    async with serve(service) as served, connected_from(served, "127.0.0.2") as (stub, relay):
        stream = stub.Heartbeats()
        assert (await exchange(stream, agents[0].heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
        assert service.streams_by_address == {"127.0.0.2": 1}
        await ENDINGS[ending](served, stream, relay, agents[0])
        await until(lambda: service.streams == 0, "the stream ended on the server")
        assert service.streams_by_address == {}
        if ending.startswith("the server"):
            return
        # The address may open its one stream again; had the count leaked, it would be refused.
        async with connected_from(served, "127.0.0.2") as (again, _):
            stream = again.Heartbeats()
            assert (await exchange(stream, agents[1].heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
            assert service.streams_by_address == {"127.0.0.2": 1}
            await stream.done_writing()
    assert "too_many_streams_from_address" not in service.results


async def test_the_per_address_cap_comes_from_its_setting_and_its_refusals_are_counted(bmdb, bmdb_url, caplog):
    (agent,) = await started_agents(bmdb, 1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings.from_env(
        {
            "SHEPHERD_HEARTBEAT_MAX_STREAMS_PER_ADDRESS": "1",
            "SHEPHERD_HEARTBEAT_PLAINTEXT": "true",
            "SHEPHERD_HEARTBEAT_LISTEN": f"127.0.0.1:{port}",
        }
    ).check_heartbeat_server()
    caplog.set_level(logging.INFO, logger="shepherd.heartbeat")
    stop = asyncio.Event()
    serving = asyncio.create_task(run_heartbeat_server(settings, bmdb_url, stop=stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            held = stub.Heartbeats()
            assert (await exchange(held, agent.heartbeat(now_ms()))).outcome == Outcome.ACCEPTED
            refusal = await refused_at_open(stub.Heartbeats())
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "heartbeat_max_streams_per_address" in (refusal.details() or "")
            held.cancel()
    finally:
        stop.set()
        await serving
    assert "a heartbeat stream from 127.0.0.1 refused: it has 1 streams open" in caplog.text
    assert "'too_many_streams_from_address': 1" in caplog.text
