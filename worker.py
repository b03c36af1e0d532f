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
from temporalio.runtime import Runtime
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.deps import ActivityDeps
from activities.fleet import FleetActivities
from activities.provisioning import ProvisioningActivities
from activities.recovery import RecoveryActivities
from activities.takeover import TakeoverActivities
from bmdb import migrate
from bmdb.store import BMDB, BMDBUnavailable, redact_url
from foundation.logs import LogContextInterceptor
from foundation.metrics import MetricsUnavailable, WorkerMetrics, meter_of, metrics_runtime
from foundation.settings import Settings, SettingsError
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from lifecycle.contracts import FLEET_SCHEDULE_ID, FLEET_WORKFLOW_ID, SEARCH_ATTRIBUTES, FleetInput, MachineStage
from providers import Provider
from providers.sim import SimProvider
from shepherd.commands.machines import RUNNING_MACHINES
from workflows.fleet import FleetWorkflow
from workflows.machine import MachineWorkflow

log = logging.getLogger("shepherd.worker")


class StartupError(Exception):
    """The worker cannot start; the message says which part and why."""


async def connect_temporal(settings: Settings, runtime: Runtime | None = None) -> Client:
    try:
        return await Client.connect(
            settings.temporal_address, namespace=settings.temporal_namespace, runtime=runtime or Runtime.default()
        )
    except Exception as error:
        raise StartupError(
            f"cannot reach Temporal at {settings.temporal_address} (setting temporal_address), "
            f"namespace {settings.temporal_namespace!r}: {error}"
        ) from error


async def check_search_attributes(client: Client, settings: Settings) -> None:
    """Refuse to start on a namespace without Shepherd's search attributes: every workflow would fail to start."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=settings.temporal_namespace)
        )
    except RPCError as error:
        raise StartupError(
            f"cannot list the search attributes of namespace {settings.temporal_namespace!r}: {error}"
        ) from error
    missing = [key.name for key in SEARCH_ATTRIBUTES if key.name not in listed.custom_attributes]
    if missing:
        commands = "; ".join(
            f"temporal operator search-attribute create --namespace {settings.temporal_namespace} "
            f"--name {name} --type Keyword"
            for name in missing
        )
        raise StartupError(
            f"namespace {settings.temporal_namespace!r} lacks the search attributes {', '.join(missing)}; "
            f"register them once: {commands}"
        )


async def open_bmdb(url: str) -> BMDB:
    bmdb = BMDB(url)
    try:
        await bmdb.ping()
    except BMDBUnavailable as error:
        await bmdb.close()
        raise StartupError(f"{error} (setting database_url)") from error
    revision = await asyncio.to_thread(migrate.current_revision, url)
    head = migrate.head_revision()
    if revision != head:
        await bmdb.close()
        raise StartupError(
            f"BMDB at {redact_url(url)} has schema revision {revision or 'none'}, this Shepherd needs {head}: "
            "run `shepherd migrate`"
        )
    return bmdb


def make_provider(settings: Settings) -> Provider:
    if settings.provider == "sim":
        return SimProvider(settings.sim_api_url, timeout=settings.provider_timeout)
    raise SettingsError("provider", f"unknown provider {settings.provider!r}")


async def build_deps(settings: Settings, client: Client, database_url: str) -> ActivityDeps:
    settings.check_agent()
    ssh_key = load_or_create_ssh_key(settings.effective_ssh_key_path)
    assert settings.agent_executable_path is not None
    agent_executable = settings.agent_executable_path.read_bytes()
    ca_certificate = b""
    if settings.agent_endpoint_ca_certificate_path is not None:
        ca_certificate = load_ca_certificate(settings.agent_endpoint_ca_certificate_path.read_bytes())
    bmdb = await open_bmdb(database_url)
    provider = make_provider(settings)
    return ActivityDeps(
        settings=settings,
        bmdb=bmdb,
        providers={provider.type: provider},
        client=client,
        ssh_key=ssh_key,
        ssh_public_key=public_key_openssh(ssh_key),
        agent_executable=agent_executable,
        ca_certificate=ca_certificate,
    )


def load_ca_certificate(pem: bytes) -> bytes:
    """DER bytes of the PEM certificate the agents trust for their endpoint."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    try:
        return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)
    except ValueError as error:
        raise SettingsError("agent_endpoint_ca_certificate_path", f"not a PEM X.509 certificate: {error}") from None


def build_worker(client: Client, deps: ActivityDeps) -> Worker:
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


def fleet_input(settings: Settings) -> FleetInput:
    return FleetInput(
        first_heartbeat_within=settings.first_heartbeat_timeout,
        heartbeat_within=settings.heartbeat_timeout,
        provider=settings.provider,
        max_machines=settings.max_machines,
        chunk_size=settings.chunk_size,
        device_creation_interval=settings.device_creation_interval,
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
                counted = await client.count_workflows(f'{RUNNING_MACHINES} AND MachineStage = "{stage.value}"')
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
    await check_search_attributes(client, settings)
    deps = await build_deps(settings, client, database_url)
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
