"""Inputs, results and status of the workflows and their activities.

Everything here travels as a Temporal payload and shows in the UI: ids,
addresses and small facts only, never a key or an executable.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from temporalio.common import SearchAttributeKey, SearchAttributePair, SearchAttributeUpdate, TypedSearchAttributes

MACHINE_WORKFLOW_TYPE = "MachineWorkflow"
FLEET_WORKFLOW_TYPE = "FleetWorkflow"
# Before provider instances there was one fleet schedule; a worker removes it in favour of the per-instance ones.
LEGACY_FLEET_SCHEDULE_ID = "shepherd-fleet"


def provider_task_queue(task_queue: str, provider: str) -> str:
    """Where the activities that call one provider instance run: Temporal rate-limits a task queue across workers."""
    return f"{task_queue}-provider-{provider}"


def fleet_schedule_id(provider: str) -> str:
    """The fleet schedule of one provider instance; its passes run as workflows of the same id and a timestamp."""
    return f"shepherd-fleet-{provider}"


# Custom search attributes of every machine workflow, so the Temporal UI's list
# filters on them (MachineStage = "RECOVERING", ProviderId = "node-0007").
MACHINE_STAGE = SearchAttributeKey.for_keyword("MachineStage")
PROVIDER = SearchAttributeKey.for_keyword("Provider")
PROVIDER_ID = SearchAttributeKey.for_keyword("ProviderId")
MACHINE_ID = SearchAttributeKey.for_keyword("MachineId")
SEARCH_ATTRIBUTES = (MACHINE_STAGE, PROVIDER, PROVIDER_ID, MACHINE_ID)


class MachineStage(enum.StrEnum):
    """Where a machine is in its lifecycle: MachineWorkflow's stage, and its MachineStage search attribute."""

    PROVISIONING = "PROVISIONING"
    AGENT_STARTING = "AGENT_STARTING"
    WATCHING = "WATCHING"
    RECOVERING = "RECOVERING"
    # Recovered more often than its budget allows: left alone until an operator releases it.
    QUARANTINED = "QUARANTINED"
    # Taken out of automation by an operator (hardware work): never rebooted or taken over until it ends.
    MAINTENANCE = "MAINTENANCE"
    # Retired for good by an operator: its agent stopped, the machine released or powered off through its provider.
    DECOMMISSIONING = "DECOMMISSIONING"
    # The stage of a machine's closed workflow once its decommission is done.
    DECOMMISSIONED = "DECOMMISSIONED"


def machine_workflow_id(provider: str, provider_id: str) -> str:
    return f"machine-{provider}-{provider_id}"


def machine_search_attributes(
    provider: str, provider_id: str, machine_id: str, stage: MachineStage
) -> list[SearchAttributeUpdate]:
    return [
        MACHINE_STAGE.value_set(stage.value),
        PROVIDER.value_set(provider),
        PROVIDER_ID.value_set(provider_id),
        MACHINE_ID.value_set(machine_id),
    ]


def initial_search_attributes(provider: str, provider_id: str, machine_id: str) -> TypedSearchAttributes:
    """What a machine workflow starts with, so it can be found before its first task runs."""
    return TypedSearchAttributes(
        [
            SearchAttributePair(MACHINE_STAGE, MachineStage.PROVISIONING.value),
            SearchAttributePair(PROVIDER, provider),
            SearchAttributePair(PROVIDER_ID, provider_id),
            SearchAttributePair(MACHINE_ID, machine_id),
        ]
    )


# The visibility query of every machine workflow that runs: the worker's gauges and the commands list them.
RUNNING_MACHINES = f'WorkflowType = "{MACHINE_WORKFLOW_TYPE}" AND ExecutionStatus = "Running"'


def running_machines_of(provider: str) -> str:
    """The visibility query of the running machine workflows of one provider instance (a name is [a-z0-9-])."""
    return f'{RUNNING_MACHINES} AND {PROVIDER.name} = "{provider}"'


HEARTBEAT_LOST_SIGNAL = "heartbeat_lost"


@dataclass(frozen=True)
class HeartbeatLost:
    """What the fleet watchdog signals with heartbeat_lost: why, and which agent fell silent.

    A workflow whose agent has changed since the watchdog read BMDB (a recovery finished in between) ignores it.
    """

    cause: str = "no detail"
    # None from watchdogs older than this field, which sent the cause alone.
    agent_key_fingerprint: str | None = None

    @classmethod
    def from_wire(cls, value: object) -> HeartbeatLost:
        """From the signal's JSON: this dataclass, or the cause alone as older watchdogs sent it."""
        if isinstance(value, dict):
            agent = value.get("agent_key_fingerprint")
            return cls(_text(value.get("cause"), 1000) or "no detail", agent if isinstance(agent, str) else None)
        return cls(_text(value, 1000) or "no detail")


