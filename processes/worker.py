"""The Shepherd worker: runs every workflow and activity on one task queue.

Start more of them on the same task queue to spread the load; Temporal hands
each workflow and activity task to one of them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from datetime import UTC, datetime, timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
)
from temporalio.worker import Worker

from activities.deps import ActivityDeps, open_activity_deps
from activities.fleet import FleetActivities
from activities.provisioning import ProvisioningActivities
from activities.recovery import RecoveryActivities
from activities.takeover import TakeoverActivities
from foundation.logs import LogContextInterceptor
from foundation.metrics import MetricsUnavailable, WorkerMetrics, meter_of, metrics_runtime
from foundation.settings import Settings
from foundation.startup import StartupError, check_search_attributes, connect_temporal
from lifecycle.contracts import (
    FLEET_SCHEDULE_ID,
    FLEET_WORKFLOW_ID,
    MACHINE_STAGE,
    RUNNING_MACHINES,
    SEARCH_ATTRIBUTES,
    MachineStage,
)
from lifecycle.inputs import fleet_input
from workflows.fleet import FleetWorkflow
from workflows.machine import MachineWorkflow

log = logging.getLogger("shepherd.worker")


def build_worker(client: Client, deps: ActivityDeps) -> Worker:
    """A worker of both workflows and every activity on settings.task_queue; it runs inside `async with`."""
    settings = deps.settings
    fleet = FleetActivities(deps)
    provisioning = ProvisioningActivities(deps)
    takeover = TakeoverActivities(deps)
    recovery = RecoveryActivities(deps)
    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=[FleetWorkflow, MachineWorkflow],
        interceptors=[LogContextInterceptor()],
        activities=[
            fleet.plan_reconcile_pass,
            fleet.admit_machine,
            fleet.ensure_machine_workflows,
            fleet.signal_silent_machines,
            recovery.reboot_machine,
            provisioning.provision_machine,
            takeover.start_agent,
        ],
        max_concurrent_activities=settings.max_concurrent_activities,
        max_concurrent_workflow_tasks=settings.max_concurrent_workflow_tasks,
        max_activities_per_second=settings.max_activities_per_second or None,
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace),
    )


async def ensure_fleet_schedule(client: Client, settings: Settings, *, trigger: bool = False) -> None:
    """Create the fleet schedule, or bring an existing one in line with settings."""
    schedule = Schedule(
        action=ScheduleActionStartWorkflow(
            FleetWorkflow.run,
            fleet_input(settings),
            id=FLEET_WORKFLOW_ID,
            task_queue=settings.task_queue,
            execution_timeout=timedelta(hours=1),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=settings.reconcile_interval))]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )
    try:
        await client.create_schedule(FLEET_SCHEDULE_ID, schedule, trigger_immediately=trigger)
        log.info("created schedule %s (every %ss)", FLEET_SCHEDULE_ID, settings.reconcile_interval)
        return
    except ScheduleAlreadyRunningError:
        pass

    def keep_state(update: ScheduleUpdateInput) -> ScheduleUpdate:
        # Keep an operator's pause; change only what settings decide.
        schedule.state = update.description.schedule.state
        return ScheduleUpdate(schedule=schedule)

    handle = client.get_schedule_handle(FLEET_SCHEDULE_ID)
    await handle.update(keep_state)
    if trigger:
        await handle.trigger(overlap=ScheduleOverlapPolicy.SKIP)


async def observe_fleet(client: Client, deps: ActivityDeps, stop: asyncio.Event) -> None:
    """Keep this worker's fleet gauges current: machines per stage, heartbeat age, silent machines.

    Every worker reports the same numbers; dashboards take the max over workers.
    """
    settings = deps.settings
    interval = min(settings.reconcile_interval, 30.0)
    while not stop.is_set():
        try:
            for stage in MachineStage:
                counted = await client.count_workflows(f'{RUNNING_MACHINES} AND {MACHINE_STAGE.name} = "{stage.value}"')
                deps.metrics.machines.set(counted.count, {"stage": stage.value})
            deps.metrics.heartbeat_age_max.set(await deps.bmdb.oldest_heartbeat_age() or 0.0)
            silent = await deps.bmdb.silent_machines(
                settings.provider,
                as_of=datetime.now(UTC),
                first_heartbeat_within=settings.first_heartbeat_timeout,
                heartbeat_within=settings.heartbeat_timeout,
            )
            deps.metrics.machines_silent.set(len(silent))
        except Exception as error:  # a gauge a little stale beats a worker that stops
            log.warning("fleet gauges not updated: %s", error)
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except TimeoutError:
            pass


async def run_worker(settings: Settings, database_url: str, *, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or stop is set), then hand back what is held and exit."""
    try:
        runtime = metrics_runtime(settings.metrics_listen, "worker")
    except MetricsUnavailable as error:
        raise StartupError(str(error)) from None
    client = await connect_temporal(settings, runtime)
    await check_search_attributes(client, settings.temporal_namespace, SEARCH_ATTRIBUTES)
    deps = await open_activity_deps(settings, client, database_url)
    deps.metrics = WorkerMetrics.on(meter_of(runtime))
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await ensure_fleet_schedule(client, settings)
        worker = build_worker(client, deps)
        log.info("worker polling task queue %s at %s", settings.task_queue, settings.temporal_address)
        if runtime is not None:
            log.info("serving /metrics on %s", settings.metrics_listen)
        async with worker, asyncio.TaskGroup() as observers:
            if runtime is not None:
                observers.create_task(observe_fleet(client, deps, stop))
            await stop.wait()
            log.info("stopping: letting running activities finish for up to %ss", settings.shutdown_grace)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await deps.close()
