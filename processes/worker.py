"""The Shepherd worker: runs the workflows and the BMDB activities on the task queue, each provider instance's
API calls on that instance's own rate-limited queue, and the SSH work on its machines on its machine queue.

Start more of them with the same settings to spread the load; Temporal hands
each workflow and activity task to one of them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from cryptography import x509
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
    ScheduleUpdate,
    ScheduleUpdateInput,
)
from temporalio.service import RPCError, RPCStatusCode, TLSConfig
from temporalio.worker import Worker

from activities.decommission import DecommissionActivities
from activities.deps import ActivityDeps, open_activity_deps
from activities.fleet import FleetActivities
from activities.provisioning import ProvisioningActivities
from activities.recovery import RecoveryActivities
from activities.takeover import TakeoverActivities
from foundation.bmdb_tls import log_bmdb_tls_warnings
from foundation.files import ReloadedFile
from foundation.logs import LogContextInterceptor
from foundation.metrics import (
    AGENT_ENDPOINT_CA,
    TEMPORAL_CLIENT_CERTIFICATE,
    CertificateExpiry,
    CertificateSource,
    MetricsUnavailable,
    WorkerMetrics,
    certificate_file,
    meter_of,
    metrics_runtime,
)
from foundation.operator_proof import install_trust
from foundation.periodic import repeat_every
from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from foundation.startup import StartupError, check_search_attributes, connect_temporal
from foundation.temporal_connection import TemporalConfigError, load_temporal_connection
from foundation.tls import parse_certificates
from lifecycle.contracts import (
    LEGACY_FLEET_SCHEDULE_ID,
    MACHINE_STAGE,
    RUNNING_MACHINES,
    SEARCH_ATTRIBUTES,
    MachineStage,
    fleet_schedule_id,
    machine_task_queue,
    provider_task_queue,
)
from lifecycle.inputs import fleet_input
from processes.watchdog import watch_fleet
from workflows.fleet import FleetWorkflow
from workflows.machine import MachineWorkflow

log = logging.getLogger("shepherd.worker")


def _worker_options(settings: Settings) -> dict[str, Any]:
    """What every worker of the process is given, whatever its task queue: its activity slots and rate, its
    interceptors, and how long it lets activities finish at shutdown."""
    return {
        "interceptors": [LogContextInterceptor()],
        "max_concurrent_activities": settings.max_concurrent_activities,
        "max_activities_per_second": settings.max_activities_per_second or None,
        "graceful_shutdown_timeout": timedelta(seconds=settings.shutdown_grace),
    }


def workflow_queue_worker(
    client: Client, settings: Settings, workflows: Sequence[type], activities: Sequence[Callable[..., Any]]
) -> Worker:
    """The worker of settings.task_queue: the workflows, and the activities that call BMDB and Temporal."""
    # The machine workflows' update validators read it, in the sandbox where they can read nothing else.
    install_trust(settings.task_queue, settings.operator_trust())
    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=workflows,
        activities=activities,
        max_concurrent_workflow_tasks=settings.max_concurrent_workflow_tasks,
        # Memory follows this, not the fleet: a WATCHING machine evicted from the cache costs nothing until a
        # signal comes, which replays its short history.
        max_cached_workflows=settings.max_cached_workflows,
        **_worker_options(settings),
    )


def provider_queue_worker(
    client: Client, settings: Settings, instance: ProviderInstance, activities: Sequence[Callable[..., Any]]
) -> Worker:
    """The worker of a provider instance's queue: the activities that call it, rate-limited by Temporal across all
    workers."""
    return Worker(
        client,
        task_queue=provider_task_queue(settings.task_queue, instance.name),
        activities=activities,
        max_task_queue_activities_per_second=instance.activities_per_second or None,
        **_worker_options(settings),
    )


def machine_queue_worker(
    client: Client, settings: Settings, instance: ProviderInstance, activities: Sequence[Callable[..., Any]]
) -> Worker:
    """The worker of a provider instance's machine queue: the SSH work on its machines, paced by the worker's
    activity slots and not by the provider's rate limit, so takeovers follow the reboots as machines come back."""
    return Worker(
        client,
        task_queue=machine_task_queue(settings.task_queue, instance.name),
        activities=activities,
        **_worker_options(settings),
    )


