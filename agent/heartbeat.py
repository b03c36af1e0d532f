"""Heartbeats as the agent signs and sends them (proto.signing says what the signature covers).

Kept free of the rest of Shepherd: it runs inside the agent executable.
"""

from __future__ import annotations

import base64
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

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
Outcome = agent_api_pb2.HeartbeatResponse.Outcome


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

    def __init__(self, channel: Any) -> None:
        self._requests: queue.SimpleQueue[agent_api_pb2.HeartbeatRequest | None] = queue.SimpleQueue()
        open_stream = channel.stream_stream(
            HEARTBEATS_METHOD,
            request_serializer=agent_api_pb2.HeartbeatRequest.SerializeToString,
            response_deserializer=agent_api_pb2.HeartbeatResponse.FromString,
        )
        # gRPC reads the requests on a thread of its own, until the None that closes the stream.
        self._call = open_stream(iter(self._requests.get, None))
        self._timed_out = False

    def exchange(self, request: agent_api_pb2.HeartbeatRequest) -> agent_api_pb2.HeartbeatResponse:
        import grpc

        self._requests.put(request)
        timer = threading.Timer(ANSWER_TIMEOUT, self._time_out)
        timer.daemon = True
        timer.start()
        try:
            return next(self._call)
        except StopIteration:
            raise HeartbeatFailed("UNAVAILABLE", "the heartbeat server closed the stream") from None
        except grpc.RpcError as error:
            code = error.code()
            if code is grpc.StatusCode.UNIMPLEMENTED:
                raise StreamUnavailable(error.details(), full=False) from None
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and _says_streams_are_full(error):
                raise StreamUnavailable(error.details(), full=True) from None
            if self._timed_out:
                raise HeartbeatFailed("DEADLINE_EXCEEDED", f"no answer within {ANSWER_TIMEOUT:.0f}s") from None
            raise HeartbeatFailed(code.name, error.details()) from None
        finally:
            timer.cancel()

    def _time_out(self) -> None:
        self._timed_out = True
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


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
    must not leave the fleet without agents. Once a heartbeat was accepted, an answer that the agent is
    unknown or its key wrong means a newer agent took over: this one stops. (Before that, Shepherd may simply
    not have recorded the key yet.) stop_reason tells, on the machine itself, why the agent must stop, or None:
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
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        stop_reason: Callable[[], str | None] = lambda: None,
        clock: Callable[[], float] = time.time,
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

    def run(self, call: Callable[..., Any] | None = None) -> str:
        """Heartbeat until a newer agent has taken over; returns why it stopped.

        Heartbeats go on one Heartbeats stream, opened again when it breaks; a server without it gets unary
        Heartbeat calls. call: a unary call to use instead of a channel (tests give one).
        """
        import grpc  # in the daemon only: the answer to a takeover does not pay for loading it

        channel = None
        if call is None:
            channel = grpc.secure_channel(self.endpoint, self._credentials(grpc))
            call = channel.unary_unary(
                HEARTBEAT_METHOD,
                request_serializer=agent_api_pb2.HeartbeatRequest.SerializeToString,
                response_deserializer=agent_api_pb2.HeartbeatResponse.FromString,
            )
        unary = call
        stream: HeartbeatStream | None = None
        # Until when the unary call is used: for ever when a call was given, for a while after UNIMPLEMENTED.
        unary_until = float("inf") if channel is None else 0.0
        accepted_once = False
        failures = 0
        try:
            while True:
                if (reason := self.stop_reason()) is not None:
                    return reason
                request = signed_heartbeat(self.machine_id, self.key, self._sent_at_ms())
                try:
                    if time.monotonic() < unary_until:
                        response, refused_as = _unary_exchange(grpc, unary, request)
                    else:
                        if stream is None:
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
                    self.sleep(retry_delay(failures, self.retry_interval, self.max_retry_interval, self.rng))
                    continue
                outcome = response.outcome
                if outcome == Outcome.ACCEPTED:
                    if failures:
                        self.log(f"heartbeat accepted again after {failures} failure(s)")
                    failures = 0
                    accepted_once = True
                    wait = response.next_heartbeat_in_ms / 1000 if response.next_heartbeat_in_ms > 0 else self.interval
                    self.sleep(wait)
                    continue
                if accepted_once and outcome == Outcome.NOT_ACCEPTED:
                    return f"heartbeat refused ({response.message}): a newer agent has taken over"
                if outcome == Outcome.STALE and self._correct_clock(response.server_time_unix_ms):
                    # Sent again at once in the server's time; a second refusal backs off as any failure.
                    continue
                failures += 1
                self._log_failure(failures, f"{refused_as}: {response.message}")
                delay = retry_delay(failures, self.retry_interval, self.max_retry_interval, self.rng)
                if outcome == Outcome.RETRY_LATER and response.next_heartbeat_in_ms > 0:
                    # The server's own back-off, which it spreads over the agents it turns away.
                    delay = min(response.next_heartbeat_in_ms / 1000, self.max_retry_interval)
                self.sleep(delay)
        finally:
            if stream is not None:
                stream.close()
            if channel is not None:
                channel.close()

    def _log_failure(self, failures: int, why: str) -> None:
        # Every failure at first, then ever more rarely: a long outage must not fill the disk.
        if failures & (failures - 1) == 0:
            self.log(f"heartbeat failed {failures} time(s) ({why}); retrying")

    def _credentials(self, grpc: Any) -> Any:
        if not self.ca_certificates_der:
            return grpc.ssl_channel_credentials()
        # Every CA of the bundle is a root: a server certificate from the old CA or the new is trusted.
        pem = b"".join(der_to_pem(der) for der in self.ca_certificates_der)
        return grpc.ssl_channel_credentials(root_certificates=pem)


