"""Heartbeats as the agent signs and sends them (proto.signing says what the signature covers).

Kept free of the rest of Shepherd: it runs inside the agent executable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proto import agent_api_pb2
from proto.signing import NONCE_SIZE, signing_payload


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


class HeartbeatLoop:
    """Send heartbeats to the endpoint of the TakeoverInit until told to stop.

    A heartbeat server that is down is retried every few seconds, so the agent
    catches up as soon as it is back. Once a heartbeat was accepted, an answer
    that the agent is unknown or its key wrong means a newer agent took over:
    this one stops. (Before that, Shepherd may simply not have recorded the
    key yet.) So does one
    whose server stayed unreachable for give_up_after: by then Shepherd has
    rebooted the machine.
    """

    def __init__(
        self,
        machine_id: str,
        key: Ed25519PrivateKey,
        endpoint: str,
        ca_certificate_der: bytes,
        *,
        interval: float = 30.0,
        retry_interval: float = 5.0,
        give_up_after: float = 3600.0,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.machine_id = machine_id
        self.key = key
        self.endpoint = endpoint
        self.ca_certificate_der = ca_certificate_der
        self.interval = interval
        self.retry_interval = retry_interval
        self.give_up_after = give_up_after
        self.log = log

    def run(self) -> str:
        """Heartbeat until a reason to stop; returns the reason."""
        import grpc  # after the fork that detached the agent: grpc must not cross a fork

        channel = grpc.secure_channel(self.endpoint, self._credentials(grpc))
        call = channel.unary_unary(
            "/shepherd.agent.v1.AgentCallback/Heartbeat",
            request_serializer=agent_api_pb2.HeartbeatRequest.SerializeToString,
            response_deserializer=agent_api_pb2.HeartbeatResponse.FromString,
        )
        last_success = time.monotonic()
        accepted_once = False
        while True:
            try:
                response = call(signed_heartbeat(self.machine_id, self.key), timeout=10)
            except grpc.RpcError as error:
                code = error.code()
                if accepted_once and code is grpc.StatusCode.UNAUTHENTICATED:
                    return f"heartbeat refused ({error.details()}): a newer agent has taken over"
                if time.monotonic() - last_success > self.give_up_after:
                    return f"no heartbeat accepted for {self.give_up_after:.0f}s: giving up"
                self.log(f"heartbeat failed ({code.name}: {error.details()}); retrying")
                time.sleep(self.retry_interval)
                continue
            last_success = time.monotonic()
            accepted_once = True
            wait = response.next_heartbeat_in_ms / 1000 if response.next_heartbeat_in_ms > 0 else self.interval
            time.sleep(wait)

    def _credentials(self, grpc: Any) -> Any:
        if not self.ca_certificate_der:
            return grpc.ssl_channel_credentials()
        from cryptography import x509
        from cryptography.hazmat.primitives.serialization import Encoding

        pem = x509.load_der_x509_certificate(self.ca_certificate_der).public_bytes(Encoding.PEM)
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
