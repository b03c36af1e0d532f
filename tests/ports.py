"""Free TCP ports of 127.0.0.1 for the servers the tests start."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A port of 127.0.0.1 free now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """count different free ports of 127.0.0.1: each stays bound until all are chosen, since a port let go of may
    be the next one the kernel hands out."""
    with contextlib.ExitStack() as bound:
        sockets = [bound.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
