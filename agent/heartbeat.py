"""Heartbeats as the agent signs and sends them (proto.signing says what the signature covers).

Kept free of the rest of Shepherd: it runs inside the agent executable.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proto import AGENT_MAX_RETRY_INTERVAL, SERVER_TIME_METADATA, agent_api_pb2
from proto.signing import NONCE_SIZE, signing_payload

# Never retry sooner than this, whatever the jitter draws.
MIN_RETRY_DELAY = 0.1


def signed_heartbeat(
    machine_id: str, key: Ed25519PrivateKey, now_ms: int | None = None
) -> agent_api_pb2.HeartbeatRequest:
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
        key: Ed25519PrivateKey,
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

    def _correct_clock(self, error: Any) -> bool:
        """Take the server's time from a stale refusal; True when it moved this agent's notion of now."""
        told = dict(error.trailing_metadata() or ()).get(SERVER_TIME_METADATA)
        try:
            offset = int(str(told)) - int(self.clock() * 1000)
        except ValueError:
            return False
        if abs(offset - self.clock_offset_ms) < 1000:
            return False
        how = f"{abs(offset) / 1000:.0f}s {'behind' if offset > 0 else 'ahead of'}"
        self.log(f"this machine's clock is {how} the heartbeat server's: heartbeats follow it")
        self.clock_offset_ms = offset
        return True

    def run(self, call: Callable[..., Any] | None = None) -> str:
        """Heartbeat until a newer agent has taken over; returns why it stopped. call: the RPC (tests give one)."""
        import grpc  # after the fork that detached the agent: grpc must not cross a fork

        if call is None:
            channel = grpc.secure_channel(self.endpoint, self._credentials(grpc))
            call = channel.unary_unary(
                "/shepherd.agent.v1.AgentCallback/Heartbeat",
                request_serializer=agent_api_pb2.HeartbeatRequest.SerializeToString,
                response_deserializer=agent_api_pb2.HeartbeatResponse.FromString,
            )
        accepted_once = False
        failures = 0
        while True:
            if (reason := self.stop_reason()) is not None:
                return reason
            try:
                response = call(signed_heartbeat(self.machine_id, self.key, self._sent_at_ms()), timeout=10)
            except grpc.RpcError as error:
                code = error.code()
                if accepted_once and code is grpc.StatusCode.UNAUTHENTICATED:
                    return f"heartbeat refused ({error.details()}): a newer agent has taken over"
                if code is grpc.StatusCode.FAILED_PRECONDITION and self._correct_clock(error):
                    # Sent again at once in the server's time; a second refusal backs off as any failure.
                    continue
                failures += 1
                delay = retry_delay(failures, self.retry_interval, self.max_retry_interval, self.rng)
                # Every failure at first, then ever more rarely: a long outage must not fill the disk.
                if failures & (failures - 1) == 0:
                    self.log(f"heartbeat failed {failures} time(s) ({code.name}: {error.details()}); retrying")
                self.sleep(delay)
                continue
            if failures:
                self.log(f"heartbeat accepted again after {failures} failure(s)")
            failures = 0
            accepted_once = True
            wait = response.next_heartbeat_in_ms / 1000 if response.next_heartbeat_in_ms > 0 else self.interval
            self.sleep(wait)

    def _credentials(self, grpc: Any) -> Any:
        if not self.ca_certificates_der:
            return grpc.ssl_channel_credentials()
        from cryptography import x509
        from cryptography.hazmat.primitives.serialization import Encoding

        # Every CA of the bundle is a root: a server certificate from the old CA or the new is trusted.
        pem = b"".join(
            x509.load_der_x509_certificate(der).public_bytes(Encoding.PEM) for der in self.ca_certificates_der
        )
        return grpc.ssl_channel_credentials(root_certificates=pem)


def detach() -> bool:
    """Double-fork into a daemon with no terminal and /dev/null for stdio; True in the daemon.

    The SSH session that started the agent ends when the agent's standard
    output closes, so the daemon must hold none of the session's descriptors.
    """
    if os.fork() > 0:
        return False
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return True
