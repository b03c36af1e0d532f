"""The simulator's configuration and its persisted fleet state."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from foundation.files import replace_file


@dataclass
class Faults:
    """Knobs that make the simulated provider misbehave, for tests and demos."""

    api_latency: float = 0.0
    api_error_rate: float = 0.0
    api_malformed_rate: float = 0.0
    # Machine ids whose SSH server refuses connections; "*" for all.
    ssh_refuse: list[str] = field(default_factory=list)
    exec_delay: float = 0.0
    # Seconds a reboot's answer comes after the power cycle, as from a BMC that answers late or not at all: the
    # moment a worker may die with the reboot done and its answer not yet in.
    reboot_answer_delay: float = 0.0

    def check(self) -> Faults:
        """The faults themselves, once every knob is in range; ValueError naming the first that is not."""
        for name in ("api_latency", "api_error_rate", "api_malformed_rate", "exec_delay", "reboot_answer_delay"):
            # nan passes every comparison below, and a nan or infinite delay holds every call for ever.
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("api_error_rate", "api_malformed_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        for name in ("api_latency", "exec_delay", "reboot_answer_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if not isinstance(self.ssh_refuse, list) or not all(isinstance(m, str) for m in self.ssh_refuse):
            raise ValueError("ssh_refuse must be a list of machine ids")
        return self

    def refuses(self, machine_id: str) -> bool:
        """Whether the machine's SSH server refuses connections."""
        return "*" in self.ssh_refuse or machine_id in self.ssh_refuse

    def updated(self, changes: dict[str, Any]) -> Faults:
        """These faults with the knobs of changes set, checked; ValueError for an unknown knob or a bad value."""
        unknown = set(changes) - set(asdict(self))
        if unknown:
            raise ValueError(f"unknown fault knob(s): {', '.join(sorted(unknown))}")
        values = {**asdict(self), **changes}
        try:
            values = {k: (float(v) if k != "ssh_refuse" else v) for k, v in values.items()}
        except (TypeError, ValueError) as error:
            raise ValueError(f"fault knobs must be numbers: {error}") from None
        return Faults(**values).check()


@dataclass
class SimulatorConfig:
    """How the simulator runs: slot count, state dir, where it listens, reboot time and faults."""

    machines: int
    state_dir: Path
    api_host: str = "127.0.0.1"
    api_port: int = 8800
    ssh_host: str = "127.0.0.1"
    boot_seconds: float = 2.0
    faults: Faults = field(default_factory=Faults)

    def check(self) -> SimulatorConfig:
        """The configuration itself, once every value is in range; ValueError naming the first that is not."""
        if self.machines < 1:
            raise ValueError(f"machines must be at least 1, got {self.machines}")
        if not 0 <= self.api_port < 65536:
            raise ValueError(f"api_port must be a port number, got {self.api_port}")
        if self.boot_seconds < 0:
            raise ValueError(f"boot_seconds must not be negative, got {self.boot_seconds}")
        self.faults.check()
        return self

    def slot_ids(self) -> list[str]:
        """The ids of the capacity slots: node-0001 and on, zero-padded to at least four digits."""
        width = max(4, len(str(self.machines)))
        return [f"node-{n:0{width}d}" for n in range(1, self.machines + 1)]


@dataclass
class MachineRecord:
    """A created machine, as the simulator remembers it across restarts."""

    machine_id: str
    idempotency_key: str
    ssh_public_key: str
    host_key: str  # OpenSSH private key of the machine's SSH server
    ssh_port: int = 0


class StateUnreadable(OSError):
    """The saved simulator state cannot be read back: the message names the file and the problem."""