def _text(value: object, limit: int) -> str:
    """A text field of a message as sent, stripped and cut to limit characters; "" when it is no string."""
    return value.strip()[:limit] if isinstance(value, str) else ""


def _operator(value: object) -> str:
    """Who asked, as a message says; "unknown" when it does not."""
    return _text(value, 100) or "unknown"


class RecoveryKind(enum.StrEnum):
    """Who asked for a recovery, which decides whether the recovery budget counts it."""

    # The fleet watchdog found the agent silent.
    HEARTBEAT_LOST = "heartbeat_lost"
    # An operator's force_recover: never counted against the budget, and it releases a quarantined machine.
    FORCED = "forced"
    # An operator ended a maintenance asking for a reboot: as forced.
    MAINTENANCE_OVER = "maintenance_over"


@dataclass(frozen=True)
class RecoveryRequest:
    """A recovery asked for: force_recover's argument (``{"reason": "disk errors", "by": "alice"}``), and the
    recovery a machine's status keeps until it begins."""

    reason: str = "no reason given"
    by: str = "unknown"
    kind: RecoveryKind = RecoveryKind.FORCED

    @property
    def by_an_operator(self) -> bool:
        return self.kind is not RecoveryKind.HEARTBEAT_LOST

    def describe(self) -> str:
        """The recovery in one line, as the status, the event log and the reboot's cause say it."""
        if self.kind is RecoveryKind.HEARTBEAT_LOST:
            return f"heartbeat lost: {self.reason}"
        if self.kind is RecoveryKind.MAINTENANCE_OVER:
            return f"forced: maintenance over, reboot asked by {self.by}: {self.reason}"
        return f"forced: {self.reason}" + ("" if self.by == "unknown" else f" (by {self.by})")

    @classmethod
    def from_wire(cls, value: object) -> RecoveryRequest:
        """From any JSON: a malformed force_recover still means "recover", so nothing here refuses.

        A string is an operator's bare reason, or the line a status kept before recoveries had a kind.
        """
        if value is None:
            return cls()
        if isinstance(value, dict):
            kind = value.get("kind")
            return cls(
                reason=_text(value.get("reason"), 1000) or _unreadable(value),
                by=_operator(value.get("by")),
                kind=RecoveryKind(kind) if kind in tuple(RecoveryKind) else RecoveryKind.FORCED,
            )
        if isinstance(value, str):
            for kind, prefix in ((RecoveryKind.HEARTBEAT_LOST, "heartbeat lost: "), (RecoveryKind.FORCED, "forced: ")):
                if value.startswith(prefix):
                    return cls(reason=value[len(prefix) :], kind=kind)
            return cls(reason=_text(value, 1000) or "no reason given")
        return cls(reason=_unreadable(value))


def _unreadable(value: object) -> str:
    return f"unreadable reason {str(value)[:100]!r}"


@dataclass(frozen=True)
class OperatorRequest:
    """The argument of release, decommission, restart_agent and retry_now: ``{"reason": ..., "by": ...}``."""

    reason: str = ""
    by: str = "unknown"

    def require_reason(self, why: str) -> None:
        """ValueError, asking why, when the request gives no reason."""
        if not self.reason:
            raise ValueError(f'say why {why}: {{"reason": "...", "by": "..."}}')

    @classmethod
    def from_wire(cls, value: object) -> OperatorRequest:
        """From the JSON an operator sent: this dataclass, or the reason alone."""
        if isinstance(value, dict):
            return cls(_text(value.get("reason"), 500), _operator(value.get("by")))
        return cls(_text(value, 500))


@dataclass(frozen=True)
class MaintenanceRequest:
    """set_maintenance's argument: ``{"on": true, "reason": ..., "by": ...}`` begins a maintenance,
    ``{"on": false, "recover": false}`` ends it, with a reboot when recover is true."""

    # None when the request did not say, which check refuses.
    on: bool | None = None
    reason: str = ""
    by: str = "unknown"
    recover: bool | None = False

    def check(self) -> MaintenanceRequest:
        """The request as it is carried out (an end's reason filled in); ValueError naming what is wrong."""
        if self.on is None:
            raise ValueError('give {"on": true, "reason": "...", "by": "..."} or {"on": false, "recover": false}')
        if self.recover is None or (self.recover and self.on):
            raise ValueError('"recover" (a reboot once maintenance ends) goes with "on": false, as true or false')
        if not self.reason:
            if self.on:
                raise ValueError("say why the machine goes into maintenance: a reason")
            return dataclasses.replace(self, reason="maintenance done")
        return self

    @classmethod
    def from_wire(cls, value: object) -> MaintenanceRequest:
        if not isinstance(value, dict):
            return cls()
        on, recover = value.get("on"), value.get("recover", False)
        return cls(
            on=on if isinstance(on, bool) else None,
            reason=_text(value.get("reason"), 500),
            by=_operator(value.get("by")),
            recover=recover if isinstance(recover, bool) else None,
        )