def build_workers(client: Client, deps: ActivityDeps) -> list[Worker]:
    """The workflows and the BMDB and Temporal activities on settings.task_queue, and for every provider instance
    the activities that call it on that instance's queue and the SSH work on its machines on its machine queue."""
    settings = deps.settings
    fleet = FleetActivities(deps)
    provisioning = ProvisioningActivities(deps)
    takeover = TakeoverActivities(deps)
    recovery = RecoveryActivities(deps)
    decommission = DecommissionActivities(deps)
    main_queue = workflow_queue_worker(
        client,
        settings,
        [FleetWorkflow, MachineWorkflow],
        [
            fleet.admit_machine,
            fleet.ensure_machine_workflows,
            fleet.watch_silent_machines,
            fleet.signal_silent_machines,
            recovery.record_reboot,
            recovery.record_quarantine,
            recovery.record_stuck,
            recovery.record_maintenance,
            recovery.check_agent_after_maintenance,
            recovery.confirm_silence,
            recovery.record_operator_action,
            decommission.forget_decommissioned_agent,
            decommission.record_retired,
        ],
    )
    on_the_machines: list[Callable[..., Any]] = [takeover.start_agent, recovery.wait_for_boot, takeover.stop_agent]
    provider_queues = [
        provider_queue_worker(
            client,
            settings,
            instance,
            [
                fleet.plan_reconcile_pass,
                provisioning.provision_machine,
                recovery.reboot_through_provider,
                recovery.reimage_through_provider,
                recovery.reboot_machine,
                decommission.retire_through_provider,
                # Scheduled here by workflows from before the machine queues, still served.
                *on_the_machines,
            ],
        )
        for instance in settings.provider_instances
    ]
    machine_queues = [
        machine_queue_worker(client, settings, instance, on_the_machines) for instance in settings.provider_instances
    ]
    return [main_queue, *provider_queues, *machine_queues]


@asynccontextmanager
async def serving(client: Client, deps: ActivityDeps) -> AsyncIterator[list[Worker]]:
    """Run every worker of build_workers while the block runs; leaving it lets running activities finish."""
    async with AsyncExitStack() as stack:
        workers = build_workers(client, deps)
        for worker in workers:
            await stack.enter_async_context(worker)
        yield workers


async def ensure_fleet_schedules(
    client: Client, settings: Settings, *, trigger: bool = False, first_pass_now: bool = False
) -> None:
    """Give every provider instance its fleet schedule, in line with settings: one provider's outage or refused
    pass never holds up another's. trigger starts a pass of each at once; first_pass_now, of each schedule created
    now, unless it is created paused (a new installation brings its capacity under management at once, not a
    reconcile interval later)."""
    legacy = client.get_schedule_handle(LEGACY_FLEET_SCHEDULE_ID)
    try:
        # An operator's pause of the one schedule of old holds for the schedules that replace it.
        legacy_state: ScheduleState | None = (await legacy.describe()).schedule.state
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        legacy_state = None
    for instance in settings.provider_instances:
        await _ensure_fleet_schedule(
            client, settings, instance.name, trigger=trigger, first_pass_now=first_pass_now, initial_state=legacy_state
        )
    if legacy_state is not None:
        await legacy.delete()
        log.info("deleted the schedule %s: each provider instance has its own now", LEGACY_FLEET_SCHEDULE_ID)


async def _ensure_fleet_schedule(
    client: Client,
    settings: Settings,
    provider: str,
    *,
    trigger: bool,
    first_pass_now: bool,
    initial_state: ScheduleState | None,
) -> None:
    schedule_id = fleet_schedule_id(provider)
    schedule = Schedule(
        action=ScheduleActionStartWorkflow(
            FleetWorkflow.run,
            fleet_input(settings, provider),
            id=schedule_id,
            task_queue=settings.task_queue,
            execution_timeout=timedelta(hours=1),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=settings.reconcile_interval))]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )
    if initial_state is not None:
        schedule.state = initial_state
    try:
        # A trigger starts a pass even of a paused schedule.
        first_pass = trigger or (first_pass_now and not (initial_state is not None and initial_state.paused))
        await client.create_schedule(schedule_id, schedule, trigger_immediately=first_pass)
        log.info(
            "created schedule %s (every %ss)%s",
            schedule_id,
            settings.reconcile_interval,
            ", its first pass started" if first_pass else "",
        )
        return
    except ScheduleAlreadyRunningError:
        pass

    def keep_state(update: ScheduleUpdateInput) -> ScheduleUpdate:
        # Keep an operator's pause; change only what settings decide.
        schedule.state = update.description.schedule.state
        return ScheduleUpdate(schedule=schedule)

    handle = client.get_schedule_handle(schedule_id)
    await handle.update(keep_state)
    if trigger:
        await handle.trigger(overlap=ScheduleOverlapPolicy.SKIP)


async def observe_fleet(client: Client, deps: ActivityDeps, stop: asyncio.Event) -> None:
    """Keep this worker's fleet gauges current: machines per stage, heartbeat age, silent, held and stuck machines.

    Every worker reports the same numbers; dashboards take the max over workers.
    """
    settings = deps.settings

    async def refresh() -> None:
        for stage in MachineStage:
            counted = await client.count_workflows(f'{RUNNING_MACHINES} AND {MACHINE_STAGE.name} = "{stage.value}"')
            deps.metrics.machines.set(counted.count, {"stage": stage.value})
        deps.metrics.heartbeat_age_max.set(await deps.bmdb.oldest_heartbeat_age() or 0.0)
        stuck = await deps.bmdb.count_stuck()
        held = {hold.provider: hold for hold in await deps.bmdb.held_recoveries()}
        for instance in settings.provider_instances:
            silent = await deps.bmdb.silent_machines(
                instance.name,
                as_of=datetime.now(UTC),
                first_heartbeat_within=settings.first_heartbeat_timeout,
                heartbeat_within=settings.heartbeat_timeout,
            )
            deps.metrics.machines_silent.set(len(silent), {"provider": instance.name})
            hold = held.get(instance.name)
            count = hold.silent_count if hold is not None and hold.released_at is None else 0
            deps.metrics.recoveries_held.set(count, {"provider": instance.name})
            deps.metrics.machines_stuck.set(stuck.get(instance.name, 0), {"provider": instance.name})

    await repeat_every(stop, min(settings.reconcile_interval, 30.0), refresh, "refreshing the fleet gauges")


