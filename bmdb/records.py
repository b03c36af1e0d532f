"""What BMDB answers and what it refuses with: the records of machines, agents, holds and events, and the errors."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from bmdb.schema import PROVIDED_STATUS_CREATING


class BMDBUnavailable(Exception):
    """BMDB could not be reached or refused the connection."""


class HostKeyPinned(Exception):
    """The machine has another SSH host key pinned than the one its SSH server showed; nothing was recorded."""

    def __init__(self, machine_id: uuid.UUID, pinned: str) -> None:
        super().__init__(f"machine {machine_id} has another host key pinned")
        self.pinned = pinned


class HostKeyUnexpected(Exception):
    """The SSH server showed a host key without the fingerprint an operator said to expect; nothing was pinned."""

    def __init__(self, machine_id: uuid.UUID, expected: str, seen: str) -> None:
        super().__init__(f"machine {machine_id} expects host key {expected}, the server showed {seen}")
        self.expected = expected
        self.seen = seen


@dataclass(frozen=True)
class Heartbeat:
    """One agent heartbeat to record: whose, signed by which agent key, sent when by the agent's clock."""

    machine_id: uuid.UUID
    agent_public_key: bytes
    sent_at: datetime


class HeartbeatsNotRecorded(Exception):
    """BMDB failed while writing heartbeats; none of the statement's heartbeats was recorded."""


@dataclass(frozen=True)
class ProvidedMachine:
    """A machine as BMDB knows it: who provides it and how far it got."""

    machine_id: uuid.UUID
    provider: str
    provider_id: str
    status: str
    # Marked when the provider stopped listing it (see record_provider_listing).
    missing: bool = False
    # Decommissioned: never adopted, started or watched again.
    retired: bool = False

    @property
    def being_created(self) -> bool:
        """Admitted, and not yet created by its provider."""
        return self.status == PROVIDED_STATUS_CREATING


@dataclass(frozen=True)
class MachineRecord:
    """One managed machine as BMDB has it: where it is, its pinned host key, its agent and its last heartbeat."""

    machine_id: uuid.UUID
    provider: str
    provider_id: str
    status: str
    address: str | None
    ssh_port: int | None
    location: str | None
    ssh_host_key: str | None
    agent_started_at: datetime | None
    agent_public_key: bytes | None
    agent_heartbeat_at: datetime | None
    # Since when the provider no longer lists it; None while it does.
    missing_since: datetime | None = None
    # Since when its provisioning or agent start has outlasted its deadline; None when not stuck.
    stuck_since: datetime | None = None
    # When it was decommissioned, and why; None while it is managed.
    retired_at: datetime | None = None
    retired_reason: str | None = None
    # The fingerprint the next host key pinned must have, as an operator who reset the pin said; None: any key.
    expected_host_key_fingerprint: str | None = None


@dataclass(frozen=True)
class SilentMachine:
    """A machine whose agent the watchdog rule finds silent; cause() says why, for the heartbeat_lost signal."""

    machine_id: uuid.UUID
    provider_id: str
    agent_started_at: datetime
    agent_heartbeat_at: datetime | None
    # The silent agent's ed25519 public key: the signal names the agent it is about.
    agent_public_key: bytes = b""
    # When the watchdog last signalled this agent's silence; None: not yet.
    signalled_at: datetime | None = None
    # When the machine's workflow confirmed this agent's silence, its recovery under way; None: not yet.
    confirmed_at: datetime | None = None

    @property
    def last_seen(self) -> datetime:
        """The agent's last sign of life: its last heartbeat, or its start."""
        return self.agent_heartbeat_at or self.agent_started_at

    def cause(self) -> str:
        """Why the agent counts as silent: no heartbeat since it started, or when its last heartbeat was."""
        if self.agent_heartbeat_at is None:
            return f"no heartbeat since the agent started at {self.agent_started_at.isoformat(timespec='seconds')}"
        return f"last heartbeat at {self.agent_heartbeat_at.isoformat(timespec='seconds')}"


@dataclass(frozen=True)
class WatchedMachines:
    """What the watchdog's circuit breaker weighs a pass's silent machines against."""

    # The provider's machines with an agent started, and still listed by the provider.
    count: int
    # The newest heartbeat accepted from any machine of any provider; None when there is none.
    last_heartbeat_at: datetime | None
    # Whether the provider's recoveries are held now; else when the last hold ended (None: there was none).
    hold_standing: bool = False
    hold_ended_at: datetime | None = None


@dataclass(frozen=True)
class WatchdogLook:
    """The watchdog's last look at a provider instance's machines: when it ended, and the process that made it."""

    provider: str
    looked_at: datetime
    looked_by: str


@dataclass(frozen=True)
class HeldRecoveries:
    """A provider whose recoveries the watchdog holds, as BMDB records it, with the operator's release if any."""

    provider: str
    held_since: datetime
    reason: str
    silent_count: int
    threshold: int
    sample: list[str]
    released_at: datetime | None
    released_by: str | None
    release_reason: str | None


@dataclass(frozen=True)
class Event:
    """One entry of BMDB's event log; machine_id is None for a fleet-wide event."""

    machine_id: uuid.UUID | None
    at: datetime
    kind: str
    detail: str
    # The machine's provider id, where a listing spans machines; None for a fleet-wide event.
    provider_id: str | None = None
    # Where a listing follows the log by its order (the operator API's event stream): the event's id in BMDB,
    # which only grows, and its machine's provider instance (None for a fleet-wide event).
    event_id: int | None = None
    provider: str | None = None


# The events that record what an operator asked for, each naming who; and the reboots and reimages, whose detail
# says who forced them or why the watchdog did: together they answer "who rebooted node-17 last night".
OPERATOR_ACTION_KINDS = (
    "recovery_forced",
    "reimage_forced",
    "retry_asked",
    "host_key_reset",
    "maintenance_on",
    "maintenance_off",
    "released",
    "decommissioning",
    "decommissioned",
    "agent_restart_asked",
    "recoveries_released",
    "fleet_paused",
    "fleet_resumed",
    "fleet_triggered",
    "rebooted",
    "reimaged",
    "approval_asked",
    "approval_approved",
    "approval_refused",
)