FORCE_RECOVER_SIGNAL = "force_recover"
RELEASE_UPDATE = "release"
SET_MAINTENANCE_UPDATE = "set_maintenance"
DECOMMISSION_UPDATE = "decommission"
# A new agent on a healthy machine without a reboot: an agent upgrade, a CA rotation.
RESTART_AGENT_UPDATE = "restart_agent"
RETRY_NOW_SIGNAL = "retry_now"
STATUS_QUERY = "status"


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait between failed attempts of one lifecycle step."""

    initial: float
    maximum: float
    multiplier: float

    def delay(self, failed_attempts: int) -> float:
        return min(self.maximum, self.initial * self.multiplier ** max(0, failed_attempts - 1))


@dataclass(frozen=True)
class LifecyclePolicy:
    """How a machine's workflow paces its steps; made from settings by lifecycle.inputs."""

    # Space the attempts of each step.
    provision_backoff: Backoff
    agent_start_backoff: Backoff
    recovery_backoff: Backoff
    # Bound one activity attempt of each step.
    provision_timeout: float
    agent_start_timeout: float
    recovery_timeout: float
    # How long a rebooted machine may take to answer SSH; None in workflows started before the wait existed,
    # which take the worker's setting.
    boot_deadline: float | None = None
    # Recoveries within recovery_budget_window seconds before the watchdog's next one quarantines the machine;
    # None (workflows started before the budget existed): no budget.
    recovery_budget: int | None = None
    recovery_budget_window: float | None = None
    # Seconds in PROVISIONING or AGENT_STARTING after which the machine is flagged stuck; None: never.
    provisioning_deadline: float | None = None
    agent_start_deadline: float | None = None


@dataclass(frozen=True)
class OperatorAction:
    """One operator's request to a machine's workflow, as its status shows it: when, what, who and why."""

    at: str
    # The signal or update: force_recover, retry_now, release, set_maintenance, decommission, restart_agent.
    action: str
    by: str
    reason: str


@dataclass(frozen=True)
class OperatorActionInput:
    """Input of record_operator_action: an event in the machine's log of what an operator asked for."""

    machine_id: str
    kind: str
    detail: str
    # When it was asked (the workflow's clock): the event's time, and what makes a retried record a repeat.
    at: str = ""


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery of a machine, in its workflow's memory for the recovery budget: when, and why."""

    at: str
    reason: str


@dataclass
class Quarantine:
    """Why a machine is quarantined, since when, and the recoveries that spent its budget."""

    since: str
    reason: str
    recoveries: list[RecoveryRecord]


@dataclass
class Stuck:
    """A machine whose PROVISIONING or AGENT_STARTING outlasted its deadline: flagged, and still trying."""

    since: str
    reason: str
    last_error: str | None


@dataclass
class Maintenance:
    """A machine in maintenance: since when, why, who asked, and the stage it left and goes back to."""

    since: str
    reason: str
    by: str
    left: MachineStage


@dataclass
class Decommission:
    """A machine being decommissioned: since when, why, who asked, and what each step did so far."""

    since: str
    reason: str
    by: str
    # What stopping the agent over SSH found; None until tried.
    agent: str | None = None
    # What the provider did (RetireAction's value) and said; None until it answered.
    provider_action: str | None = None
    provider_detail: str | None = None


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
class Decommissioned:
    """The result of a decommissioned machine's workflow: what was done, when, by whom and why."""

    machine_id: str
    provider: str
    provider_id: str
    decommissioned_at: str
    reason: str
    by: str
    agent: str
    provider_action: str
    provider_detail: str


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


# --- MachineWorkflow -----------------------------------------------------------


@dataclass
class AgentFacts:
    """What start_agent returns to MachineWorkflow about the agent it started: when, its key, its warnings."""

    started_at: str
    key_fingerprint: str
    warnings: list[str] = field(default_factory=list)


