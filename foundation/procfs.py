"""The processes of this host, as /proc shows them: for finding what a run started, detached ones included.

A detached process may have left the session and process group it was started in, so the processes a test,
a benchmark or a simulated machine started are found by a marker in their command line or environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Set
from pathlib import Path

_PROC = Path("/proc")


def _others() -> Iterator[tuple[int, Path]]:
    """(pid, its /proc directory) of every process but this one."""
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield int(entry.name), entry


def process_environments() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, its NAME=value variables) of every process this user may read, other than this one."""
    for pid, entry in _others():
        try:
            yield pid, (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile, or not ours to read


def processes_with_variable(variable: bytes) -> list[int]:
    """Pids of the processes whose environment holds exactly that NAME=value."""
    return processes_with_any_variable({variable})


def processes_with_any_variable(variables: Set[bytes]) -> list[int]:
    """Pids of the processes whose environment holds any of those NAME=values, each matched whole: one look at /proc
    for many markers, where a host runs a thousand processes."""
    return [pid for pid, environment in process_environments() if not variables.isdisjoint(environment)]


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes, other than this one, whose command line or environment contains text."""
    needle = text.encode()
    found = []
    for pid, entry in _others():
        try:
            details = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in details:
            found.append(pid)
    return found


def children_of(parent: int, mentioning: str = "") -> list[int]:
    """Pids of the running processes whose parent is parent (zombies left out), and whose command line contains
    mentioning when given."""
    needle = mentioning.encode()
    found = []
    for pid, entry in _others():
        try:
            # The command name may hold spaces and parentheses: the fields start after its last ")".
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) != parent or state == "Z" or needle not in (entry / "cmdline").read_bytes():
                continue
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        found.append(pid)
    return found