def _says_streams_are_full(error: Any) -> bool:
    """Whether a refused stream's trailing metadata says the server's cap on streams refused it."""
    try:
        trailing = error.trailing_metadata() or ()
    except Exception:
        return False
    return any(key == STREAM_REFUSED_METADATA for key, _ in trailing)


def _unary_exchange(
    grpc: Any, call: Callable[..., Any], request: agent_api_pb2.HeartbeatRequest
) -> tuple[agent_api_pb2.HeartbeatResponse, str]:
    """A unary Heartbeat call, its answer told as a stream's (a refusal's status becomes its outcome), and the
    status's name for the log."""
    try:
        response: agent_api_pb2.HeartbeatResponse = call(request, timeout=ANSWER_TIMEOUT)
    except grpc.RpcError as error:
        code = error.code()
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return agent_api_pb2.HeartbeatResponse(outcome=Outcome.NOT_ACCEPTED, message=error.details()), code.name
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            told = dict(error.trailing_metadata() or ()).get(SERVER_TIME_METADATA)
            try:
                server_time_ms = int(str(told))
            except ValueError:
                server_time_ms = 0
            stale = agent_api_pb2.HeartbeatResponse(
                outcome=Outcome.STALE, message=error.details(), server_time_unix_ms=server_time_ms
            )
            return stale, code.name
        raise HeartbeatFailed(code.name, error.details()) from None
    return response, "OK"


def _outcome_name(outcome: int) -> str:
    try:
        return Outcome.Name(outcome)
    except ValueError:
        return f"outcome {outcome}"  # from a newer server


def der_to_pem(der: bytes) -> bytes:
    """A DER certificate as PEM, which gRPC reads (RFC 7468: base64 in lines of 64 between the labels)."""
    encoded = base64.b64encode(der)
    lines = [encoded[at : at + 64] for at in range(0, len(encoded), 64)]
    return b"-----BEGIN CERTIFICATE-----\n" + b"\n".join(lines) + b"\n-----END CERTIFICATE-----\n"
