"""Heartbeats as the agent signs and sends them (proto.signing says what the signature covers).

Kept free of the rest of Shepherd: it runs inside the agent executable.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence

from google.protobuf.message import DecodeError

from agent.grpc_channel import Channel
from agent.grpc_messages import RpcError
from agent.keys import Signer
from proto import AGENT_MAX_RETRY_INTERVAL, SERVER_TIME_METADATA, STREAM_REFUSED_METADATA, agent_api_pb2
from proto.signing import NONCE_SIZE, signing_payload

# Never retry sooner than this, whatever the jitter draws.
MIN_RETRY_DELAY = 0.1
HEARTBEAT_METHOD = "/shepherd.agent.v1.AgentCallback/Heartbeat"
HEARTBEATS_METHOD = "/shepherd.agent.v1.AgentCallback/Heartbeats"
# The longest a heartbeat waits for its answer, on the stream as on a unary call; then the stream is given up
# and opened again: a server that vanished without closing the connection must not hold the agent.
ANSWER_TIMEOUT = 10.0
# After a server without the stream (an older Shepherd) answered UNIMPLEMENTED, the unary call is used for this
# long, then the stream is tried again: an upgraded server is used within the hour without restarting the agent,
# and an old one costs one refused stream an agent an hour.
STREAM_RETRY_AFTER = 3600.0
# After a server refused a stream for its cap on streams, the unary call is used for about this long (drawn
# between half of it and all of it, so the refused agents do not come back in step), then the stream is tried
# again: a stream freed meanwhile is taken up, and a server still full costs one refusal an agent a while.
STREAM_REFUSED_RETRY_AFTER = 600.0
# How long refusals must go on, once a heartbeat was accepted, before the agent stops, when its TakeoverInit does
# not say (an older Shepherd): Shepherd's default heartbeat timeout.
REFUSED_FOR_BEFORE_STOPPING = 600.0
Outcome = agent_api_pb2.HeartbeatResponse.Outcome
# A unary Heartbeat call: the request and the seconds to wait for its answer.
UnaryCall = Callable[[agent_api_pb2.HeartbeatRequest, float], agent_api_pb2.HeartbeatResponse]


class HeartbeatFailed(Exception):
    """A heartbeat that got no outcome: the stream or the call broke, or gave no answer in time."""

    def __init__(self, code_name: str, details: str) -> None:
        super().__init__(f"{code_name}: {details}")
        self.code_name = code_name


class StreamUnavailable(Exception):
    """No Heartbeats stream to be had: the server has none (an older Shepherd), or holds as many as it takes; the
    unary call is used instead."""

    def __init__(self, why: str, *, full: bool) -> None:
        super().__init__(why)
        self.full = full


class HeartbeatStream:
    """One Heartbeats stream: send a heartbeat, wait for its answer (at most ANSWER_TIMEOUT)."""

    def __init__(self, channel: Channel) -> None:
        self._call = channel.open_stream(HEARTBEATS_METHOD)

    def exchange(self, request: agent_api_pb2.HeartbeatRequest) -> agent_api_pb2.HeartbeatResponse:
        """Send a heartbeat on the stream and return its answer; StreamUnavailable or HeartbeatFailed else."""
        deadline = time.monotonic() + ANSWER_TIMEOUT
        try:
            self._call.send(request.SerializeToString(), deadline)
            answer = self._call.receive(deadline)
        except RpcError as error:
            if error.code == "UNIMPLEMENTED":
                raise StreamUnavailable(error.details, full=False) from None
            if error.code == "RESOURCE_EXHAUSTED" and STREAM_REFUSED_METADATA in error.trailers:
                raise StreamUnavailable(error.details, full=True) from None
            if error.code == "DEADLINE_EXCEEDED":
                raise HeartbeatFailed(error.code, f"no answer within {ANSWER_TIMEOUT:.0f}s") from None
            raise HeartbeatFailed(error.code, error.details) from None
        if answer is None:
            raise HeartbeatFailed("UNAVAILABLE", "the heartbeat server closed the stream")
        return _parsed_answer(answer)

    def close(self) -> None:
        """Cancel the stream."""
        self._call.close()


def signed_heartbeat(machine_id: str, key: Signer, now_ms: int | None = None) -> agent_api_pb2.HeartbeatRequest:
    """A heartbeat request for now (or now_ms), with a fresh nonce, signed with the agent's key."""
    sent_at = int(time.time() * 1000) if now_ms is None else now_ms
    nonce = os.urandom(NONCE_SIZE)
    return agent_api_pb2.HeartbeatRequest(
        machine_id=machine_id,
        sent_at_unix_ms=sent_at,
        nonce=nonce,
        signature=key.sign(signing_payload(machine_id, sent_at, nonce)),
    )