@dataclass
class MachineInput:
    """Input of MachineWorkflow, from the fleet activities that start it or from its own continue-as-new."""

    provider: str
    provider_id: str
    machine_id: str
    policy: LifecyclePolicy
    # The status the run before handed on (MachineStatus.handed_on); None for a machine's first run.
    status: MachineStatus | None = None
    # Set when an operator's restart_agent continues the workflow as new: the key fingerprint of the agent that
    # still runs, which the takeover replaces rather than takes for an earlier attempt's.
    replace_agent: str | None = None
    # An operator's maintenance or decommission accepted while the run before was on its way out: the next run
    # begins it at its first safe point.
    maintenance: Maintenance | None = None
    decommission: Decommission | None = None

    @classmethod
    def upgrade_wire(cls, value: object) -> object:
        """An input of the shape Shepherds wrote before the status was handed on whole, in today's shape.

        Those carried the status's fields one by one beside the machine's (resume_stage, address, agent, the
        recovery counts and records, the operator actions, a failing step's progress, a pending recovery).
        """
        if not isinstance(value, dict) or "resume_stage" not in value:
            return value
        older = dict(value)
        carried = {name: older.pop(name, None) for name in _FIELDS_CARRIED_ONE_BY_ONE}
        stage = carried["resume_stage"]
        if stage is None:
            return older  # a first run
        step = carried["step"] if isinstance(carried["step"], dict) else {}
        older["status"] = {
            "machine_id": older.get("machine_id"),
            "provider": older.get("provider"),
            "provider_id": older.get("provider_id"),
            "stage": stage,
            "stage_since": step.get("stage_since", ""),
            "attempts": step.get("attempts", 0),
            "last_error": step.get("last_error"),
            "stuck": step.get("stuck"),
            "address": carried["address"],
            "agent": carried["agent"],
            "recovery_count": carried["recovery_count"] or 0,
            "last_recovery_reason": carried["last_recovery_reason"],
            "recent_recoveries": carried["recent_recoveries"] or [],
            "actions": carried["recent_actions"] or [],
            "recovery_requested": carried["recovery_requested"],
        }
        return older


# What MachineInput carried one by one before it carried the status whole.
_FIELDS_CARRIED_ONE_BY_ONE = (
    "resume_stage",
    "address",
    "agent",
    "recovery_count",
    "last_recovery_reason",
    "recent_recoveries",
    "recent_actions",
    "step",
    "recovery_requested",
)


@dataclass
class MachineStatus:
    """What MachineWorkflow's status query answers: one machine's stage, attempts, errors, agent and recoveries."""

    machine_id: str
    provider: str
    provider_id: str
    stage: MachineStage
    # Since when the machine is in its stage; "" in a status handed on to a run whose stage begins with the run.
    stage_since: str
    # Attempts of the current stage's step; 0 once it succeeded.
    attempts: int = 0
    last_error: str | None = None
    next_attempt_at: str | None = None
    address: str | None = None
    agent: AgentFacts | None = None
    recovery_count: int = 0
    last_recovery_reason: str | None = None
    # A recovery asked for and not yet begun (it waits for the agent to be started).
    recovery_requested: RecoveryRequest | None = None
    # Recovery requests that arrived while one was pending or running.
    recovery_requests_coalesced: int = 0
    # Since when the workflow waits for the rebooted machine to answer SSH.
    waiting_for_boot_since: str | None = None
    recent_recoveries: list[RecoveryRecord] = field(default_factory=list)
    quarantine: Quarantine | None = None
    stuck: Stuck | None = None
    maintenance: Maintenance | None = None
    decommission: Decommission | None = None
    # The last operator actions, oldest first, across the workflow's runs.
    actions: list[OperatorAction] = field(default_factory=list)

    def handed_on(self, stage: MachineStage, *, failing_step: bool = False) -> MachineStatus:
        """This status as the next run (continue-as-new) begins with it: the machine at stage, with what the status
        keeps across runs (its address and agent, its recoveries, the operators' actions).

        What belongs to this run alone stays behind: the next attempt's time, a boot wait, the coalesced requests,
        a quarantine, maintenance or decommission shown. failing_step: the stage's step goes on failing in the
        next run, which keeps its attempts, its last error, its stuck flag and a recovery asked meanwhile;
        otherwise the stage begins afresh with the next run.
        """
        handed = dataclasses.replace(
            self,
            stage=stage,
            next_attempt_at=None,
            waiting_for_boot_since=None,
            recovery_requests_coalesced=0,
            quarantine=None,
            maintenance=None,
            decommission=None,
            recent_recoveries=list(self.recent_recoveries),
            actions=list(self.actions),
        )
        if failing_step:
            return handed
        return dataclasses.replace(
            handed, stage_since="", attempts=0, last_error=None, stuck=None, recovery_requested=None
        )


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


