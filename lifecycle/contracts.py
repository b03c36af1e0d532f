"""The workflows' names, signals, updates and queries, their search attributes, and every payload they carry.

Everything here travels as a Temporal payload and shows in the UI: ids,
addresses and small facts only, never a key or an executable. This module is where callers import them from; the
payloads themselves live by idea in lifecycle.messages (what operators and the watchdog send a machine),
lifecycle.machine_state (a machine workflow's stage, policy, status and input), lifecycle.activity_payloads (its
activities' inputs and results) and lifecycle.fleet_payloads (FleetWorkflow's), and are re-exported here.
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey, SearchAttributePair, SearchAttributeUpdate, TypedSearchAttributes

from lifecycle.activity_payloads import (
    AgentCheckInput,
    BootWaitInput,
    BootWaitResult,
    DecommissionInput,
    MaintenanceInput,
    OperatorActionInput,
    ProvisionInput,
    ProvisionResult,
    QuarantineInput,
    RebootInput,
    RebootResult,
    ReimageResult,
    RetireInput,
    RetireResult,
    SilenceCheck,
    SilenceCheckInput,
    StartAgentInput,
    StuckInput,
)
from lifecycle.fleet_payloads import (
    AdmitInput,
    EnsureWorkflowsInput,
    EnsureWorkflowsResult,
    FleetInput,
    FleetPassResult,
    ReconcilePassInput,
    ReconcilePassPlan,
    RecoveryHold,
    RecoveryHoldRule,
    WatchdogInput,
    WatchdogResult,
)
from lifecycle.machine_state import (
    AgentFacts,
    Backoff,
    Decommission,
    Decommissioned,
    LifecyclePolicy,
    MachineInput,
    MachineStage,
    MachineStatus,
    Maintenance,
    OperatorAction,
    Quarantine,
    RecoveryRecord,
    Stuck,
)
from lifecycle.messages import (
    HeartbeatLost,
    MaintenanceRequest,
    OperatorRequest,
    RecoveryKind,
    RecoveryRequest,
    credited,
)
from lifecycle.operator_verification import check_proof

MACHINE_WORKFLOW_TYPE = "MachineWorkflow"
FLEET_WORKFLOW_TYPE = "FleetWorkflow"
# Before provider instances there was one fleet schedule; a worker removes it in favour of the per-instance ones.
LEGACY_FLEET_SCHEDULE_ID = "shepherd-fleet"


def provider_task_queue(task_queue: str, provider: str) -> str:
    """Where the activities that call one provider instance run: Temporal rate-limits a task queue across workers."""
    return f"{task_queue}-provider-{provider}"


def machine_task_queue(task_queue: str, provider: str) -> str:
    """Where the activities that reach one provider instance's machines over SSH run (the takeover, the boot wait):
    outside the provider's rate limit, which is for its API, so a rack's takeovers follow its reboots."""
    return f"{task_queue}-machines-{provider}"


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


def machine_workflow_id(provider: str, provider_id: str) -> str:
    """The id of one machine's workflow, the same for its whole life: at most one runs per machine."""
    return f"machine-{provider}-{provider_id}"


def machine_search_attributes(
    provider: str, provider_id: str, machine_id: str, stage: MachineStage
) -> list[SearchAttributeUpdate]:
    """The search attributes a machine workflow upserts as its stage changes, so the UI's list filters on them."""
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


# The signals, updates and query of a machine's workflow; lifecycle.messages has the arguments they take.
HEARTBEAT_LOST_SIGNAL = "heartbeat_lost"
FORCE_RECOVER_SIGNAL = "force_recover"
# force_recover as an update: its validator checks the operator API's proof, so the recovery is recorded verified.
RECOVER_UPDATE = "recover"
RELEASE_UPDATE = "release"
SET_MAINTENANCE_UPDATE = "set_maintenance"
DECOMMISSION_UPDATE = "decommission"
# A new agent on a healthy machine without a reboot: an agent upgrade, a CA rotation.
RESTART_AGENT_UPDATE = "restart_agent"
RETRY_NOW_SIGNAL = "retry_now"
# retry_now as an update: the proof checked, and the caller told when no step is failing.
RETRY_UPDATE = "retry"
STATUS_QUERY = "status"

__all__ = [
    "DECOMMISSION_UPDATE",
    "FLEET_WORKFLOW_TYPE",
    "FORCE_RECOVER_SIGNAL",
    "HEARTBEAT_LOST_SIGNAL",
    "LEGACY_FLEET_SCHEDULE_ID",
    "MACHINE_ID",
    "MACHINE_STAGE",
    "MACHINE_WORKFLOW_TYPE",
    "PROVIDER",
    "PROVIDER_ID",
    "RECOVER_UPDATE",
    "RELEASE_UPDATE",
    "RESTART_AGENT_UPDATE",
    "RETRY_NOW_SIGNAL",
    "RETRY_UPDATE",
    "RUNNING_MACHINES",
    "SEARCH_ATTRIBUTES",
    "SET_MAINTENANCE_UPDATE",
    "STATUS_QUERY",
    "AdmitInput",
    "AgentCheckInput",
    "AgentFacts",
    "Backoff",
    "BootWaitInput",
    "BootWaitResult",
    "Decommission",
    "DecommissionInput",
    "Decommissioned",
    "EnsureWorkflowsInput",
    "EnsureWorkflowsResult",
    "FleetInput",
    "FleetPassResult",
    "HeartbeatLost",
    "LifecyclePolicy",
    "MachineInput",
    "MachineStage",
    "MachineStatus",
    "Maintenance",
    "MaintenanceInput",
    "MaintenanceRequest",
    "OperatorAction",
    "OperatorActionInput",
    "OperatorRequest",
    "ProvisionInput",
    "ProvisionResult",
    "Quarantine",
    "QuarantineInput",
    "RebootInput",
    "RebootResult",
    "ReconcilePassInput",
    "ReconcilePassPlan",
    "RecoveryHold",
    "RecoveryHoldRule",
    "RecoveryKind",
    "RecoveryRecord",
    "RecoveryRequest",
    "ReimageResult",
    "RetireInput",
    "RetireResult",
    "SilenceCheck",
    "SilenceCheckInput",
    "StartAgentInput",
    "Stuck",
    "StuckInput",
    "WatchdogInput",
    "WatchdogResult",
    "check_proof",
    "credited",
    "fleet_schedule_id",
    "initial_search_attributes",
    "machine_search_attributes",
    "machine_task_queue",
    "machine_workflow_id",
    "provider_task_queue",
    "running_machines_of",
]
