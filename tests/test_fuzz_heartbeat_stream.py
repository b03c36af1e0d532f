"""Property-based fuzzing of the Heartbeats stream with well-formed requests, over real gRPC (TLS) and a real BMDB.

Not random bytes alone (tests/test_fuzz.py has those) but HeartbeatRequests whose every field is fuzzed: machine ids
of running agents, of a machine without one, of none, and text that is no id at all; times far in the past and
future, negative and at the edge of the accepted skew; nonces and signatures of every length; a right signature over
whatever fields were drawn, and signatures by the wrong key. One stream carries a mix of them. Each message must get
exactly one answer, the one an independent reading of the protocol expects: accepted only when signed by the
machine's agent, fresh, and later than the last accepted; the stream ends cleanly; and the machine's heartbeat time
in BMDB moves with every accepted message and with no other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmdb.store import BMDB
from foundation.tls import local_certificates
from processes.heartbeat_server import SERVICE, build_server
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2
from proto.signing import NONCE_SIZE, SIGNATURE_SIZE, signing_payload

Outcome = agent_api_pb2.HeartbeatResponse.Outcome
Request = agent_api_pb2.HeartbeatRequest

MAX_SKEW_MS = 60_000
# Longer than any exchange may take: one that does not finish within it hangs.
HANG = 10.0
# The stream's clock moves this far between examples, past every time the last example could have had accepted.
STEP_MS = 10 * MAX_SKEW_MS
AGENTS = 2


@dataclass
class Machine:
    machine_id: uuid.UUID
    key: Ed25519PrivateKey | None  # None: admitted, but no agent ever started


class StreamDriver:
    """A heartbeat server over TLS on a real BMDB and a channel to it, on one event loop that synchronous
    hypothesis examples drive; the server's clock is set by the test, so freshness does not depend on timing."""

    def __init__(self, url: str, tls: Path) -> None:
        self.loop = asyncio.new_event_loop()
        # Whole seconds, so the service's clock in seconds gives back these milliseconds exactly.
        self.now_ms = int(datetime.now(UTC).timestamp()) * 1000
        self.bmdb = BMDB(url, pool_size=2)
        self.service = HeartbeatService(self.bmdb, interval=30.0, max_skew=MAX_SKEW_MS / 1000, clock=self.clock)
        self.machines: list[Machine] = []
        # Machine -> the send time of its last accepted heartbeat.
        self.last_accepted: dict[uuid.UUID, int] = {}
        self.run(self._start(tls))

    def clock(self) -> float:
        return self.now_ms / 1000

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, HANG))

    async def _start(self, tls: Path) -> None:
        for n in range(AGENTS + 1):
            machine_id, _ = await self.bmdb.admit_machine("sim", f"fuzz-{n}")
            key = Ed25519PrivateKey.generate() if n < AGENTS else None
            if key is not None:
                await self.bmdb.record_agent_started(machine_id, datetime.now(UTC), _raw(key.public_key()))
            self.machines.append(Machine(machine_id, key))
        certificates = local_certificates(tls)
        self.server, port = build_server(
            self.service, "127.0.0.1:0", (certificates.server_certificate, certificates.server_key)
        )
        await self.server.start()
        credentials = grpc.ssl_channel_credentials(root_certificates=certificates.ca_certificate.read_bytes())
        self.channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)
        # Bytes in and out, so a message need not be one the stub would serialize.
        self.heartbeats = self.channel.stream_stream(f"/{SERVICE}/Heartbeats")

    async def heartbeat_times(self) -> dict[uuid.UUID, datetime | None]:
        times = {}
        for machine in self.machines:
            record = await self.bmdb.get_machine(machine.machine_id)
            assert record is not None
            times[machine.machine_id] = record.agent_heartbeat_at
        return times

    def close(self) -> None:
        async def stop() -> None:
            await self.channel.close()
            await self.server.stop(None)
            await self.service.close()
            await self.bmdb.close()

        self.run(stop())
        self.loop.close()


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


@pytest.fixture(scope="module")
def driver(bmdb_url_module: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamDriver]:
    stream_driver = StreamDriver(bmdb_url_module, tmp_path_factory.mktemp("tls"))
    yield stream_driver
    stream_driver.close()


