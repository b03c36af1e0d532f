"""Starting a machine's workflow from an activity, idempotently."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from foundation.settings import Settings
from lifecycle.contracts import MACHINE_WORKFLOW_TYPE, initial_search_attributes, machine_workflow_id
from lifecycle.inputs import machine_input


async def start_machine_workflow(
    client: Client,
    settings: Settings,
    provider: str,
    provider_id: str,
    machine_id: str,
    *,
    eager: bool = False,
    workflow_type: str = MACHINE_WORKFLOW_TYPE,
) -> bool:
    """Start the machine's workflow unless it runs already; True if this call started it.

    eager: ask the server to hand the workflow's first task back in the start response, to a worker of this
    client on settings.task_queue with a free slot. workflow_type: MachineWorkflow, unless a benchmark measures
    another in its place.
    """
    try:
        await client.start_workflow(
            workflow_type,
            machine_input(settings, provider, provider_id, machine_id),
            id=machine_workflow_id(provider, provider_id),
            task_queue=settings.task_queue,
            # A machine whose workflow was terminated (by an operator, say) or failed still needs one: start it
            # afresh. Only a decommission completes a machine's workflow, and that one must stay closed, even
            # when this start raced the decommission past the BMDB check.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
            search_attributes=initial_search_attributes(provider, provider_id, machine_id),
            static_summary=f"{provider_id} at provider {provider}",
            static_details=f"BMDB machine {machine_id}; the status query and current details tell how it is doing",
            request_eager_start=eager,
        )
    except WorkflowAlreadyStartedError:
        return False
    return True
