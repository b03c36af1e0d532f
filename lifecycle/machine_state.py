"""What a machine's workflow keeps: its stage, its pacing policy, its status, and the input each run begins with.

MachineStatus is what the status query answers and what a run hands the next one through continue-as-new;
MachineInput reads the shape older Shepherds wrote (upgrade_wire), so their histories still replay.
lifecycle.contracts re-exports them.

No "from __future__ import annotations" here: a workflow's sandbox holds the modules its workflow imports
(lifecycle.contracts), not this one, so a field's annotation written as a string could not be read there when a
payload is decoded. Each field's type is the class itself, defined above its first use.
"""

import dataclasses
import enum
from dataclasses import dataclass, field

from lifecycle.messages import RecoveryRequest


class MachineStage(enum.StrEnum):
    """Where a machine is in its lifecycle: MachineWorkflow's stage, and its MachineStage search attribute."""

    PROVISIONING = "PROVISIONING"
    AGENT_STARTING = "AGENT_STARTING"
    WATCHING = "WATCHING"
    RECOVERING = "RECOVERING"
    # Its recovery budget spent, or an operator asked: a fresh OS through its provider, then taken over again.
    REIMAGING = "REIMAGING"
    # Recovered more often than its budget allows: left alone until an operator releases it.
    QUARANTINED = "QUARANTINED"
    # Taken out of automation by an operator (hardware work): never rebooted or taken over until it ends.
    MAINTENANCE = "MAINTENANCE"
    # Retired for good by an operator: its agent stopped, the machine released or powered off through its provider.
    DECOMMISSIONING = "DECOMMISSIONING"
    # The stage of a machine's closed workflow once its decommission is done.
    DECOMMISSIONED = "DECOMMISSIONED"


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait between failed attempts of one lifecycle step."""

    initial: float
    maximum: float
    multiplier: float

    def delay(self, failed_attempts: int) -> float:
        """Seconds to wait after this many failed attempts before the next one."""
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
    # The signal or update: force_recover, recover, retry_now, retry, release, set_maintenance, decommission,
    # restart_agent.
    action: str
    by: str
    reason: str


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery of a machine, in its workflow's memory for the recovery budget: when, why, and whether it
    reimaged the machine rather than rebooting it."""

    at: str
    reason: str
    reimaged: bool = False


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


@dataclass
class AgentFacts:
    """What start_agent returns to MachineWorkflow about the agent it started: when, its key, its warnings."""

    started_at: str
    key_fingerprint: str
    warnings: list[str] = field(default_factory=list)


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

    def handed_on(self, stage: MachineStage, *, failing_step: bool = False) -> "MachineStatus":
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
    # The run's search attributes already hold what it would upsert at its start, when they show its stage: a
    # first run's are set as it is started, a continue-as-new carries the last ones of the run before. It then
    # upserts nothing until its stage changes. False in inputs of Shepherds before, whose runs upserted at their
    # start whatever they held, and replay so.
    search_attributes_carried: bool = False

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
