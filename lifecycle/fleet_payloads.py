"""What FleetWorkflow takes, what its activities take and return, and what a pass returns.

lifecycle.contracts re-exports them.

No "from __future__ import annotations" here: a workflow's sandbox holds the modules its workflow imports
(lifecycle.contracts), not this one, so a field's annotation written as a string could not be read there when a
payload is decoded. Each field's type is the class itself, defined above its first use.
"""

from dataclasses import dataclass, field


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
        """Whether an operator let the held recoveries go ahead."""
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
    # What the provider holds and leaves alone, by why (Ironic: "in maintenance": 2); empty where it cannot tell.
    left_alone: dict[str, int] = field(default_factory=dict)

    @property
    def refused(self) -> bool:
        """Whether the pass creates nothing because provider and BMDB disagree on which machines are ours."""
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
