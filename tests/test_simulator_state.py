"""The simulator's state on disk: a machine it answered as created outlives the simulator's process, even killed,
and keeping it costs bytes in proportion to what changed, not to the whole fleet at every change."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig
from simulator.state import FleetState, MachineRecord, StateFiles, StateUnreadable
from tests.test_decommission import simulator_key

MACHINES = 100


def bytes_written(task: str) -> int:
    """What a process (/proc/PID) or this thread (/proc/thread-self) has written through write(2) and its kin so
    far: files and pipes, not a socket's send."""
    match = re.search(r"^wchar: (\d+)$", Path(f"/proc/{task}/io").read_text(), re.MULTILINE)
    assert match, f"/proc/{task}/io has no wchar"
    return int(match.group(1))


def record(number: int) -> MachineRecord:
    # About the size of a real one: an ed25519 host key in OpenSSH form is some 400 characters.
    return MachineRecord(f"node-{number:04d}", f"key-{number}", "ssh-ed25519 AAAA", "k" * 400, 20000 + number)


async def started_simulator(state_dir: Path) -> tuple[asyncio.subprocess.Process, str, asyncio.Task[bytes]]:
    """`python -m simulator` on a free port, its API URL, read from its log, and the task reading the rest of the
    log, so that the simulator never waits on a full pipe."""
    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "simulator", "--machines", str(MACHINES), "--state-dir", str(state_dir)],
        *["--api-port", "0"],
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    log = b""
    while line := await asyncio.wait_for(process.stderr.readline(), 30):
        log += line
        if found := re.search(rb"simulator API on (http://\S+)", line):
            return process, found.group(1).decode(), asyncio.create_task(process.stderr.read())
    raise AssertionError(f"the simulator did not start: {log.decode()}")


async def test_created_machines_outlive_a_killed_simulator_and_cost_writes_in_proportion(tmp_path):
    state_dir = tmp_path / "sim"
    slots = SimulatorConfig(machines=MACHINES, state_dir=state_dir).slot_ids()
    process, url, log = await started_simulator(state_dir)
    provider = SimProvider(url)
    try:
        before = bytes_written(str(process.pid))
        for number, slot in enumerate(slots):
            await provider.create_machine(slot, f"key-{number}", simulator_key())
        released = slots[-1]
        await provider.retire_machine(released)
        written = bytes_written(str(process.pid)) - before
    finally:
        await provider.close()
        process.send_signal(signal.SIGKILL)
        await process.wait()
        await log

    # Started again on the same state: every machine answered as created is there, once, and the released one not.
    simulator = Simulator(SimulatorConfig(machines=MACHINES, state_dir=state_dir, api_port=0))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    try:
        assert sorted(simulator.state.machines) == slots[:-1]
        assert simulator.state.creations == dict.fromkeys(slots, 1)
        again = await provider.create_machine(slots[0], "key-0", simulator_key())
        assert again.provider_id == slots[0] and simulator.state.creations[slots[0]] == 1
    finally:
        await provider.close()
        await simulator.stop()

    # The whole state, written once: the creations must have cost a few times that (the log lines included),
    # where a save of the whole state at each one costs about MACHINES / 2 times that.
    whole_state = (state_dir / "sim-state.json").stat().st_size
    assert written < 6 * whole_state, f"{written} bytes written for a state of {whole_state}"


def test_the_journal_is_folded_into_the_snapshot_as_it_grows_and_reads_back_whole(tmp_path):
    files = StateFiles(tmp_path / "sim-state.json")
    state = files.load()
    files.save(state)
    before = bytes_written("thread-self")
    for number in range(1, 1001):
        files.append(state, state.create(record(number)))
        if number % 10 == 0:
            files.append(state, state.release(f"node-{number:04d}"))
    written = bytes_written("thread-self") - before

    reread = StateFiles(tmp_path / "sim-state.json").load()
    assert reread == state and len(reread.machines) == 900 and reread.creations["node-0010"] == 1
    # Folded more than once on the way, and never more than the snapshot it would be folded into.
    whole_state = len(json.dumps(asdict(state), indent=1, sort_keys=True))
    assert files.journal_path.stat().st_size < whole_state
    assert written < 6 * whole_state, f"{written} bytes written for a state of {whole_state}"


def test_a_change_cut_short_by_a_crash_did_not_happen_and_a_broken_one_is_named(tmp_path):
    files = StateFiles(tmp_path / "sim-state.json")
    state = FleetState()
    files.append(state, state.create(record(1)))
    with files.journal_path.open("ab") as journal:
        journal.write(json.dumps(state.create(record(2))).encode()[:100])
    assert sorted(files.load().machines) == ["node-0001"]

    with files.journal_path.open("ab") as journal:
        journal.write(b"\n" + json.dumps(state.create(record(3))).encode() + b"\n")
    with pytest.raises(StateUnreadable) as caught:
        files.load()
    assert str(caught.value).startswith(f"the simulator's state {files.journal_path} is unreadable (line 2: ")
    assert str(caught.value).endswith("move it away to start afresh")


def test_a_journal_left_beside_the_snapshot_that_holds_it_changes_nothing(tmp_path):
    """A crash between writing the snapshot and removing the journal: the journal is applied again at start."""
    files = StateFiles(tmp_path / "sim-state.json")
    state = FleetState()
    for number in (1, 2, 3):
        files.append(state, state.create(record(number)))
    files.append(state, state.release("node-0002"))
    files.append(state, state.create(record(2)))
    files.append(state, state.release("node-0003"))
    journal = files.journal_path.read_bytes()
    files.save(state)
    files.journal_path.write_bytes(journal)
    assert files.load() == state and sorted(state.machines) == ["node-0001", "node-0002"]
    assert state.creations == {"node-0001": 1, "node-0002": 2, "node-0003": 1}


def test_a_reimage_is_kept_as_the_machines_whole_record_and_a_snapshot_from_before_reimages_reads_back(tmp_path):
    files = StateFiles(tmp_path / "sim-state.json")
    state = FleetState()
    for number in (1, 2):
        files.append(state, state.create(record(number)))
    reimaged = replace(record(1), ssh_public_key="ssh-ed25519 BBBB", host_key="n" * 400)
    files.append(state, state.reimage(reimaged))
    files.append(state, state.reimage(replace(record(2), host_key="m" * 400)))
    files.append(state, state.release("node-0002"))
    assert state.machines == {"node-0001": reimaged} and state.reimages == {"node-0001": 1, "node-0002": 1}
    assert files.load() == state

    # Applied again over a snapshot that holds it, the journal's reimage of the released machine stays undone.
    journal = files.journal_path.read_bytes()
    files.save(state)
    files.journal_path.write_bytes(journal)
    assert files.load() == state

    # A snapshot written before reimages were kept has none: none were done.
    snapshot = json.loads(files.path.read_bytes())
    del snapshot["reimages"]
    files.path.write_text(json.dumps(snapshot))
    files.journal_path.unlink()
    assert files.load() == replace(state, reimages={})
