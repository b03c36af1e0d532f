"""Cleaning up agents that tests started on real SSH servers: they detach and outlive the session."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def kill_processes_mentioning(text: str) -> int:
    """SIGKILL every process whose command line or environment contains text; how many."""
    needle = text.encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            details = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in details:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed
