"""Whole fleet passes at growing fleet sizes, for bench.reconcile --pass (its docstring says what is measured)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import asyncssh
import psycopg
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from activities.deps import ActivityDeps
from activities.fleet import FleetActivities, each_at_most
from activities.workflow_start import start_machine_workflow
from bench.bmdb_rows import BenchMachine, insert_machines
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB
from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from foundation.ssh_identity import public_key_openssh
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import (
    RUNNING_MACHINES,
    SEARCH_ATTRIBUTES,
    EnsureWorkflowsInput,
    ReconcilePassInput,
    WatchdogInput,
    provider_task_queue,
    running_machines_of,
)
from lifecycle.inputs import fleet_input, recovery_hold_rule
from providers.static import from_settings
from workflows.fleet import FleetWorkflow

PROVIDER = "rack"
FLEET_QUEUE = "bench-fleet"
# The machine workflows' queue: no worker polls it, so they wait, running, as WATCHING machines cost nothing.
IDLE_QUEUE = "bench-idle"
STARTS_IN_FLIGHT = 50
REPEATS = 3


def provider_id(n: int) -> str:
    return f"node-{n:06d}"


@dataclass
class Sizes:
    """What one fleet size measured, in seconds (best of REPEATS); None where not every machine has its workflow."""

    machines: int
    running: int
    plan: float
    bmdb_listing: float
    workflow_count: float
    workflow_listing: float
    watchdog: float
    # The ensure step of a pass that counts the running workflows and finds one for every machine.
    ensure_counting: float | None
    whole_pass: float | None


def grow_bmdb(url: str, first: int, last: int) -> None:
    """Machines first..last as after a takeover, heartbeating a moment ago."""
    machines = []
    for n in range(first, last + 1):
        machine_id = uuid.uuid4()
        machines.append(BenchMachine(machine_id, PROVIDER, provider_id(n), machine_id.bytes * 2))
    insert_machines(url, machines, heartbeat_at=datetime.now(UTC))


def write_inventory(path: Path, machines: int) -> None:
    lines = []
    for n in range(1, machines + 1):
        lines += ["[[machines]]", f'id = "{provider_id(n)}"', f'ssh = "10.0.{n // 65536}.{n % 250 + 1}:22"', ""]
    path.write_text("\n".join(lines))


async def best_of(action) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        await action()
        times.append(time.perf_counter() - start)
    return min(times)


async def start_running(client: Client, settings: Settings, url: str, first: int, last: int) -> None:
    idle = replace(settings, task_queue=IDLE_QUEUE)
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT provider_id, machine_id FROM machine_provided WHERE provider = %s AND provider_id = ANY(%s)",
            (PROVIDER, [provider_id(n) for n in range(first, last + 1)]),
        ).fetchall()

    async def start(row: tuple[str, uuid.UUID]) -> bool:
        return await start_machine_workflow(client, idle, PROVIDER, row[0], str(row[1]))

    await each_at_most(rows, STARTS_IN_FLIGHT, start)


async def running_count(client: Client, expected: int) -> None:
    """Wait until visibility lists every started workflow, as a pass would see them."""
    while True:
        if (await client.count_workflows(RUNNING_MACHINES)).count >= expected:
            return
        await asyncio.sleep(0.5)


async def measure(client: Client, deps: ActivityDeps, settings: Settings, machines: int, running: int) -> Sizes:
    fleet = FleetActivities(deps)
    environment = ActivityEnvironment()
    plan_input = ReconcilePassInput(provider=PROVIDER, max_machines=0, chunk_size=settings.chunk_size)
    plan = await best_of(lambda: environment.run(fleet.plan_reconcile_pass, plan_input))
    bmdb_listing = await best_of(lambda: deps.bmdb.list_provided(PROVIDER))
    query = running_machines_of(PROVIDER)
    workflow_count = await best_of(lambda: client.count_workflows(query))

    async def list_running() -> None:
        async for _ in client.list_workflows(query):
            pass

    workflow_listing = await best_of(list_running)
    watchdog_input = WatchdogInput(
        provider=PROVIDER,
        as_of=datetime.now(UTC).isoformat(),
        first_heartbeat_within=settings.first_heartbeat_timeout,
        heartbeat_within=settings.heartbeat_timeout,
        hold_rule=recovery_hold_rule(settings),
    )
    watchdog = await best_of(lambda: environment.run(fleet.watch_silent_machines, watchdog_input))
    ensure_counting = whole_pass = None
    if running == machines:
        ensure_input = EnsureWorkflowsInput(provider=PROVIDER)
        # A worker's first pass lists every running workflow; the ones after it count them.
        first = await environment.run(fleet.ensure_machine_workflows, ensure_input)
        assert first.listed and not first.started, f"every machine has its workflow, yet the pass did {first}"

        async def ensure() -> None:
            result = await environment.run(fleet.ensure_machine_workflows, ensure_input)
            assert not result.listed and not result.started, result

        ensure_counting = await best_of(ensure)

        async def one_pass() -> None:
            result = await client.execute_workflow(
                FleetWorkflow.run,
                fleet_input(settings, PROVIDER),
                id=f"bench-pass-{uuid.uuid4()}",
                task_queue=FLEET_QUEUE,
            )
            assert result.error is None and result.silent == [] and result.workflows_started == 0, result

        # The worker's first pass at the smallest size lists; REPEATS passes after it count.
        await one_pass()
        whole_pass = await best_of(one_pass)
    return Sizes(
        machines, running, plan, bmdb_listing, workflow_count, workflow_listing, watchdog, ensure_counting, whole_pass
    )


def report(measured: list[Sizes], cap: int) -> None:
    print(f"fleet passes, provider {PROVIDER!r} (static inventory), best of {REPEATS}:")
    print("  machines  running  plan     BMDB list  count    listing   ensure   watchdog  whole pass")
    for size in measured:
        ensure = f"{size.ensure_counting:6.2f} s" if size.ensure_counting is not None else "       -"
        whole = f"{size.whole_pass:6.2f} s" if size.whole_pass is not None else "       -"
        print(
            f"  {size.machines:8,} {size.running:8,}  {size.plan:5.2f} s  {size.bmdb_listing:5.2f} s"
            f"   {size.workflow_count:5.3f} s  {size.workflow_listing:5.2f} s  {ensure}  {size.watchdog:5.2f} s"
            f"   {whole}"
        )
    full = [size for size in measured if size.whole_pass is not None]
    if len(full) >= 2:
        small, large = full[0], full[-1]
        growth = large.machines / small.machines
        ratio = large.whole_pass / small.whole_pass  # type: ignore[operator]
        print(
            f"  whole pass from {small.machines:,} to {large.machines:,} machines ({growth:g}x):"
            f" {ratio:.2f}x the time ({ratio / growth:.2f} of linear)"
        )
    beyond = [size for size in measured if size.whole_pass is None]
    if beyond and full:
        known = full[-1]
        # Counting and listing grow with the running workflows, as the measured sizes show.
        per_count = statistics.median(size.workflow_count / size.running for size in full)
        per_listed = statistics.median(size.workflow_listing / size.running for size in full)
        assert known.whole_pass is not None and known.ensure_counting is not None
        # The pass's own cost beyond its steps: workflow tasks, activity dispatch.
        other = max(known.whole_pass - known.plan - known.ensure_counting - known.watchdog, 0.0)
        for size in beyond:
            count = per_count * size.machines
            listing = per_listed * size.machines
            counting_pass = size.plan + size.watchdog + size.bmdb_listing + count + other
            print(
                f"  at {size.machines:,}: {size.running:,} workflows run here ({cap:,} at most). A pass that counts"
                f" them would take about {counting_pass:.1f} s (the count about {count:.2f} s at the measured"
                f" {per_count * 1e6:.1f} µs a workflow). One that lists them all (a worker's first, the hourly one,"
                f" or one whose count shows a machine without its workflow) about {counting_pass + listing:.1f} s:"
                f" listing {size.machines:,} at {per_listed * 1e6:.0f} µs each."
            )


async def passes(url: str, tmp: Path, sizes: list[int], cap: int) -> list[Sizes]:
    inventory = tmp / "inventory.toml"
    settings = Settings(
        task_queue=FLEET_QUEUE,
        providers=(ProviderInstance(PROVIDER, "static", {"inventory": str(inventory)}),),
    )
    environment = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        data_converter=DATA_CONVERTER,
    )
    bmdb = BMDB(url)
    key = asyncssh.generate_private_key("ssh-ed25519")
    deps = ActivityDeps(
        settings=settings,
        bmdb=bmdb,
        providers={PROVIDER: from_settings(settings.providers[0], settings)},
        client=environment.client,
        ssh_key=key,
        ssh_public_key=public_key_openssh(key),
    )
    fleet = FleetActivities(deps)
    workers = [
        Worker(
            environment.client,
            task_queue=FLEET_QUEUE,
            workflows=[FleetWorkflow],
            activities=[fleet.ensure_machine_workflows, fleet.watch_silent_machines],
        ),
        Worker(
            environment.client,
            task_queue=provider_task_queue(FLEET_QUEUE, PROVIDER),
            activities=[fleet.plan_reconcile_pass],
        ),
    ]
    measured = []
    try:
        async with workers[0], workers[1]:
            in_bmdb = running = 0
            for size in sizes:
                started = time.perf_counter()
                grow_bmdb(url, in_bmdb + 1, size)
                write_inventory(inventory, size)
                target = min(size, cap)
                await start_running(environment.client, settings, url, running + 1, target)
                await running_count(environment.client, target)
                in_bmdb, running = size, target
                setup = time.perf_counter() - started
                print(f"{size:,} machines, {running:,} workflows running ({setup:.0f} s to set up)")
                measured.append(await measure(environment.client, deps, settings, size, running))
    finally:
        await bmdb.close()
        await environment.shutdown()
    return measured


def run_fleet_passes(sizes: list[int], cap: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with LocalPostgres(tmp / "pg") as url:
            migrate.upgrade(url)
            measured = asyncio.run(passes(url, tmp, sizes, cap))
    report(measured, cap)
