"""`shepherd dev` stops every process it started, whether an operator stops it (Ctrl-C) or it is killed outright
(SIGKILL: `kill -9`, the OOM killer, or a test's time limit, which kills the command it waits for)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from foundation.procfs import processes_mentioning
from shepherd.commands.dev_stack.children import DevError, check_port_free
from tests.conftest import DEV_PORTS, DEV_PORTS_WAIT
from tests.processes import kill_processes_mentioning, living_children, running

# What `shepherd dev --machines 1` starts besides PostgreSQL, by a word of each one's command line.
STACK = ("temporal", "simulator", "heartbeat-server", "worker")


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    yield state
    # Whatever a failed test left, and the PostgreSQL of the state dir, a server no child of `shepherd dev`.
    kill_processes_mentioning(str(state))


def start_dev(state: Path, log: Path) -> tuple[subprocess.Popen[bytes], dict[int, str]]:
    """`shepherd dev` with one simulated machine, its output in log (a new file), once every child is started;
    the process and its children."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    with log.open("ab") as output:
        dev = subprocess.Popen(
            [sys.executable, "-m", "shepherd", "dev", "--machines", "1", "--state-dir", str(state)],
            env=clean,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while "Ctrl-C stops everything" not in log.read_text():
        assert dev.poll() is None, f"shepherd dev exited with {dev.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"shepherd dev did not start its stack:\n{log.read_text()}"
        time.sleep(0.2)
    children = living_children(dev.pid)
    for name in STACK:
        assert any(name in command for command in children.values()), (name, children)
    return dev, children


def wait_until_gone(pids: dict[int, str]) -> dict[int, str]:
    """The processes of pids still running after the time a test of `shepherd dev` waits for its ports."""
    deadline = time.monotonic() + DEV_PORTS_WAIT
    while (alive := {pid: command for pid, command in pids.items() if running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def ports_taken() -> list[int]:
    """The ports of the embedded stack that `shepherd dev` would find taken now."""
    taken = []
    for port in DEV_PORTS:
        try:
            check_port_free(port, "a port of the embedded stack")
        except DevError:
            taken.append(port)
    return taken


def test_a_stopped_or_killed_dev_leaves_no_process_of_its_stack(state_dir, tmp_path):
    stopped = tmp_path / "stopped.log"
    dev, children = start_dev(state_dir, stopped)
    dev.send_signal(signal.SIGINT)
    assert dev.wait(120) == 0, stopped.read_text()
    assert "[shepherd dev] stopping" in stopped.read_text()
    assert wait_until_gone(children) == {}
    assert ports_taken() == []
    # Nor its PostgreSQL, nor anything else that names its state dir.
    assert processes_mentioning(str(state_dir)) == []

    # As a test's time limit does to the command it waits for: the stack never hears from `shepherd dev` again.
    killed = tmp_path / "killed.log"
    dev, children = start_dev(state_dir, killed)
    dev.kill()
    assert dev.wait(10) == -signal.SIGKILL
    assert "[shepherd dev] stopping" not in killed.read_text()
    assert wait_until_gone(children) == {}
    assert ports_taken() == []
