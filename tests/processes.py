"""Cleaning up agents that tests started on real SSH servers: they detach and outlive the session."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from foundation.procfs import processes_mentioning


def kill_processes_mentioning(text: str) -> int:
    """Stop every process whose command line or environment contains text, SIGTERM first (a one-file agent then
    removes what it unpacked), SIGKILL after a grace; how many."""
    pids = processes_mentioning(text)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and processes_mentioning(text):
        time.sleep(0.05)
    for pid in processes_mentioning(text):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def parent_pid(pid: int) -> int | None:
    """The parent of pid, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may hold spaces: the fields after its closing parenthesis are fixed.
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_trees(pids: list[int]) -> int:
    """How many programs the pids are: a one-file agent runs as a bootloader and its interpreter, one program."""
    members = set(pids)
    return sum(1 for pid in members if parent_pid(pid) not in members)


def running(pid: int) -> bool:
    """Whether pid runs: not gone, and no zombie waiting for a parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def living_children(pid: int) -> dict[int, str]:
    """The running children of pid, each with its command line."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or parent_pid(int(entry.name)) != pid or not running(int(entry.name)):
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        children[int(entry.name)] = command.replace(b"\0", b" ").decode(errors="replace")
    return children