@dataclass
class FleetState:
    """The simulator's created machines and how many times each slot was created and reimaged; kept as JSON across
    restarts."""

    machines: dict[str, MachineRecord] = field(default_factory=dict)
    # How many times each slot was actually created: more than 1 is a duplicate.
    creations: dict[str, int] = field(default_factory=dict)
    # How many reimages each slot's machines had: a repeat of one under way counts none.
    reimages: dict[str, int] = field(default_factory=dict)

    def create(self, record: MachineRecord) -> dict[str, Any]:
        """Add a created machine; the change, for the journal."""
        change = {"created": asdict(record), "creations": self.creations.get(record.machine_id, 0) + 1}
        self.apply(change)
        return change

    def reimage(self, record: MachineRecord) -> dict[str, Any]:
        """Replace a machine's record with the one of its reimage (its new host key and key); the change, for the
        journal."""
        change = {"reimaged": asdict(record), "reimages": self.reimages.get(record.machine_id, 0) + 1}
        self.apply(change)
        return change

    def release(self, machine_id: str) -> dict[str, Any]:
        """Forget a released machine, its creations counted still; the change, for the journal."""
        change = {"released": machine_id}
        self.apply(change)
        return change

    def apply(self, change: dict[str, Any]) -> None:
        """Make one change of the journal. Each sets what it names outright, so applying again what a snapshot
        already holds changes nothing."""
        if "created" in change:
            record = MachineRecord(**change["created"])
            self.machines[record.machine_id] = record
            self.creations[record.machine_id] = int(change["creations"])
        elif "reimaged" in change:
            # The whole record, set outright as a creation's is: applied again over a snapshot where the machine was
            # released since, it is back only until the journal's own release of it, which follows.
            record = MachineRecord(**change["reimaged"])
            self.machines[record.machine_id] = record
            self.reimages[record.machine_id] = int(change["reimages"])
        elif "released" in change:
            self.machines.pop(str(change["released"]), None)
        else:
            raise ValueError(f"unknown change {sorted(change)}")

    def by_idempotency_key(self, key: str) -> MachineRecord | None:
        """The machine created with that idempotency key, or None."""
        return next((m for m in self.machines.values() if m.idempotency_key == key), None)


# Below this, the journal is left to grow: rewriting a small fleet's snapshot at every change gains nothing.
_JOURNAL_FLOOR = 64 * 1024


class StateFiles:
    """The simulator's state on disk: a snapshot, and a journal of the changes made since.

    A change is one JSON line appended to the journal and flushed to disk before the API answers, so a machine
    answered as created outlives the process, even killed, and costs the size of its own record. The snapshot is
    rewritten, and the journal emptied, when the journal has outgrown it, and at start: the bytes written stay in
    proportion to the changes made, not to the fleet times the changes.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.journal_path = path.with_name(f"{path.stem}.journal")
        self._snapshot_bytes = 0
        self._journal_bytes = 0
        # After a failed append the journal may miss a change the state holds, or end in part of one: only a
        # snapshot can catch up.
        self._snapshot_due = False

    def load(self) -> FleetState:
        """The saved state with the journal's changes made, or an empty one; StateUnreadable naming what is wrong."""
        state = FleetState()
        if self.path.exists():
            try:
                raw = json.loads(self.path.read_bytes())
                state = FleetState(
                    machines={str(k): MachineRecord(**v) for k, v in raw.get("machines", {}).items()},
                    creations={str(k): int(v) for k, v in raw.get("creations", {}).items()},
                    # A snapshot from before reimages were kept has none.
                    reimages={str(k): int(v) for k, v in raw.get("reimages", {}).items()},
                )
            except (ValueError, TypeError, AttributeError) as error:
                raise self._unreadable(self.path, error) from None
        if self.journal_path.exists():
            lines = self.journal_path.read_bytes().split(b"\n")
            # What follows the last newline is an append cut short by a crash, never answered: it did not happen.
            for number, line in enumerate(lines[:-1], 1):
                try:
                    change = json.loads(line)
                    state.apply(change)
                except (ValueError, TypeError, AttributeError, KeyError) as error:
                    raise self._unreadable(self.journal_path, f"line {number}: {error}") from None
        return state

    def save(self, state: FleetState) -> None:
        """Write the whole state as the snapshot, then empty the journal it holds."""
        # It holds the machines' private host keys: readable by the simulator's user alone.
        snapshot = json.dumps(asdict(state), indent=1, sort_keys=True).encode()
        replace_file(self.path, snapshot, 0o600)
        # A crash here leaves the journal to be applied again over a snapshot that holds it: no change.
        self.journal_path.unlink(missing_ok=True)
        self._snapshot_bytes, self._journal_bytes, self._snapshot_due = len(snapshot), 0, False

    def append(self, state: FleetState, change: dict[str, Any]) -> None:
        """Keep one change made to state: in the journal, or in a new snapshot once the journal outgrew the last."""
        if self._snapshot_due or self._journal_bytes >= max(self._snapshot_bytes, _JOURNAL_FLOOR):
            self.save(state)
            return
        line = json.dumps(change, sort_keys=True).encode() + b"\n"
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            unwritten = memoryview(line)
            while unwritten:
                unwritten = unwritten[os.write(fd, unwritten) :]
            os.fsync(fd)
        except OSError:
            self._snapshot_due = True
            raise
        finally:
            os.close(fd)
        self._journal_bytes += len(line)

    @staticmethod
    def _unreadable(path: Path, problem: object) -> StateUnreadable:
        return StateUnreadable(f"the simulator's state {path} is unreadable ({problem}); move it away to start afresh")