# How a message names its machine: an agent's id (as the agent writes it, or another spelling of the same UUID),
# a machine with no agent, a UUID BMDB has never seen, or text that is no UUID.
SPELLINGS: dict[str, Callable[[uuid.UUID], str]] = {
    "plain": str,
    "upper": lambda machine_id: str(machine_id).upper(),
    "hex": lambda machine_id: machine_id.hex,
    "braces": lambda machine_id: "{" + str(machine_id) + "}",
    "urn": lambda machine_id: machine_id.urn,
}


@dataclass(frozen=True)
class Draft:
    """A message as drawn, before the stream's clock is known: who it names, when it was sent relative to the
    server's clock (or at an absolute time), and how it is signed."""

    who: int | str  # an index into the driver's machines, "stranger", or the text to send as the id
    spelling: str
    offset_ms: int | None  # relative to the server's clock; None: absolute_ms
    absolute_ms: int
    nonce: bytes
    signature: str | bytes  # "right", "other key", "other agent", "other fields", or the bytes themselves
    raw: bytes | None = None  # a message of random bytes instead


KEYLESS = Ed25519PrivateKey.generate()

drafts = st.one_of(
    st.builds(
        Draft,
        who=st.one_of(st.integers(0, AGENTS), st.just("stranger"), st.text(max_size=40)),
        spelling=st.sampled_from(sorted(SPELLINGS)),
        offset_ms=st.one_of(
            st.integers(-MAX_SKEW_MS, MAX_SKEW_MS),
            st.sampled_from([-MAX_SKEW_MS - 1, MAX_SKEW_MS + 1, 0]),
            st.integers(-(10**12), 10**12),
            st.none(),
        ),
        absolute_ms=st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63)])),
        nonce=st.one_of(st.binary(min_size=NONCE_SIZE, max_size=NONCE_SIZE), st.binary(max_size=40)),
        signature=st.one_of(
            st.sampled_from(["right", "right", "other key", "other agent", "other fields"]),
            st.binary(min_size=SIGNATURE_SIZE, max_size=SIGNATURE_SIZE),
            st.binary(max_size=100),
        ),
    ),
    st.builds(
        Draft,
        who=st.just("stranger"),
        spelling=st.just("plain"),
        offset_ms=st.none(),
        absolute_ms=st.just(0),
        nonce=st.just(b""),
        signature=st.just(b""),
        raw=st.binary(max_size=300),
    ),
)


def message(driver: StreamDriver, draft: Draft) -> bytes:
    """The serialized request the draft describes, at the driver's clock."""
    if draft.raw is not None:
        return draft.raw
    if isinstance(draft.who, int):
        machine_id = SPELLINGS[draft.spelling](driver.machines[draft.who].machine_id)
        owner = driver.machines[draft.who].key
    elif draft.who == "stranger":
        machine_id, owner = str(uuid.uuid4()), None
    else:
        machine_id, owner = draft.who, None
    sent_at = driver.now_ms + draft.offset_ms if draft.offset_ms is not None else draft.absolute_ms
    signature = draft.signature
    if isinstance(signature, str):
        other_agent = driver.machines[(draft.who + 1) % AGENTS if isinstance(draft.who, int) else 0].key
        signer = {"right": owner, "other fields": owner, "other key": KEYLESS, "other agent": other_agent}[signature]
        signed_at = sent_at + 1 if signature == "other fields" else sent_at
        # The signed time is 8 bytes as the agent writes it; outside them, no agent could sign it.
        if signer is None or not -(2**63) <= signed_at < 2**63:
            signer, signed_at = KEYLESS, 0
        signature = signer.sign(signing_payload(machine_id, signed_at, draft.nonce))
    return Request(
        machine_id=machine_id, sent_at_unix_ms=sent_at, nonce=draft.nonce, signature=signature
    ).SerializeToString()