def retry_delay(failures: int, base: float, cap: float, rng: random.Random) -> float:
    """Seconds before retry number `failures`: anywhere up to base x 2^(failures-1), at most cap ("full jitter").

    Random within the whole window, so a fleet of agents that lost its server at the same moment does not come
    back to it in step when it restarts.
    """
    ceiling = min(cap, base * 2 ** min(max(failures - 1, 0), 32))
    return max(MIN_RETRY_DELAY, rng.uniform(0, ceiling))


class HeartbeatLoop:
    """Send heartbeats to the endpoint of the TakeoverInit until a newer agent has taken over.

    A heartbeat server that cannot be reached, or answers with an error, is retried for as long as it takes,
    with capped exponential back-off and jitter (retry_delay): an outage on Shepherd's side, however long,
    must not leave the fleet without agents. A refusal (the agent unknown, its key wrong) is retried too: a
    heartbeat server pointed at the wrong BMDB, or a restored one, refuses every agent that reaches it, and must
    not stop them all. Only refusals that go on for refused_for_before_stopping after a heartbeat was accepted
    (Shepherd's heartbeat timeout, past which it recovers the machine anyway) stop the agent, or the evidence on
    the machine itself: stop_reason tells why the agent must stop, or None:
    a newer agent has taken over (the reference agent: agent.key holds another key), which also stops an agent
    whose key Shepherd never recorded (its takeover's worker died before it could), or the machine is being
    decommissioned (agent.key removed).
    """

    def __init__(
        self,
        machine_id: str,
        key: Signer,
        endpoint: str,
        ca_certificates_der: Sequence[bytes],
        *,
        interval: float = 30.0,
        retry_interval: float = 5.0,
        max_retry_interval: float = AGENT_MAX_RETRY_INTERVAL,
        log: Callable[[str], None] = lambda line: None,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
        stop_reason: Callable[[], str | None] = lambda: None,
        clock: Callable[[], float] = time.time,
        refused_for_before_stopping: float = REFUSED_FOR_BEFORE_STOPPING,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.machine_id = machine_id
        self.key = key
        self.endpoint = endpoint
        self.ca_certificates_der = tuple(ca_certificates_der)
        self.interval = interval
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self.log = log
        self.sleep = sleep
        # Seeded from the OS per agent, so no two agents draw the same delays.
        self.rng = rng or random.Random(os.urandom(16))
        self.stop_reason = stop_reason
        self.clock = clock
        self.refused_for_before_stopping = refused_for_before_stopping
        self.monotonic = monotonic
        # Milliseconds to add to this machine's clock to be on the server's, as a stale refusal told.
        self.clock_offset_ms = 0
        self.last_sent_ms = 0

    def _sent_at_ms(self) -> int:
        """Now on the server's clock as far as known, and always after the last heartbeat sent."""
        self.last_sent_ms = max(int(self.clock() * 1000) + self.clock_offset_ms, self.last_sent_ms + 1)
        return self.last_sent_ms

    def _correct_clock(self, server_time_ms: int) -> bool:
        """Take the server's time from a stale refusal; True when it moved this agent's notion of now."""
        if server_time_ms <= 0:
            return False
        offset = server_time_ms - int(self.clock() * 1000)
        if abs(offset - self.clock_offset_ms) < 1000:
            return False
        how = f"{abs(offset) / 1000:.0f}s {'behind' if offset > 0 else 'ahead of'}"
        self.log(f"this machine's clock is {how} the heartbeat server's: heartbeats follow it")
        self.clock_offset_ms = offset
        return True

    def run(self, call: UnaryCall | None = None) -> str:
        """Heartbeat until a newer agent has taken over; returns why it stopped.

        Heartbeats go on one Heartbeats stream, opened again when it breaks; a server without it gets unary
        Heartbeat calls. call: a unary call to use instead of a channel (tests give one).
        """
        channel = None
        sleep = self.sleep
        if call is None:
            channel = Channel(self.endpoint, self.ca_certificates_der)
            call = _unary_call(channel)
            # Between heartbeats the connection is kept: the server's keepalive pings are answered while waiting.
            sleep = sleep or channel.wait
        unary = call
        sleep = sleep or time.sleep
        stream: HeartbeatStream | None = None
        # Until when the unary call is used: for ever when a call was given, for a while after UNIMPLEMENTED.
        unary_until = float("inf") if channel is None else 0.0
        accepted_once = False
        # Since when (time.monotonic()) every answer has been a refusal, once a heartbeat was accepted.
        refused_since: float | None = None
        failures = 0
        try:
            while True:
                if (reason := self.stop_reason()) is not None:
                    return reason
                request = signed_heartbeat(self.machine_id, self.key, self._sent_at_ms())
                try:
                    if time.monotonic() < unary_until:
                        response, refused_as = _unary_exchange(unary, request)
                    else:
                        if stream is None:
                            assert channel is not None  # unary_until is for ever without one
                            stream = HeartbeatStream(channel)
                        response = stream.exchange(request)
                        refused_as = _outcome_name(response.outcome)
                except StreamUnavailable as unavailable:
                    assert stream is not None
                    stream.close()
                    stream = None
                    if unavailable.full:
                        using_unary = self.rng.uniform(STREAM_REFUSED_RETRY_AFTER / 2, STREAM_REFUSED_RETRY_AFTER)
                        self.log(
                            f"the heartbeat server refused a heartbeat stream ({unavailable}): using unary calls "
                            f"for {using_unary:.0f}s"
                        )
                    else:
                        using_unary = STREAM_RETRY_AFTER
                        self.log("the heartbeat server has no heartbeat stream (an older Shepherd): using unary calls")
                    unary_until = time.monotonic() + using_unary
                    continue
                except HeartbeatFailed as failure:
                    if stream is not None:
                        stream.close()
                        stream = None
                    failures += 1
                    self._log_failure(failures, str(failure))
                    sleep(retry_delay(failures, self.retry_interval, self.max_retry_interval, self.rng))
                    continue
                outcome = response.outcome
                if outcome == Outcome.ACCEPTED:
                    if failures:
                        self.log(f"heartbeat accepted again after {failures} failure(s)")
                    failures = 0
                    accepted_once = True
                    refused_since = None
                    wait = response.next_heartbeat_in_ms / 1000 if response.next_heartbeat_in_ms > 0 else self.interval
                    sleep(wait)
                    continue
                if accepted_once and outcome == Outcome.NOT_ACCEPTED:
                    now = self.monotonic()
                    if refused_since is None:
                        refused_since = now
                        self.log(
                            f"heartbeat refused ({response.message}) after being accepted: retrying for "
                            f"{self.refused_for_before_stopping:.0f}s before taking it that a newer agent runs"
                        )
                    elif now - refused_since >= self.refused_for_before_stopping:
                        refused_for = f"{now - refused_since:.0f}s"
                        return f"heartbeat refused ({response.message}) for {refused_for}: a newer agent has taken over"
                if outcome == Outcome.STALE and self._correct_clock(response.server_time_unix_ms):
                    # Sent again at once in the server's time; a second refusal backs off as any failure.
                    continue
                failures += 1
                self._log_failure(failures, f"{refused_as}: {response.message}")
                delay = retry_delay(failures, self.retry_interval, self.max_retry_interval, self.rng)
                if outcome == Outcome.RETRY_LATER and response.next_heartbeat_in_ms > 0:
                    # The server's own back-off, which it spreads over the agents it turns away.
                    delay = min(response.next_heartbeat_in_ms / 1000, self.max_retry_interval)
                sleep(delay)
        finally:
            if stream is not None:
                stream.close()
            if channel is not None:
                channel.close()

    def _log_failure(self, failures: int, why: str) -> None:
        # Every failure at first, then ever more rarely: a long outage must not fill the disk.
        if failures & (failures - 1) == 0:
            self.log(f"heartbeat failed {failures} time(s) ({why}); retrying")


def _unary_call(channel: Channel) -> UnaryCall:
    def call(request: agent_api_pb2.HeartbeatRequest, timeout: float) -> agent_api_pb2.HeartbeatResponse:
        return _parsed_answer(channel.unary(HEARTBEAT_METHOD, request.SerializeToString(), timeout))

    return call


def _parsed_answer(answer: bytes) -> agent_api_pb2.HeartbeatResponse:
    try:
        return agent_api_pb2.HeartbeatResponse.FromString(answer)
    except DecodeError:
        size = len(answer)
        raise HeartbeatFailed("INTERNAL", f"the server answered no HeartbeatResponse ({size} bytes)") from None


def _unary_exchange(
    call: UnaryCall, request: agent_api_pb2.HeartbeatRequest
) -> tuple[agent_api_pb2.HeartbeatResponse, str]:
    """A unary Heartbeat call, its answer told as a stream's (a refusal's status becomes its outcome), and the
    status's name for the log."""
    try:
        response = call(request, ANSWER_TIMEOUT)
    except RpcError as error:
        if error.code == "UNAUTHENTICATED":
            return agent_api_pb2.HeartbeatResponse(outcome=Outcome.NOT_ACCEPTED, message=error.details), error.code
        if error.code == "FAILED_PRECONDITION":
            told = error.trailers.get(SERVER_TIME_METADATA, "")
            server_time_ms = int(told) if told.isdigit() else 0
            stale = agent_api_pb2.HeartbeatResponse(
                outcome=Outcome.STALE, message=error.details, server_time_unix_ms=server_time_ms
            )
            return stale, error.code
        raise HeartbeatFailed(error.code, error.details) from None
    return response, "OK"


def _outcome_name(outcome: int) -> str:
    try:
        return Outcome.Name(outcome)
    except ValueError:
        return f"outcome {outcome}"  # from a newer server
