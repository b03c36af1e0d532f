"""Cleaning up agents that tests started on real SSH servers: they detach and outlive the session."""

from __future__ import annotations

import contextlib
import os
import signal

from foundation.procfs import processes_mentioning


def kill_processes_mentioning(text: str) -> int:
    """SIGKILL every process whose command line or environment contains text; how many."""
    killed = 0
    for pid in processes_mentioning(text):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed
