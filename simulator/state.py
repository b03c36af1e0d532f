"""The simulator's configuration and its persisted fleet state."""

from __future__ import annotations

import json
import math
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

    def check(self) -> Faults:
        for name in ("api_latency", "api_error_rate", "api_malformed_rate", "exec_delay"):
            # nan passes every comparison below, and a nan or infinite delay holds every call for ever.
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("api_error_rate", "api_malformed_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        for name in ("api_latency", "exec_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if not isinstance(self.ssh_refuse, list) or not all(isinstance(m, str) for m in self.ssh_refuse):
            raise ValueError("ssh_refuse must be a list of machine ids")
        return self

    def refuses(self, machine_id: str) -> bool:
        return "*" in self.ssh_refuse or machine_id in self.ssh_refuse

    def updated(self, changes: dict[str, Any]) -> Faults:
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
        if self.machines < 1:
            raise ValueError(f"machines must be at least 1, got {self.machines}")
        if not 0 <= self.api_port < 65536:
            raise ValueError(f"api_port must be a port number, got {self.api_port}")
        if self.boot_seconds < 0:
            raise ValueError(f"boot_seconds must not be negative, got {self.boot_seconds}")
        self.faults.check()
        return self

    def slot_ids(self) -> list[str]:
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
    """The simulator's created machines and how many times each slot was created; kept as JSON across restarts."""

    machines: dict[str, MachineRecord] = field(default_factory=dict)
    # How many times each slot was actually created: more than 1 is a duplicate.
    creations: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> FleetState:
        """The state saved at path, or an empty one if there is none; StateUnreadable naming what is wrong."""
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_bytes())
            return cls(
                machines={str(k): MachineRecord(**v) for k, v in raw.get("machines", {}).items()},
                creations={str(k): int(v) for k, v in raw.get("creations", {}).items()},
            )
        except (ValueError, TypeError, AttributeError) as error:
            problem = f"the simulator's state {path} is unreadable ({error}); move it away to start afresh"
            raise StateUnreadable(problem) from None

    def save(self, path: Path) -> None:
        # It holds the machines' private host keys: readable by the simulator's user alone.
        replace_file(path, json.dumps(asdict(self), indent=1, sort_keys=True).encode(), 0o600)

    def by_idempotency_key(self, key: str) -> MachineRecord | None:
        return next((m for m in self.machines.values() if m.idempotency_key == key), None)
