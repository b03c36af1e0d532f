"""The workers and workflow starts of bench.bringup's merged variant: as the product's, with bench.merged_bringup's
workflow and activity in place of MachineWorkflow and its two bring-up activities."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

from temporalio.client import Client

from activities.deps import ActivityDeps
from activities.workflow_start import start_machine_workflow
from bench.merged_bringup import MERGED_BRINGUP_WORKFLOW_TYPE, MergedBringUpActivities, MergedBringUpWorkflow
from processes.worker import provider_queue_worker, workflow_queue_worker


@asynccontextmanager
async def merged_serving(client: Client, deps: ActivityDeps) -> AsyncIterator[None]:
    """Workers with processes.worker.build_workers' settings (slots, rate limits, workflow cache, interceptors)
    while the block runs. The workflow queue's worker runs no activity: a bring-up that succeeds needs none there."""
    settings = deps.settings
    merged = MergedBringUpActivities(deps)
    workers = [
        workflow_queue_worker(client, settings, [MergedBringUpWorkflow], []),
        *(
            provider_queue_worker(client, settings, instance, [merged.provision_and_start_agent])
            for instance in settings.provider_instances
        ),
    ]
    async with AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(worker)
        yield


# Started as activities.workflow_start starts a MachineWorkflow: the same id, input, search attributes and summary.
start_merged_bringup = partial(start_machine_workflow, workflow_type=MERGED_BRINGUP_WORKFLOW_TYPE)