def expected(driver: StreamDriver, data: bytes) -> tuple[Outcome, uuid.UUID | None]:
    """The outcome the protocol gives these bytes (agent_api.proto, proto/signing.py), worked out here on its own,
    and the machine whose heartbeat an acceptance records."""
    request = Request()
    try:
        request.ParseFromString(data)
        machine_id = uuid.UUID(request.machine_id)
    except (DecodeError, ValueError):
        return Outcome.MALFORMED, None
    if len(request.nonce) != NONCE_SIZE or len(request.signature) != SIGNATURE_SIZE or request.sent_at_unix_ms <= 0:
        return Outcome.MALFORMED, None
    if abs(driver.now_ms - request.sent_at_unix_ms) > MAX_SKEW_MS:
        return Outcome.STALE, None
    machine = next((m for m in driver.machines if m.machine_id == machine_id), None)
    if machine is None or machine.key is None:
        return Outcome.NOT_ACCEPTED, None
    try:
        machine.key.public_key().verify(
            request.signature, signing_payload(request.machine_id, request.sent_at_unix_ms, request.nonce)
        )
    except InvalidSignature:
        return Outcome.NOT_ACCEPTED, None
    if request.sent_at_unix_ms <= driver.last_accepted.get(machine_id, 0):
        return Outcome.REPLAYED, None
    return Outcome.ACCEPTED, machine_id


async def exchange_all(driver: StreamDriver, messages: list[bytes]) -> None:
    """Send the messages on one stream, each after the last one's answer, checking each answer and the heartbeat
    times in BMDB as it goes; then close the stream and check that it ended cleanly."""
    call = driver.heartbeats()
    before = await driver.heartbeat_times()
    for data in messages:
        outcome, accepted = expected(driver, data)
        await call.write(data)
        answer = agent_api_pb2.HeartbeatResponse.FromString(await call.read())
        assert answer.outcome == outcome, (answer, data)
        assert answer.message or outcome == Outcome.ACCEPTED
        assert (answer.server_time_unix_ms == driver.now_ms) == (outcome == Outcome.STALE)
        after = await driver.heartbeat_times()
        for machine_id, then in before.items():
            if machine_id == accepted:
                moved = after[machine_id]
                assert moved is not None and (then is None or moved > then)
            else:
                assert after[machine_id] == then, "a refused heartbeat moved a machine's heartbeat time"
        if accepted is not None:
            driver.last_accepted[accepted] = Request.FromString(data).sent_at_unix_ms
        before = after
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(stream=st.lists(drafts, min_size=1, max_size=6))
def test_every_heartbeat_on_a_stream_gets_the_one_answer_its_fields_and_signature_call_for(driver, stream):
    driver.now_ms += STEP_MS
    driver.run(exchange_all(driver, [message(driver, draft) for draft in stream]))


def test_a_stream_of_right_wrong_and_replayed_heartbeats_accepts_only_the_right_ones(driver):
    """The property's own example, so it runs whatever hypothesis draws: every kind of answer on one stream."""
    driver.now_ms += STEP_MS
    right = Draft(0, "plain", -5, 0, b"n" * NONCE_SIZE, "right")
    stream = [
        right,
        Draft(0, "upper", -3, 0, b"n" * NONCE_SIZE, "right"),
        right,  # the same time again: replayed
        Draft(0, "plain", -1, 0, b"n" * NONCE_SIZE, "other agent"),
        Draft(1, "plain", MAX_SKEW_MS + 1, 0, b"n" * NONCE_SIZE, "right"),
        Draft(2, "plain", 0, 0, b"n" * NONCE_SIZE, "right"),
        Draft(1, "plain", 0, 0, b"n" * 15, "right"),
        Draft(1, "braces", 0, 0, b"n" * NONCE_SIZE, "right"),
    ]
    messages = [message(driver, draft) for draft in stream]
    outcomes = [expected(driver, data)[0] for data in messages]
    assert outcomes[:2] == [Outcome.ACCEPTED, Outcome.ACCEPTED] and outcomes[-1] == Outcome.ACCEPTED
    assert outcomes[4:7] == [Outcome.STALE, Outcome.NOT_ACCEPTED, Outcome.MALFORMED]
    driver.run(exchange_all(driver, messages))
