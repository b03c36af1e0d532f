"""The agent callback server: authenticated heartbeats into BMDB.

Every request is signed with the ed25519 key the agent reported at takeover.
The answer to an unknown machine, a wrong key and a bad signature is the same,
so nothing leaks about which machines exist. Accepted heartbeats go to BMDB
only: the fleet watchdog reads them there, and no workflow is woken.

Two calls take the same heartbeats through the same checks: Heartbeats, one
long-lived stream an agent with an answer a message, and the unary Heartbeat
of older agents, which refuses with a gRPC status instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import random
import resource
import signal
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf.message import DecodeError
from sqlalchemy.exc import SQLAlchemyError
from temporalio.common import MetricMeter

from bmdb.heartbeat_batcher import HeartbeatBatcher
from bmdb.migrate import open_bmdb
from bmdb.store import BMDB, Heartbeat, HeartbeatsNotRecorded
from foundation.files import FileChanges
from foundation.logs import configure_logging
from foundation.metrics import (
    HEARTBEAT_SERVER_CERTIFICATE,
    CertificateExpiry,
    meter_of,
    metrics_runtime,
)
from foundation.precise_sleep import precise_sleep
from foundation.settings import Settings, SettingsError, check_listen_address
from foundation.startup import StartupError
from foundation.tls import CertificateProblem, NotValidYet, load_key_pair, read_pem
from proto import SERVER_TIME_METADATA, STREAM_REFUSED_METADATA, agent_api_pb2
from proto.signing import NONCE_SIZE, SIGNATURE_SIZE, signing_payload

log = logging.getLogger("shepherd.heartbeat")

T = TypeVar("T")

SERVICE = "shepherd.agent.v1.AgentCallback"
# A HeartbeatRequest is about 150 bytes; anything far larger is not one.
MAX_REQUEST_SIZE = 1024
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
# Agent keys kept in memory, least recently used dropped first: 100,000 keys are about 20 MB.
KEY_CACHE_SIZE = 100_000
# Machines whose clock skew was logged, remembered so each is logged once.
SKEW_LOGGED_SIZE = 10_000
# Machine ids BMDB has no agent for, remembered for one heartbeat interval: a flood of them costs no BMDB reads.
UNKNOWN_CACHE_SIZE = 100_000
# Addresses whose request rate is tracked, least recently seen dropped first.
PEERS_TRACKED = 10_000
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
# Keepalive: an agent's machine that is rebooted or cut off never closes its connection, and its stream would
# stay open (and count against MAX_STREAMS) for ever; the server pings a connection quiet for this long and
# drops it when no answer comes within KEEPALIVE_TIMEOUT_MS. Two minutes (four heartbeat intervals) drops a dead
# machine's stream well before the cap could fill with them, and at 100,000 connections is under 1,000 pings a
# second, which gRPC's core answers without Python.
KEEPALIVE_TIME_MS = 120_000
KEEPALIVE_TIMEOUT_MS = 20_000
# At most one line a kind of rejection this often, with how many were not logged.
REJECTION_LOG_EVERY = 10.0
# Threads checking signatures: a check lets go of the GIL, so on a host with two cores or more two of them check
# a large batch in half the time, and the heartbeats waiting on it are answered sooner.
SIGNATURE_THREADS = 2
# A batch is split over the threads only from this many checks a thread: below it a second hop costs more than it
# saves.
SPLIT_ABOVE = 8
# How much each new duration moves a StandIn's averages.
STAND_IN_WEIGHT = 1 / 32
# How often serve_in_processes looks at its processes, and how long each may take to stop.
PROCESS_POLL = 1.0
PROCESS_STOP_TIMEOUT = 15.0
# Verified when a machine has no agent key, so an unknown id costs what a wrong key does.
_DUMMY_KEY = Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


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
    ) -> None:
        self.bmdb = bmdb
        self.batcher = HeartbeatBatcher(bmdb)
        self._signature_checks = SignatureChecks()
        # An id known to have no agent key is answered after as long as reading one from BMDB takes.
        self.key_read_time = StandIn(sleep)
        # A heartbeat then costs one BMDB statement, not two. A cached key
        # never lets a heartbeat in on its own: the recording statement
        # checks the key against BMDB again, and a miss re-reads it.
        self._keys: OrderedDict[uuid.UUID, bytes] = OrderedDict()
        self._key_cache_size = key_cache_size
        self._skew_logged: OrderedDict[uuid.UUID, None] = OrderedDict()
        # Machine id -> until when BMDB is not asked again for it (it had no agent key).
        self._unknown: OrderedDict[uuid.UUID, float] = OrderedDict()
        # Peer address -> (tokens, when counted): a token bucket each; peer_rate 0 is no limit.
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.peer_rate, self.peer_burst = peer_rate, peer_burst
        # Rejection result -> (when last logged, how many since).
        self._rejections_logged: dict[str, tuple[float, int]] = {}
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
        keys = await self.bmdb.agent_public_keys(self._key_cache_size)
        self._keys.update(keys)
        return len(keys)

    async def close(self) -> None:
        await self.batcher.close()
        self._signature_checks.close()

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
            response = await self._within_limits(_host_of(peer), lambda: self.check_and_record(request_bytes))
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
        host = _host_of(peer)
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
        if not self._peer_allowed(host):
            _reject(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited", "too many requests from this address")
        if self.in_flight >= self.max_in_flight:
            _reject(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", BUSY)
        self.in_flight += 1
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
            key = await self._signing_key(machine_id, request)
            recorded = await self.batcher.record(Heartbeat(machine_id, key, sent_at))
            if not recorded and await self.bmdb.agent_public_key(machine_id) != key:
                # The agent was replaced or forgotten (recovery) since its key was cached.
                self._keys.pop(machine_id, None)
                _reject(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", NOT_ACCEPTED)
        except (SQLAlchemyError, HeartbeatsNotRecorded) as error:
            self._log_now_and_then(logging.ERROR, "bmdb", "BMDB failed while recording a heartbeat: %s", error)
            _reject(grpc.StatusCode.UNAVAILABLE, "unavailable", "BMDB is unavailable; try again")
        if not recorded:
            _reject(
                grpc.StatusCode.ALREADY_EXISTS, "replayed", "a heartbeat sent at or after this one was already accepted"
            )

    def _peer_allowed(self, host: str) -> bool:
        """Take a token from the host's bucket; False when it is empty (too many requests from one address)."""
        if self.peer_rate <= 0:
            return True
        now = time.monotonic()
        tokens, then = self._peers.pop(host, (self.peer_burst, now))
        tokens = min(self.peer_burst, tokens + (now - then) * self.peer_rate)
        allowed = tokens >= 1.0
        self._peers[host] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._peers) > PEERS_TRACKED:
            self._peers.popitem(last=False)
        return allowed

    def _log_rejection(self, result: str, peer: str) -> None:
        self._log_now_and_then(logging.INFO, result, "heartbeat rejected (%s) from %s", result, peer)

    def _log_now_and_then(self, level: int, kind: str, message: str, *args: object) -> None:
        """One line per kind every REJECTION_LOG_EVERY seconds, with how many it stands for: a flood of junk or a
        BMDB outage must not flood the log too (every rejection is counted in shepherd_heartbeat_requests_total)."""
        now = time.monotonic()
        last, unlogged = self._rejections_logged.get(kind, (float("-inf"), 0))
        if now - last < REJECTION_LOG_EVERY:
            self._rejections_logged[kind] = (last, unlogged + 1)
            return
        self._rejections_logged[kind] = (now, 0)
        more = f"; {unlogged} more since the last line" if unlogged else ""
        log.log(level, message + "%s", *args, more)

    def _note_skew(self, machine_id: uuid.UUID, behind_ms: int) -> None:
        """Log a machine's clock skew once (a bounded memory of the machines logged): its agent corrects it."""
        if machine_id in self._skew_logged:
            return
        self._skew_logged[machine_id] = None
        if len(self._skew_logged) > SKEW_LOGGED_SIZE:
            self._skew_logged.popitem(last=False)
        log.warning(
            "the clock of machine %s is %.0fs %s the server's (at most %.0fs accepted); its agent is told the "
            "server's time",
            machine_id,
            abs(behind_ms) / 1000,
            "behind" if behind_ms > 0 else "ahead of",
            self.max_skew_ms / 1000,
        )

    async def _signing_key(self, machine_id: uuid.UUID, request: agent_api_pb2.HeartbeatRequest) -> bytes:
        """The machine's agent key that signed this request, from the cache or else from BMDB.

        Every refusal costs one signature check and one BMDB read, or the
        time of one: an unknown id and a wrong key cannot be told apart by
        how long the answer takes.
        """
        cached = self._keys.get(machine_id)
        if cached is not None and await self._signature_checks.signed_by(cached, request):
            self._keys.move_to_end(machine_id)
            return cached
        now = time.monotonic()
        if self._unknown.get(machine_id, 0.0) > now:
            # Waiting costs neither BMDB nor CPU, and a prober cannot renew the entry: it lapses after an interval.
            await self.key_read_time.wait()
            key = None
        else:
            started = time.perf_counter()
            key = await self.bmdb.agent_public_key(machine_id)
            self.key_read_time.add(time.perf_counter() - started)
            self._remember_unknown(machine_id, None if key is not None else now + self.interval_ms / 1000)
        if key is None:
            # Checked against a dummy key, for the time of a real check; the answer is no whatever it says.
            await self._signature_checks.signed_by(_DUMMY_KEY, request)
            _reject(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", NOT_ACCEPTED)
        # The key BMDB holds is the cached one that did not verify: no second check needed to say no.
        if key == cached or not await self._signature_checks.signed_by(key, request):
            _reject(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", NOT_ACCEPTED)
        self._keys[machine_id] = key
        self._keys.move_to_end(machine_id)
        if len(self._keys) > self._key_cache_size:
            self._keys.popitem(last=False)
        return key

    def _remember_unknown(self, machine_id: uuid.UUID, until: float | None) -> None:
        """Keep BMDB from being asked about a machine without an agent key until `until`; None forgets it."""
        self._unknown.pop(machine_id, None)
        if until is None:
            return
        self._unknown[machine_id] = until
        if len(self._unknown) > UNKNOWN_CACHE_SIZE:
            self._unknown.popitem(last=False)


class StandIn:
    """Waits as long as an operation takes on average, for answers that skip it but must not be told apart.

    Both averages move: the operation's duration, and how much longer than asked
    a wait lasts (waking takes its time too), so the waits last what the
    operation does. The waits are precise below the millisecond, where
    asyncio's own timers are not: waits that were often too short and sometimes
    a millisecond too long would match on average and still be told apart.
    """

    def __init__(self, sleep: Callable[[float], Awaitable[None]] = precise_sleep) -> None:
        self._sleep = sleep
        self.seconds = 0.0
        self._overshoot = 0.0
        self._timed = 0

    def add(self, seconds: float) -> None:
        """Count one run of the operation and how long it took."""
        self._timed += 1
        # The first runs weigh more, so the average starts at a real duration rather than at zero.
        self.seconds += (seconds - self.seconds) * max(STAND_IN_WEIGHT, 1 / self._timed)

    async def wait(self) -> None:
        asked = max(0.0, self.seconds - self._overshoot)
        started = time.perf_counter()
        await self._sleep(asked)
        self._overshoot += (time.perf_counter() - started - asked - self._overshoot) * STAND_IN_WEIGHT


def _host_of(peer: str) -> str:
    """The address of a gRPC peer ("ipv4:10.0.0.7:51234", "ipv6:[::1]:51234"), without its port."""
    address = peer.partition(":")[2] or peer
    return address.rpartition(":")[0] or address


class SignatureChecks:
    """Checks signatures in threads of their own, those that arrive meanwhile together in one hop.

    An ed25519 check lets go of the GIL, so the checks run beside the event
    loop, on other cores where there are any, while gRPC and BMDB go on.
    """

    def __init__(self, threads: int = SIGNATURE_THREADS) -> None:
        # A thread each, so that a small batch always goes to the first: with one pool of several threads the
        # hops of the unary call's small batches wandered between them and it took 15% fewer heartbeats a second.
        self._executors = [
            ThreadPoolExecutor(1, thread_name_prefix=f"signature-checks-{number}") for number in range(threads)
        ]
        self._waiting: list[tuple[bytes, agent_api_pb2.HeartbeatRequest, asyncio.Future[bool]]] = []
        self._checking: asyncio.Task[None] | None = None

    async def signed_by(self, key: bytes, request: agent_api_pb2.HeartbeatRequest) -> bool:
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((key, request, outcome))
        if self._checking is None:
            self._checking = asyncio.create_task(self._check_while_waiting())
        return await outcome

    def close(self) -> None:
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)

    async def _check_while_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    verdicts = await self._check_on_threads(loop, batch)
                except asyncio.CancelledError:
                    for _, _, outcome in batch:
                        outcome.cancel()
                    raise
                except Exception as error:  # a fault of ours: its callers hear it rather than wait forever
                    for _, _, outcome in batch:
                        if not outcome.done():
                            outcome.set_exception(error)
                    raise
                for (_, _, outcome), verdict in zip(batch, verdicts, strict=True):
                    if not outcome.done():
                        outcome.set_result(verdict)
        finally:
            self._checking = None

    async def _check_on_threads(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[bytes, agent_api_pb2.HeartbeatRequest, asyncio.Future[bool]]],
    ) -> list[bool]:
        # A small batch in one hop; a large one split over the threads, which check side by side.
        parts = min(len(self._executors), max(1, len(batch) // SPLIT_ABOVE))
        if parts == 1:
            return await loop.run_in_executor(self._executors[0], _check_all, batch)
        size = -(-len(batch) // parts)
        chunks = [batch[start : start + size] for start in range(0, len(batch), size)]
        verdicts = await asyncio.gather(
            *(
                loop.run_in_executor(executor, _check_all, chunk)
                for executor, chunk in zip(self._executors[: len(chunks)], chunks, strict=True)
            )
        )
        return [verdict for chunk in verdicts for verdict in chunk]


def _check_all(batch: list[tuple[bytes, agent_api_pb2.HeartbeatRequest, asyncio.Future[bool]]]) -> list[bool]:
    return [_signed_by(key, request) for key, request, _ in batch]


def _signed_by(key: bytes, request: agent_api_pb2.HeartbeatRequest) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(
            request.signature, signing_payload(request.machine_id, request.sent_at_unix_ms, request.nonce)
        )
    except (InvalidSignature, ValueError):
        return False
    return True


# A renewed certificate that is not valid yet is served this long after its validity begins: a client whose clock
# is a little behind (or reads the time coarsely) would refuse it a moment earlier.
NOT_BEFORE_MARGIN = 60.0


class ServingCertificate:
    """The heartbeat server's certificate chain and key, read again whenever either file changes on disk.

    gRPC calls fetch before every TLS handshake, so each new connection gets the pair now on disk and the
    connections already open keep theirs: renewing the files needs no restart and refuses no agent. While nothing
    changed, fetch costs two stat calls. A new pair that cannot be served (a file half written, a key that is not
    the certificate's, a certificate expired) is logged once a change, naming the file, and the pair before it is
    served on; one not valid yet is taken not_before_margin after its validity begins. Each process of
    --processes N holds its own and reloads on its own.
    """

    def __init__(
        self,
        certificate_path: Path,
        key_path: Path,
        *,
        on_change: Callable[[], None] = lambda: None,
        not_before_margin: float = NOT_BEFORE_MARGIN,
    ) -> None:
        self.certificate_path, self.key_path = certificate_path, key_path
        self.on_change = on_change
        self.not_before_margin = timedelta(seconds=not_before_margin)
        # fetch runs on a thread of gRPC's core, refresh on the event loop.
        self._lock = threading.Lock()
        # Stat'ed before the first read, so that a write after it is read at the next look.
        self._files = FileChanges(certificate_path, key_path)
        try:
            # At start there is no pair before to serve meanwhile: one valid now is served.
            self.chain, self._pems = self._read(timedelta(0))
        except CertificateProblem as problem:
            setting = "heartbeat_tls_key_path" if problem.where == str(key_path) else "heartbeat_tls_certificate_path"
            raise SettingsError(setting, str(problem)) from None
        self._configuration = _configuration_of(self._pems)
        self._handed_out = self._configuration
        # When a certificate that was not valid yet is given another try; None: only when a file changes.
        self._retry_at: datetime | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._configuration, self.fetch)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate configuration fetcher: the pair to serve from this handshake on, None for no change."""
        try:
            with self._lock:
                self._reload_if_changed()
                if self._configuration is self._handed_out:
                    return None
                self._handed_out = self._configuration
                return self._configuration
        except Exception:  # gRPC's core would log it at every handshake without the why; the pair before serves on
            log.exception("could not look at the heartbeat server's certificate and key for a change")
            return None

    def current(self) -> list[x509.Certificate]:
        """The chain served from the next handshake on, the files looked at first: the expiry gauge follows a
        rotation even while no agent connects."""
        with self._lock:
            self._reload_if_changed()
            return self.chain

    def _read(self, not_before_margin: timedelta) -> tuple[list[x509.Certificate], tuple[bytes, bytes]]:
        certificate, key = read_pem(self.certificate_path), read_pem(self.key_path)
        chain = load_key_pair(
            certificate, key, str(self.certificate_path), str(self.key_path), not_before_margin=not_before_margin
        )
        return chain, (certificate, key)

    def _reload_if_changed(self) -> None:
        # Looked at before reading: a write after the read changes what the next look sees, and is read then.
        changed = self._files.look()
        retry = self._retry_at is not None and datetime.now(UTC) >= self._retry_at
        if not changed and not retry:
            return
        self._retry_at = None
        try:
            chain, pems = self._read(self.not_before_margin)
        except CertificateProblem as problem:
            if isinstance(problem, NotValidYet):
                self._retry_at = problem.valid_from
            log.warning("heartbeat server certificate not reloaded, the one before is served on: %s", problem)
            return
        if pems == self._pems:
            return  # touched or copied over with the same contents
        self.chain, self._pems = chain, pems
        self._configuration = _configuration_of(pems)
        leaf = chain[0]
        log.info(
            "heartbeat server certificate reloaded from %s: serial %x, valid until %s UTC; new connections get it",
            self.certificate_path,
            leaf.serial_number,
            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M}",
        )
        self.on_change()


def _configuration_of(pems: tuple[bytes, bytes]) -> grpc.ServerCertificateConfiguration:
    certificate, key = pems
    return grpc.ssl_server_certificate_configuration([(key, certificate)])


def build_server(
    service: HeartbeatService,
    listen: str,
    tls: ServingCertificate | tuple[Path, Path] | None,
    *,
    maximum_concurrent_rpcs: int | None = None,
    share_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """The gRPC server and the port it bound; tls is the ServingCertificate, or its (certificate chain, private
    key) PEM files.

    maximum_concurrent_rpcs is gRPC's own cap on calls open at once, unary calls and streams together, above
    which gRPC answers RESOURCE_EXHAUSTED before the service sees the call: by default the service's streams and
    heartbeats in flight, so the service's own, finer caps are the ones that act. share_port binds with
    SO_REUSEPORT, for several processes of ours on one port (serve_in_processes).
    """
    if maximum_concurrent_rpcs is None:
        maximum_concurrent_rpcs = service.max_streams + service.max_in_flight
    server = grpc.aio.server(
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_SIZE),
            # gRPC binds with SO_REUSEPORT by default: a second server on the same port would then start
            # silently and take half the agents' connections, and "cannot listen" would never be said.
            ("grpc.so_reuseport", 1 if share_port else 0),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # A dead peer sends no data: the server's pings must not wait for data between them to go on.
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    # Requests are parsed by the service, so malformed bytes get INVALID_ARGUMENT (MALFORMED), not a generic error.
    unary = grpc.unary_unary_rpc_method_handler(
        service.handle, request_deserializer=None, response_serializer=agent_api_pb2.HeartbeatResponse.SerializeToString
    )
    # The service serializes a stream's answers itself: an accepted one is the same bytes every time.
    stream = grpc.stream_stream_rpc_method_handler(service.stream, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Heartbeat": unary, "Heartbeats": stream}),)
    )
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            serving = tls if isinstance(tls, ServingCertificate) else ServingCertificate(*tls)
            port = server.add_secure_port(listen, serving.credentials())
    except RuntimeError:
        # grpcio raises this, with no reason, where older versions returned port 0.
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the port is taken, or the address is not this host's")
    return server, port


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one, and return it. An agent holds a connection, and a
    connection is a file: systemd starts a service with a soft limit of 1,024, past which gRPC's core stops
    accepting connections with no more than "File descriptor limit reached" in its log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as error:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, hard, error)
    return soft


async def run_heartbeat_server(
    settings: Settings, database_url: str, *, stop: asyncio.Event | None = None, share_port: bool = False
) -> None:
    """Serve heartbeats until SIGTERM/SIGINT (or stop is set)."""
    open_files = raise_open_files_limit()
    runtime = metrics_runtime(settings.metrics_listen, "heartbeat-server")
    expiry = CertificateExpiry(meter_of(runtime))
    loop = asyncio.get_running_loop()
    tls = None
    if not settings.heartbeat_plaintext:
        assert settings.heartbeat_tls_certificate_path and settings.heartbeat_tls_key_path

        def reloaded() -> None:
            # Called on a thread of gRPC's core too; the gauge is set on the event loop.
            loop.call_soon_threadsafe(expiry.refresh)

        tls = ServingCertificate(
            settings.heartbeat_tls_certificate_path, settings.heartbeat_tls_key_path, on_change=reloaded
        )
        expiry.watch(HEARTBEAT_SERVER_CERTIFICATE, tls.current)
    expiry.watch_bmdb_client(database_url)
    bmdb = await open_bmdb(database_url)
    service = HeartbeatService(
        bmdb,
        interval=settings.heartbeat_interval,
        max_skew=settings.heartbeat_max_skew,
        meter=meter_of(runtime),
        # One address sending more than a whole 100,000-machine fleet is a flood; behind a proxy every agent
        # shares the proxy's address, which the default leaves room for.
        peer_rate=settings.heartbeat_peer_rate,
        peer_burst=2 * settings.heartbeat_peer_rate,
        max_streams=settings.heartbeat_max_streams,
        # Keyed by address as peer_rate is: behind a proxy that hides the agents' addresses, 0 turns it off.
        max_streams_per_address=settings.heartbeat_max_streams_per_address,
    )
    try:
        server, _ = build_server(service, settings.heartbeat_listen, tls, share_port=share_port)
    except OSError as error:
        await bmdb.close()
        raise OSError(f"{error} (setting heartbeat_listen)") from None
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        loaded = await service.load_keys()
    except SQLAlchemyError as error:
        # Serving without them only costs a BMDB read a machine, as they come; refusing to start would cost more.
        log.warning("could not load the agents' keys (%s); each is read from BMDB at its first heartbeat", error)
        loaded = 0
    await server.start()
    log.info(
        "heartbeat server on %s (%s), %d agent keys loaded, open files (a connection an agent): %s",
        settings.heartbeat_listen,
        "plain text" if tls is None else "TLS",
        loaded,
        "no limit" if open_files == resource.RLIM_INFINITY else f"at most {open_files:,}",
    )
    # Without /metrics the files are still looked at each minute, so a bad new pair is logged even while no
    # agent connects.
    watching = asyncio.create_task(expiry.run(stop))
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        watching.cancel()
        service.end_streams()
        await server.stop(grace=5)
        await service.close()
        await bmdb.close()
        log.info("heartbeat server stopped; requests by result: %s", dict(service.results))


class HeartbeatProcessStopped(Exception):
    """One of several heartbeat server processes stopped on its own; the others were stopped too."""


def serve_in_processes(settings: Settings, database_url: str, processes: int, *, verbose: bool = False) -> None:
    """Serve heartbeats from several processes on one port until SIGTERM/SIGINT; the kernel spreads the agents'
    connections over them (SO_REUSEPORT). Process i serves /metrics on metrics_listen's port + i.

    Raises OSError when the port is taken (by anything but these processes), and HeartbeatProcessStopped when one
    of them stops on its own (its log says why).
    """
    _check_port_free(settings.heartbeat_listen)
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(
            target=_serve_one,
            args=(_settings_of_process(settings, number), database_url, verbose),
            name=f"heartbeat-server-{number}",
        )
        for number in range(processes)
    ]
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        for child in children:
            child.start()
        log.info("heartbeat server: %d processes share %s", processes, settings.heartbeat_listen)
        while not stop.is_set():
            multiprocessing.connection.wait([child.sentinel for child in children], timeout=PROCESS_POLL)
            stopped = [child for child in children if child.exitcode is not None]
            if stopped and not stop.is_set():
                raise HeartbeatProcessStopped(
                    f"heartbeat server process {stopped[0].name} stopped with status {stopped[0].exitcode}"
                    " (its log says why); the others were stopped too"
                )
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()  # SIGTERM: each stops its server gracefully
        for child in children:
            child.join(PROCESS_STOP_TIMEOUT)
            if child.is_alive():
                child.kill()
                child.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _settings_of_process(settings: Settings, number: int) -> Settings:
    if not settings.metrics_listen:
        return settings
    host, port = check_listen_address("metrics_listen", settings.metrics_listen)
    return dataclasses.replace(settings, metrics_listen=f"{host}:{port + number}")


def _serve_one(settings: Settings, database_url: str, verbose: bool) -> None:
    """One of serve_in_processes' processes (started fresh, so it sets up its own logging)."""
    configure_logging(settings.log_format, verbose=verbose)
    try:
        asyncio.run(run_heartbeat_server(settings, database_url, share_port=True))
    except (OSError, SQLAlchemyError, StartupError, SettingsError) as error:
        log.error("heartbeat server process %s cannot serve: %s", multiprocessing.current_process().name, error)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches every process of the group; the server stopped on it


def _check_port_free(listen: str) -> None:
    """Refuse a port something listens on already: sharing it (SO_REUSEPORT) would not tell."""
    host, port = check_listen_address("heartbeat_listen", listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen} from several processes: they need one fixed port")
    family, kind, protocol, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, protocol) as probe:
        # As gRPC binds: connections of a server stopped a moment ago do not count as taking the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            raise OSError(f"cannot listen on {listen}: the port is taken, or the address is not this host's") from None