def watch_certificates(
    expiry: CertificateExpiry,
    settings: Settings,
    temporal_tls: TLSConfig | bool | None,
    agent_ca_bundle: ReloadedFile[tuple[bytes, ...]] | None,
    database_url: str,
) -> None:
    """Give the gauge of certificate expiry what a worker holds, where each is configured: the Temporal client
    certificate it connected with (temporal_tls), the CA bundle agents are given at takeover (agent_ca_bundle),
    and BMDB's client certificate (sslcert in database_url).

    The Temporal client certificate is read at start and used as read until the worker restarts: it is watched as
    held and as on disk, and the sooner to expire counts, so renewing the file clears the alert once a restart put
    it to use. The CA bundle counts as takeovers hand it out, its file looked at first: a renewed bundle counts
    from the refresh after it was written, a bad one not at all while the one before is handed out.
    """
    if isinstance(temporal_tls, TLSConfig) and temporal_tls.client_cert is not None:
        held = temporal_tls.client_cert
        sources: list[CertificateSource] = [lambda: parse_certificates(held, "the Temporal client certificate")]
        try:
            configured = load_temporal_connection(settings).tls
        except TemporalConfigError:
            configured = None  # it was good enough to connect with: what is held is watched
        if configured is not None and isinstance(configured.client_cert, Path):
            sources.append(certificate_file(configured.client_cert))
        expiry.watch(TEMPORAL_CLIENT_CERTIFICATE, *sources)
    if agent_ca_bundle is not None:
        expiry.watch(
            AGENT_ENDPOINT_CA, lambda: [x509.load_der_x509_certificate(der) for der in agent_ca_bundle.current()]
        )
    expiry.watch_bmdb_client(database_url)


def uncompiled_modules(modules: Iterable[ModuleType]) -> list[str]:
    """The source files among modules that have no compiled bytecode beside them (or under PYTHONPYCACHEPREFIX).

    The workflow sandbox imports a workflow's module afresh for every workflow run: from bytecode, a fraction of
    a millisecond; from source, a compile of about 10 ms of CPU for every machine's run.
    """
    missing = []
    for module in modules:
        source = getattr(module, "__file__", None)
        if source and source.endswith(".py") and not Path(importlib.util.cache_from_source(source)).exists():
            missing.append(source)
    return missing


def _warn_if_workflows_compile_each_run() -> None:
    uncompiled = uncompiled_modules(sys.modules[workflow.__module__] for workflow in (MachineWorkflow, FleetWorkflow))
    if uncompiled:
        log.warning(
            "no compiled bytecode for %s (PYTHONDONTWRITEBYTECODE set, or a read-only install): every workflow run "
            "compiles it again, about 10 ms of CPU each; install with pip, which compiles, or run "
            "`python -m compileall` on it",
            ", ".join(uncompiled),
        )


async def run_worker(settings: Settings, database_url: str, *, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or stop is set), then hand back what is held and exit."""
    try:
        runtime = metrics_runtime(settings.metrics_listen, "worker")
    except MetricsUnavailable as error:
        raise StartupError(str(error)) from None
    log_bmdb_tls_warnings(log, {"database_url": database_url})
    client = await connect_temporal(settings, runtime)
    await check_search_attributes(client, client.namespace, SEARCH_ATTRIBUTES)
    deps = await open_activity_deps(settings, client, database_url)
    deps.metrics = WorkerMetrics.on(meter_of(runtime))
    _warn_if_workflows_compile_each_run()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await ensure_fleet_schedules(client, settings, first_pass_now=True)
        log.info(
            "worker polling task queue %s at %s, namespace %s",
            settings.task_queue,
            client.service_client.config.target_host,
            client.namespace,
        )
        if runtime is not None:
            log.info("serving /metrics on %s", settings.metrics_listen)
        async with serving(client, deps), asyncio.TaskGroup() as observers:
            observers.create_task(watch_fleet(stop, FleetActivities(deps), settings, identity=client.identity))
            if runtime is not None:
                observers.create_task(observe_fleet(client, deps, stop))
                expiry = CertificateExpiry(meter_of(runtime))
                watch_certificates(
                    expiry, settings, client.service_client.config.tls, deps.agent_ca_bundle_file, database_url
                )
                observers.create_task(expiry.run(stop))
            await stop.wait()
            log.info("stopping: letting running activities finish for up to %ss", settings.shutdown_grace)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await deps.close()
