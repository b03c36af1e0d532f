"""The agent callback service: authenticated heartbeats into BMDB.

The answer to an unknown machine, a wrong key and a bad signature is the same, so nothing leaks about which
machines exist (processes.heartbeat_auth). Accepted heartbeats go to BMDB only: the fleet watchdog reads them
there, and no workflow is woken.

Two calls take the same heartbeats through the same checks and limits: Heartbeats, one long-lived stream on which
an agent sends each heartbeat and reads its answer, and the unary Heartbeat of older agents, which refuses with a
gRPC status instead. Before a heartbeat is checked, it must pass the limits: the rate of its address, the
heartbeats handled at once, and for a stream, the streams open from everywhere and from its address.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from sqlalchemy.exc import SQLAlchemyError
from temporalio.common import MetricMeter

from bmdb.heartbeat_batcher import HeartbeatBatcher
from bmdb.store import BMDB, Heartbeat, HeartbeatsNotRecorded
from foundation.logs import ThrottledLog
from foundation.precise_sleep import precise_sleep
from processes.heartbeat_admission import REQUEST_ADDRESS, AddressRates, KeyReads, address_of
from processes.heartbeat_auth import KEY_CACHE_SIZE, UNKNOWN_FOR_SECONDS, AgentKeys
from proto import SERVER_TIME_METADATA, STREAM_REFUSED_METADATA, agent_api_pb2
from proto.signing import NONCE_SIZE, SIGNATURE_SIZE

log = logging.getLogger("shepherd.heartbeat")

T = TypeVar("T")

NOT_ACCEPTED = "heartbeat not accepted: unknown machine, or not signed by its agent's key"

BUSY = "the heartbeat server is handling as many heartbeats as it takes at once; try again"

TOO_MANY_STREAMS = (
    "the heartbeat server has as many heartbeat streams open as it takes (setting heartbeat_max_streams): "
    "send unary Heartbeat calls, and try a stream again later"
)

STOPPING = "the heartbeat server is stopping; connect again"

# Tells the agent that its unary call is still welcome (proto.STREAM_REFUSED_METADATA).
STREAMS_FULL_TRAILER = ((STREAM_REFUSED_METADATA, "full"),)

TOO_MANY_STREAMS_LOG = "a heartbeat stream refused: %d streams are open (setting heartbeat_max_streams)"

TOO_MANY_STREAMS_FROM_ADDRESS = (
    "this address has {cap:,} heartbeat streams open, the most one address may"
    " (setting heartbeat_max_streams_per_address): send unary Heartbeat calls, and try a stream again later"
)

TOO_MANY_STREAMS_FROM_ADDRESS_LOG = (
    "a heartbeat stream from %s refused: it has %d streams open (setting heartbeat_max_streams_per_address)"
)

# Machines whose clock skew was logged, remembered so each is logged once.
SKEW_LOGGED_SIZE = 10_000
# Machines whose clock skew is logged by name, at most, each SKEW_LINES_EVERY seconds; the others are counted.
SKEW_LINES = 20
SKEW_LINES_EVERY = 60.0

# Heartbeats handled at once, over both calls; beyond it a heartbeat is answered RETRY_LATER on a stream and
# RESOURCE_EXHAUSTED on the unary call, and the agent backs off and retries.
MAX_IN_FLIGHT = 2_000

# Streams open at once: an agent keeps one open, so this is sized for a fleet (SHEPHERD_HEARTBEAT_MAX_STREAMS);
# beyond it a new stream is refused with RESOURCE_EXHAUSTED, and its agent sends unary calls for a while.
MAX_STREAMS = 200_000

# Streams open at once from one address (IP, whatever the port; SHEPHERD_HEARTBEAT_MAX_STREAMS_PER_ADDRESS), so one
# host cannot take the whole of MAX_STREAMS from the fleet: an agent is one a machine, and this leaves room for a
# site of machines behind one NAT address, each with a second stream for a while after a reboot. 0: no such cap.
MAX_STREAMS_PER_ADDRESS = 5_000

# The back-off a RETRY_LATER asks for, drawn between half of it and all of it so refused agents do not come
# back in step.
RETRY_LATER_MS = 5_000

# At most one line a kind of rejection this often, with how many were not logged.
REJECTION_LOG_EVERY = 10.0

Outcome = agent_api_pb2.HeartbeatResponse.Outcome

# The outcome a stream answers for each result a refusal is counted under.
OUTCOMES: dict[str, agent_api_pb2.HeartbeatResponse.Outcome] = {
    "malformed": Outcome.MALFORMED,
    "stale": Outcome.STALE,
    "unauthenticated": Outcome.NOT_ACCEPTED,
    "replayed": Outcome.REPLAYED,
    "unavailable": Outcome.RETRY_LATER,
    "rate_limited": Outcome.RETRY_LATER,
    "busy": Outcome.RETRY_LATER,
}


class HeartbeatRejected(Exception):
    """A heartbeat refused: the gRPC status to answer, the result to count it under, and why."""

    def __init__(self, code: grpc.StatusCode, result: str, message: str, server_time_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.result = result
        # The server's time, with a stale refusal: in the unary call's trailing metadata, in a stream's answer.
        self.server_time_ms = server_time_ms

    @property
    def trailing(self) -> tuple[tuple[str, str], ...]:
        """The unary call's trailing metadata: the server's time, when the refusal carries one."""
        return ((SERVER_TIME_METADATA, str(self.server_time_ms)),) if self.server_time_ms else ()


def _reject(code: grpc.StatusCode, result: str, message: str) -> NoReturn:
    raise HeartbeatRejected(code, result, message)


class HeartbeatService:
    """The agents' Heartbeat call: checks a request's form, clock and signature, then records it in BMDB."""

    def __init__(
        self,
        bmdb: BMDB,
        *,
        interval: float,
        max_skew: float,
        clock: Callable[[], float] = time.time,
        meter: MetricMeter = MetricMeter.noop,
        key_cache_size: int = KEY_CACHE_SIZE,
        peer_rate: float = 0.0,
        peer_burst: float = 0.0,
        sleep: Callable[[float], Awaitable[None]] = precise_sleep,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_streams: int = MAX_STREAMS,
        max_streams_per_address: int = MAX_STREAMS_PER_ADDRESS,
        ipv6_prefix: int = 64,
        key_reads_per_address: float = 0.0,
        key_reads: float = 0.0,
        unknown_for: float = UNKNOWN_FOR_SECONDS,
    ) -> None:
        self.bmdb = bmdb
        self.batcher = HeartbeatBatcher(bmdb)
        self.agent_keys = AgentKeys(
            bmdb,
            unknown_for=unknown_for,
            cache_size=key_cache_size,
            sleep=sleep,
            reads=KeyReads(key_reads_per_address, key_reads),
        )
        self.ipv6_prefix = ipv6_prefix
        # An id known to have no agent key is answered after as long as reading one from BMDB takes.
        self.key_read_time = self.agent_keys.key_read_time
        self._skew_logged: OrderedDict[uuid.UUID, None] = OrderedDict()
        # The machines named in the skew log since the window began, and those counted without a name.
        self._skew_window, self._skew_named, self._skew_unnamed = time.monotonic(), 0, 0
        self.address_rates = AddressRates(peer_rate, peer_burst)
        # A flood of junk or a BMDB outage must not flood the log too: every rejection is counted in
        # shepherd_heartbeat_requests_total, and logged a line a kind every REJECTION_LOG_EVERY seconds.
        self._log_now_and_then = ThrottledLog(log, REJECTION_LOG_EVERY)
        self.interval_ms = int(interval * 1000)
        self.max_skew_ms = int(max_skew * 1000)
        self.clock = clock
        self.max_in_flight, self.max_streams = max_in_flight, max_streams
        self.max_streams_per_address = max_streams_per_address
        self._too_many_streams_from_address = TOO_MANY_STREAMS_FROM_ADDRESS.format(cap=max_streams_per_address)
        # Heartbeats being checked or recorded now, over both calls, and the streams open now.
        self.in_flight = 0
        self.streams = 0
        # Address -> its streams open now; an address is dropped with its last stream, so this holds only
        # addresses with a stream open and needs no bound of its own.
        self.streams_by_address: dict[str, int] = {}
        # Peer (context.peer(), one a connection) -> its streams open now: the connection guard
        # (processes.heartbeat_connections) closes the connections without one first.
        self.stream_peers: dict[str, int] = {}
        # The stream handlers waiting for their next heartbeat, and whether the streams are being ended.
        self._reading: set[asyncio.Task[object]] = set()
        self._ending_streams = False
        # Every accepted answer on a stream is the same bytes.
        self._accepted = agent_api_pb2.HeartbeatResponse(next_heartbeat_in_ms=self.interval_ms)
        self._accepted_bytes = self._accepted.SerializeToString()
        # Requests by result: in the log at shutdown and in /metrics; by call ("unary", "stream") as well.
        self.results: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._requests = meter.create_counter(
            "shepherd_heartbeat_requests_total", "Heartbeat requests, by result and call (unary, stream)"
        )
        # (result, call) -> the counter with its attributes bound: a heartbeat adds to it without building them.
        self._request_counters: dict[tuple[str, str], Any] = {}

    async def load_keys(self) -> int:
        """Fill the key cache with the running agents' keys, so a server just started reads BMDB once, not once a
        machine; how many were loaded."""
        return await self.agent_keys.load()

    async def close(self) -> None:
        """Stop the heartbeat batcher, answering those still queued as not recorded, then the signature checks."""
        await self.batcher.close()
        self.agent_keys.close()

    def _count(self, result: str, call: str = "unary") -> None:
        self.results[result] += 1
        self.calls[call] += 1
        counter = self._request_counters.get((result, call))
        if counter is None:
            counter = self._requests.with_additional_attributes({"result": result, "call": call})
            self._request_counters[result, call] = counter
        counter.add(1)

    async def handle(self, request_bytes: bytes, context: grpc.aio.ServicerContext) -> agent_api_pb2.HeartbeatResponse:
        """The unary Heartbeat: an accepted heartbeat's answer, or the refusal's gRPC status."""
        peer = context.peer() or "unknown"
        try:
            response = await self._within_limits(
                address_of(peer, self.ipv6_prefix), lambda: self.check_and_record(request_bytes)
            )
        except HeartbeatRejected as rejection:
            self._count(rejection.result)
            self._log_rejection(rejection.result, peer)
            if rejection.trailing:
                context.set_trailing_metadata(rejection.trailing)
            await context.abort(rejection.code, str(rejection))
        self._count("accepted")
        return response

    async def stream(self, requests: object, context: grpc.aio.ServicerContext) -> None:
        """The Heartbeats stream: each heartbeat answered with its outcome before the next is read, so the
        checks, and the time a refusal takes, are those of a unary call a message."""
        peer = context.peer() or "unknown"
        host = address_of(peer, self.ipv6_prefix)
        if self.streams >= self.max_streams:
            self._count("too_many_streams", "stream")
            self._log_now_and_then(logging.WARNING, "too_many_streams", TOO_MANY_STREAMS_LOG, self.max_streams)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_MANY_STREAMS, STREAMS_FULL_TRAILER)
        from_address = self.streams_by_address.get(host, 0)
        if self.max_streams_per_address and from_address >= self.max_streams_per_address:
            self._count("too_many_streams_from_address", "stream")
            self._log_now_and_then(
                logging.WARNING, "too_many_streams_from_address", TOO_MANY_STREAMS_FROM_ADDRESS_LOG, host, from_address
            )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_many_streams_from_address, STREAMS_FULL_TRAILER
            )
        # Counted up here and down in the finally below, with no await between the checks and the counting: however
        # the stream ends (the agent closes or cancels it, its connection drops, the server stops, a fault of ours),
        # its address's count goes down with it.
        self.streams += 1
        self.streams_by_address[host] = from_address + 1
        self.stream_peers[peer] = self.stream_peers.get(peer, 0) + 1
        task = asyncio.current_task()
        assert task is not None
        try:
            while not self._ending_streams:
                # Only a stream waiting for its next heartbeat is ended at shutdown, never one with a heartbeat
                # being recorded: its agent hears every outcome.
                self._reading.add(task)
                try:
                    request_bytes = await context.read()
                except asyncio.CancelledError:
                    if not self._ending_streams:
                        raise
                    # end_streams' cancel is answered here; the call itself goes on to its end.
                    task.uncancel()
                    break
                finally:
                    self._reading.discard(task)
                if request_bytes is grpc.aio.EOF:
                    return
                await context.write(await self._answer(request_bytes, host, peer))
            # Set and returned rather than aborted: an aborted call is not always finished by the server's stop,
            # and the event loop's close then cancels it with a traceback on stderr, outside the log.
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(STOPPING)
        finally:
            self.streams -= 1
            left = self.streams_by_address[host] - 1
            if left:
                self.streams_by_address[host] = left
            else:
                del self.streams_by_address[host]
            on_peer = self.stream_peers[peer] - 1
            if on_peer:
                self.stream_peers[peer] = on_peer
            else:
                del self.stream_peers[peer]

    def end_streams(self) -> None:
        """Close every stream with UNAVAILABLE once its heartbeat in flight, if any, is answered: at shutdown, so
        the agents reconnect (to another server, or this one restarted) instead of holding the server's grace
        period open."""
        self._ending_streams = True
        for task in list(self._reading):
            task.cancel()

    async def _answer(self, request_bytes: bytes, host: str, peer: str) -> bytes:
        """A stream message's answer, serialized."""
        try:
            await self._within_limits(host, lambda: self.verify_and_record(request_bytes))
        except HeartbeatRejected as rejection:
            self._count(rejection.result, "stream")
            self._log_rejection(rejection.result, peer)
            return self._refusal(rejection).SerializeToString()
        self._count("accepted", "stream")
        return self._accepted_bytes

    async def _within_limits(self, host: str, record: Callable[[], Awaitable[T]]) -> T:
        """record(), once the address's rate and the cap on heartbeats handled at once let it in, on either call;
        HeartbeatRejected otherwise."""
        if not self.address_rates.allow(host):
            _reject(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited", "too many requests from this address")
        if self.in_flight >= self.max_in_flight:
            _reject(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", BUSY)
        self.in_flight += 1
        REQUEST_ADDRESS.set(host)
        try:
            return await record()
        finally:
            self.in_flight -= 1

    def _refusal(self, rejection: HeartbeatRejected) -> agent_api_pb2.HeartbeatResponse:
        outcome = OUTCOMES[rejection.result]
        retry_ms = int(RETRY_LATER_MS * random.uniform(0.5, 1.0)) if outcome == Outcome.RETRY_LATER else 0
        return agent_api_pb2.HeartbeatResponse(
            outcome=outcome,
            message=str(rejection),
            next_heartbeat_in_ms=retry_ms,
            server_time_unix_ms=rejection.server_time_ms,
        )

    async def check_and_record(self, request_bytes: bytes) -> agent_api_pb2.HeartbeatResponse:
        """The unary call's answer to an accepted heartbeat; raises HeartbeatRejected for a refused one."""
        await self.verify_and_record(request_bytes)
        return self._accepted

    async def verify_and_record(self, request_bytes: bytes) -> None:
        """Check a serialized HeartbeatRequest and record it in BMDB; raises HeartbeatRejected if refused."""
        request = agent_api_pb2.HeartbeatRequest()
        try:
            request.ParseFromString(request_bytes)
        except DecodeError:
            _reject(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "the request is not a HeartbeatRequest")
        try:
            machine_id = uuid.UUID(request.machine_id)
        except ValueError:
            _reject(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "machine_id must be the UUID from TakeoverInit")
        if len(request.nonce) != NONCE_SIZE:
            _reject(grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"nonce must be {NONCE_SIZE} bytes")
        if len(request.signature) != SIGNATURE_SIZE:
            _reject(grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"signature must be {SIGNATURE_SIZE} bytes")
        if request.sent_at_unix_ms <= 0:
            _reject(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "sent_at_unix_ms must be set")
        now_ms = int(self.clock() * 1000)
        skew = abs(now_ms - request.sent_at_unix_ms)
        if skew > self.max_skew_ms:
            self._note_skew(machine_id, now_ms - request.sent_at_unix_ms)
            raise HeartbeatRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "stale",
                f"sent_at_unix_ms is {skew / 1000:.0f}s from the server's clock"
                f" (at most {self.max_skew_ms / 1000:.0f}s); the server's time is in {SERVER_TIME_METADATA}"
                " (on a stream: in server_time_unix_ms)",
                now_ms,
            )
        sent_at = datetime.fromtimestamp(request.sent_at_unix_ms / 1000, UTC)
        try:
            key = await self.agent_keys.signing_key(machine_id, request)
            if key is None:
                _reject(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", NOT_ACCEPTED)
            recorded = await self.batcher.record(Heartbeat(machine_id, key, sent_at))
            if not recorded and await self.bmdb.agent_public_key(machine_id) != key:
                # The agent was replaced or forgotten (recovery) since its key was cached.
                self.agent_keys.forget(machine_id)
                _reject(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", NOT_ACCEPTED)
        except (SQLAlchemyError, HeartbeatsNotRecorded) as error:
            self._log_now_and_then(logging.ERROR, "bmdb", "BMDB failed while recording a heartbeat: %s", error)
            _reject(grpc.StatusCode.UNAVAILABLE, "unavailable", "BMDB is unavailable; try again")
        if not recorded:
            _reject(
                grpc.StatusCode.ALREADY_EXISTS, "replayed", "a heartbeat sent at or after this one was already accepted"
            )

    def _log_rejection(self, result: str, peer: str) -> None:
        self._log_now_and_then(logging.INFO, result, "heartbeat rejected (%s) from %s", result, peer)

    def _note_skew(self, machine_id: uuid.UUID, behind_ms: int) -> None:
        """Log a machine's clock skew once (a bounded memory of the machines logged): its agent corrects it.

        A stale request needs no signature, so anyone can send them under ids of their choosing: at most
        SKEW_LINES machines are named each SKEW_LINES_EVERY seconds, the others counted in the next line.
        """
        if machine_id in self._skew_logged:
            return
        self._skew_logged[machine_id] = None
        if len(self._skew_logged) > SKEW_LOGGED_SIZE:
            self._skew_logged.popitem(last=False)
        now = time.monotonic()
        if now - self._skew_window >= SKEW_LINES_EVERY:
            self._skew_window, self._skew_named = now, 0
            if self._skew_unnamed:
                log.warning(
                    "%d more machines' clocks were off beyond the accepted skew, not named (at most %d a %.0fs)",
                    self._skew_unnamed,
                    SKEW_LINES,
                    SKEW_LINES_EVERY,
                )
                self._skew_unnamed = 0
        if self._skew_named >= SKEW_LINES:
            self._skew_unnamed += 1
            return
        self._skew_named += 1
        log.warning(
            "the clock of machine %s is %.0fs %s the server's (at most %.0fs accepted); its agent is told the "
            "server's time",
            machine_id,
            abs(behind_ms) / 1000,
            "behind" if behind_ms > 0 else "ahead of",
            self.max_skew_ms / 1000,
        )
