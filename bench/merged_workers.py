"""The workers and workflow starts of bench.bringup's merged variant: as the product's, with bench.merged_bringup's
workflow and activity in place of MachineWorkflow and its two bring-up activities."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.worker import Worker

from activities.deps import ActivityDeps
from bench.merged_bringup import MergedBringUpActivities, MergedBringUpWorkflow
from foundation.logs import LogContextInterceptor
from foundation.settings import Settings
from lifecycle.contracts import initial_search_attributes, machine_workflow_id, provider_task_queue
from lifecycle.inputs import machine_input


@asynccontextmanager
async def merged_serving(client: Client, deps: ActivityDeps) -> AsyncIterator[None]:
    """Workers with processes.worker.build_workers' settings (slots, rate limits, workflow cache, interceptors)
    while the block runs. The workflow queue's worker runs no activity: a bring-up that succeeds needs none there."""
    settings = deps.settings
    merged = MergedBringUpActivities(deps)
    common: dict[str, Any] = {
        "interceptors": [LogContextInterceptor()],
        "max_concurrent_activities": settings.max_concurrent_activities,
        "max_activities_per_second": settings.max_activities_per_second or None,
        "graceful_shutdown_timeout": timedelta(seconds=settings.shutdown_grace),
    }
    workers = [
        Worker(
            client,
            task_queue=settings.task_queue,
            workflows=[MergedBringUpWorkflow],
            max_concurrent_workflow_tasks=settings.max_concurrent_workflow_tasks,
            max_cached_workflows=settings.max_cached_workflows,
            **common,
        ),
        *(
            Worker(
                client,
                task_queue=provider_task_queue(settings.task_queue, instance.name),
                activities=[merged.provision_and_start_agent],
                max_task_queue_activities_per_second=instance.activities_per_second or None,
                **common,
            )
            for instance in settings.provider_instances
        ),
    ]
    async with AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(worker)
        yield


async def start_merged_bringup(
    client: Client, settings: Settings, provider: str, provider_id: str, machine_id: str, *, eager: bool = False
) -> bool:
    """Start the machine's merged bring-up as activities.workflow_start starts its MachineWorkflow: the same id,
    input, search attributes and summary."""
    await client.start_workflow(
        MergedBringUpWorkflow.run,
        machine_input(settings, provider, provider_id, machine_id),
        id=machine_workflow_id(provider, provider_id),
        task_queue=settings.task_queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
        search_attributes=initial_search_attributes(provider, provider_id, machine_id),
        static_summary=f"{provider_id} at provider {provider}",
        static_details=f"BMDB machine {machine_id}; the status query and current details tell how it is doing",
        request_eager_start=eager,
    )
    return True
