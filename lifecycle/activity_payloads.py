"""Inputs and results of the activities a machine's workflow runs, one pair a lifecycle step.

lifecycle.contracts re-exports them.

No "from __future__ import annotations" here: a workflow's sandbox holds the modules its workflow imports
(lifecycle.contracts), not this one, so a field's annotation written as a string could not be read there when a
payload is decoded. Each field's type is the class itself, defined above its first use.
"""

from dataclasses import dataclass

from lifecycle.messages import RecoveryKind


@dataclass(frozen=True)
class OperatorActionInput:
    """Input of record_operator_action: an event in the machine's log of what an operator asked for."""

    machine_id: str
    kind: str
    detail: str
    # When it was asked (the workflow's clock): the event's time, and what makes a retried record a repeat.
    at: str = ""


@dataclass(frozen=True)
class DecommissionInput:
    """Input of the decommission activities: which machine, and the operator's reason and name for the record."""

    provider: str
    provider_id: str
    machine_id: str
    reason: str
    by: str


@dataclass(frozen=True)
class RetireInput:
    """Input of record_retired: mark the machine retired in BMDB, with what was done and why."""

    machine_id: str
    detail: str


@dataclass(frozen=True)
class RetireResult:
    """What retire_through_provider returns: the provider's action (a RetireAction's value) and its words."""

    action: str
    detail: str


@dataclass(frozen=True)
class MaintenanceInput:
    """Input of record_maintenance: mark the machine in or out of maintenance in BMDB, with who and why."""

    machine_id: str
    on: bool
    detail: str


@dataclass(frozen=True)
class AgentCheckInput:
    """Input of check_agent_after_maintenance: is the machine's agent still heartbeating, or must it be replaced."""

    machine_id: str
    why: str


@dataclass(frozen=True)
class SilenceCheckInput:
    """Input of confirm_silence: the machine whose agent heartbeat_lost said is silent, and which agent it watches."""

    machine_id: str
    provider: str
    # The key fingerprint of the agent the workflow watches; None when it has none on record.
    agent_key_fingerprint: str | None


@dataclass(frozen=True)
class SilenceCheck:
    """What confirm_silence found: whether BMDB still finds the agent silent with no hold on its provider, and why."""

    confirmed: bool
    detail: str


@dataclass(frozen=True)
class StuckInput:
    """Input of the record_stuck activity: flag the machine stuck in BMDB, or clear the flag, with why."""

    machine_id: str
    stuck: bool
    detail: str


@dataclass(frozen=True)
class QuarantineInput:
    """Input of the record_quarantine activity: mark the machine quarantined in BMDB, or released, with why."""

    machine_id: str
    quarantined: bool
    detail: str


@dataclass(frozen=True)
class ProvisionInput:
    """Input of the provision_machine activity, from MachineWorkflow's PROVISIONING step."""

    provider: str
    provider_id: str
    machine_id: str
    # Stable for the machine's whole life, so a retried create finds the first one.
    idempotency_key: str


@dataclass(frozen=True)
class ProvisionResult:
    """What provision_machine returns to MachineWorkflow: where SSH reaches the created machine."""

    address: str | None
    ssh_port: int
    location: str | None


@dataclass(frozen=True)
class StartAgentInput:
    """Input of the start_agent activity, from MachineWorkflow's AGENT_STARTING step."""

    provider: str
    provider_id: str
    machine_id: str
    # The key fingerprint of a running agent this takeover replaces (restart_agent): BMDB's record of that agent
    # is not an earlier attempt's whose reply was lost. None: any agent recorded is.
    replaces: str | None = None


@dataclass(frozen=True)
class RebootInput:
    """Input of the reboot activities, from MachineWorkflow's RECOVERING step; cause is the recovery's reason."""

    provider: str
    provider_id: str
    machine_id: str
    cause: str
    # The recovery cycle (the workflow run) the reboot belongs to: a cycle reboots once.
    cycle: str = ""
    # None from workflows older than this field.
    kind: RecoveryKind | None = None
    # The cycle reimages the machine instead of rebooting it.
    reimage: bool = False


@dataclass(frozen=True)
class RebootResult:
    """What reboot_through_provider returns: whether the provider saw the machine go down, and what it did."""

    went_down: bool
    detail: str


@dataclass(frozen=True)
class ReimageResult:
    """What reimage_through_provider returns: whether the provider reimaged the machine, and what it said; a
    provider without the capability reimages nothing, and the recovery goes on without it."""

    reimaged: bool
    detail: str


@dataclass(frozen=True)
class BootWaitInput:
    """Input of the wait_for_boot activity, from MachineWorkflow after a recovery reboot."""

    provider: str
    provider_id: str
    machine_id: str
    # The provider saw the machine down: SSH answering is the new boot. Else SSH must go away first.
    went_down: bool
    # Seconds from the first attempt; None: the worker's boot_deadline setting.
    deadline: float | None


@dataclass(frozen=True)
class BootWaitResult:
    """What wait_for_boot returns: whether SSH answered again within the deadline, after how long, and what it saw."""

    came_back: bool
    waited: float
    detail: str