@dataclass(frozen=True)
class RebootResult:
    """What reboot_through_provider returns: whether the provider saw the machine go down, and what it did."""

    went_down: bool
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


# --- FleetWorkflow -------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryHoldRule:
    """When a watchdog pass holds every recovery of a provider instead of signalling the silent machines."""

    # More silent machines than the larger of min_machines and fraction of the provider's watched machines.
    min_machines: int
    fraction: float
    # No heartbeat accepted from any machine for this long: the heartbeat path looks down.
    quiet_path_after: float
    # After a hold ends, the machines silent since before its end get this long to come back.
    grace_after_hold: float


@dataclass(frozen=True)
class FleetInput:
    """Input of FleetWorkflow, the same for every pass the fleet schedule starts; made by lifecycle.inputs."""

    provider: str
    max_machines: int
    chunk_size: int
    device_creation_interval: float
    # The seed's recovery rule: no heartbeat this long after the agent started,
    # or the last heartbeat older than heartbeat_within.
    first_heartbeat_within: float
    heartbeat_within: float
    # None in passes scheduled before the hold existed: the worker's settings decide.
    recovery_hold: RecoveryHoldRule | None = None


@dataclass(frozen=True)
class WatchdogInput:
    """Input of the signal_silent_machines activity, from FleetWorkflow: the silence rule and the pass's clock."""

    provider: str
    # The workflow's clock, so the rule is deterministic and testable with skipped time.
    as_of: str
    first_heartbeat_within: float
    heartbeat_within: float
    hold_rule: RecoveryHoldRule | None = None


@dataclass
class RecoveryHold:
    """A provider's recoveries held by the watchdog: since when, why, and whether an operator let them go ahead."""

    provider: str
    since: str
    reason: str
    silent_count: int
    threshold: int
    # A few of the silent machines; the event log has the same.
    sample: list[str]
    released_at: str | None = None
    released_by: str | None = None
    release_reason: str | None = None

    @property
    def released(self) -> bool:
        return self.released_at is not None


@dataclass
class WatchdogResult:
    """What watch_silent_machines returns to FleetWorkflow: whom it signalled, and the hold that kept it from it."""

    signalled: list[str]
    silent_count: int
    watched_count: int
    hold: RecoveryHold | None = None
    # Silent since before the last hold ended, and still within its grace: left alone this pass.
    spared: int = 0


@dataclass(frozen=True)
class ReconcilePassInput:
    """Input of the plan_reconcile_pass activity, from FleetWorkflow."""

    provider: str
    max_machines: int
    chunk_size: int


@dataclass
class ReconcilePassPlan:
    """What plan_reconcile_pass returns to FleetWorkflow: the counts, what to admit and the disagreements."""

    provider_count: int
    bmdb_count: int
    managed_count: int
    to_create: list[str]
    # At most a screenful, with the total in disagreement_count.
    disagreements: list[str]
    disagreement_count: int
    note: str

    @property
    def refused(self) -> bool:
        return self.disagreement_count > 0


@dataclass(frozen=True)
class AdmitInput:
    """Input of the admit_machine activity, from FleetWorkflow: one slot of free capacity to bring under management."""

    provider: str
    provider_id: str


@dataclass(frozen=True)
class EnsureWorkflowsInput:
    """Input of the ensure_machine_workflows activity, from FleetWorkflow."""

    provider: str


@dataclass
class EnsureWorkflowsResult:
    """What ensure_machine_workflows returns to FleetWorkflow: machines in BMDB, and whose workflow it started."""

    machines: int
    started: list[str]
    # Whether the pass listed the running workflows, or counted them only and found one for every machine.
    listed: bool = True


@dataclass
class FleetPassResult:
    """What a FleetWorkflow run returns, or carries as its failure's detail, and its status query answers."""

    started_at: str
    plan: ReconcilePassPlan | None = None
    admitted: list[str] = field(default_factory=list)
    workflows_started: int = 0
    # Machines whose workflows were told their agent went silent.
    silent: list[str] = field(default_factory=list)
    # Set while the watchdog holds this provider's recoveries (silent machines left alone), or an operator released it.
    recoveries_held: RecoveryHold | None = None
    # Machines silent since before a hold ended, left this pass to come back.
    spared_after_hold: int = 0
    error: str | None = None
