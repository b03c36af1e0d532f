"""Benchmark: a whole fleet pass of an Ironic with many nodes, against what a script reads to know the same.

Starts OpenStack Ironic standalone (SQLite, one process, as the tests run it) with --nodes fake-hardware nodes: a
twentieth left available (free capacity), a twentieth deployed by someone else (a node Shepherd leaves alone), the
rest Shepherd's: claimed and deployed by Shepherd's provider as a machine's provisioning does (its marks, a config
drive with its key), recorded in BMDB (a local PostgreSQL) as machines taken over and heartbeating, each with its
MachineWorkflow running on a Temporal dev server (on a task queue no worker polls: they wait as WATCHING machines
do). All of that once, untimed; then --rounds of each, taking turns, the order swapped every round:

raw       what a script reads to know the same, both at once: openstacksdk's listing of every node
          (``conn.baremetal.nodes(details=True)``) and one psycopg query of the provider's BMDB rows with their
          agent's start and last heartbeat (what the pass's listings and its watchdog read of BMDB).
shepherd  a whole FleetWorkflow pass through the production worker, timed from its start to its result: the plan
          (Ironic and BMDB listed at once, decided; the fleet is at max_machines, so nothing is admitted), ensure
          (BMDB listed again, the running machine workflows counted), the watchdog (its BMDB queries; no machine is
          silent). Each activity's own time is read from the pass's history; after the pass, the plan's Ironic
          listing is timed once more, alone.

The heartbeats are made fresh before each round, untimed. Beside the wall time, the CPU of this process (the
worker or the script), Ironic, the Temporal server and PostgreSQL. Run:

    python -m bench.ironic_fleet_pass [--nodes 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncssh
import psycopg
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.deps import ActivityDeps
from activities.fleet import each_at_most
from activities.workflow_start import start_machine_workflow
from bench.bmdb_rows import BenchMachine, insert_machines
from bench.fleet_pass import FLEET_QUEUE, IDLE_QUEUE, STARTS_IN_FLIGHT, running_count
from bench.ironic_nodes import enroll_available, in_parallel, provider_options, script_connection
from bench.stack_cpu import CpuTimes, StackCpu
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB
from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from foundation.ssh_identity import public_key_openssh
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import SEARCH_ATTRIBUTES, FleetPassResult, machine_workflow_id
from lifecycle.inputs import fleet_input
from processes.worker import serving
from providers import ProviderUnavailable
from providers.ironic import IronicProvider, from_settings
from shepherd.commands.dev_stack.children import temporal_cli
from tests.ironic_fixtures import Ironic, running_ironic
from workflows.fleet import FleetWorkflow

PROVIDER = "rack"
# One node in this many is free capacity, and one more someone else's.
SHARE = 20
# Not a step of the pass: its Ironic listing timed once more, alone, right after it.
LISTING_ALONE = "Ironic listing alone"
# A create that meets Ironic's SQLite busy is asked again, as the step's back-off would.
CREATE_TRIES = 5
# What the script reads of BMDB: every row a pass lists, with what the watchdog reads of its agent.
RAW_QUERY = """
SELECT p.machine_id, p.provider_id, p.status, p.missing_since, p.retired_at, s.agent_started_at, h.agent_heartbeat_at
FROM machine_provided p
LEFT JOIN machine_agent_started s USING (machine_id)
LEFT JOIN machine_agent_heartbeat h USING (machine_id)
WHERE p.provider = %s
ORDER BY p.provider_id
"""


@dataclass(frozen=True)
class Fleet:
    """The nodes of the run, by whose they are."""

    ours: list[str]
    free: list[str]
    theirs: list[str]

    @classmethod
    def split(cls, nodes: list[str]) -> Fleet:
        share = len(nodes) // SHARE
        return cls(ours=nodes[2 * share :], free=nodes[:share], theirs=nodes[share : 2 * share])

    @staticmethod
    def ours_of(nodes: int) -> int:
        """How many of that many nodes are Shepherd's."""
        return nodes - 2 * (nodes // SHARE)


@dataclass
class Measured:
    """One round of one variant: wall seconds, the stack's CPU, and (shepherd) each activity's seconds."""

    seconds: float
    cpu: CpuTimes
    steps: dict[str, float] = field(default_factory=dict)


async def deploy_as_shepherds(provider: IronicProvider, nodes: list[str], public_key: str) -> None:
    """Claim and deploy each node as a machine's provisioning does, then wait until Ironic has every one active."""

    async def create(node: str) -> None:
        for attempt in range(1, CREATE_TRIES + 1):
            try:
                await provider.create_machine(node, machine_workflow_id(PROVIDER, node), public_key)
                return
            except ProviderUnavailable:
                if attempt == CREATE_TRIES:
                    raise
                await asyncio.sleep(attempt)

    await each_at_most(nodes, 4, create)
    wanted = set(nodes)
    while True:
        active = {node.uuid for node in await provider.api.nodes() if node.provision_state == "active"}
        if wanted <= active:
            return
        await asyncio.sleep(1)


async def set_up(ironic: Ironic, nodes: int, deps: ActivityDeps, url: str) -> Fleet:
    """The fleet the docstring describes, Ironic's part first; each part's time printed."""
    started = time.perf_counter()
    fleet = Fleet.split(await asyncio.to_thread(enroll_available, ironic, nodes))
    print(f"{nodes:,} fake-hardware nodes available in {time.perf_counter() - started:.0f}s")
    started = time.perf_counter()
    provider = deps.provider(PROVIDER)
    assert isinstance(provider, IronicProvider)
    await deploy_as_shepherds(provider, fleet.ours, deps.ssh_public_key)
    await asyncio.to_thread(in_parallel, ironic.deploy_as_someone_else, fleet.theirs)
    print(
        f"{len(fleet.ours):,} deployed as Shepherd's, {len(fleet.theirs):,} as someone else's,"
        f" {len(fleet.free):,} left available, in {time.perf_counter() - started:.0f}s"
    )
    started = time.perf_counter()
    machines = [BenchMachine(uuid.uuid4(), PROVIDER, node, uuid.uuid4().bytes * 2) for node in fleet.ours]
    insert_machines(url, machines, heartbeat_at=datetime.now(UTC))
    idle = replace(deps.settings, task_queue=IDLE_QUEUE)

    async def start(machine: BenchMachine) -> bool:
        return await start_machine_workflow(deps.client, idle, PROVIDER, machine.provider_id, str(machine.machine_id))

    await each_at_most(machines, STARTS_IN_FLIGHT, start)
    await running_count(deps.client, len(machines))
    print(f"in BMDB, heartbeating, their workflows running, in {time.perf_counter() - started:.0f}s")
    return fleet


def heartbeat_now(url: str) -> None:
    """Every agent heartbeating a moment ago, so the watchdog finds none silent however long the run."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now(), agent_sent_at = now()")


async def raw(connection: Any, database: psycopg.Connection[Any], fleet: Fleet) -> None:
    """The script's listing of every node and its query of the BMDB rows, at once."""

    def nodes() -> int:
        return sum(1 for _ in connection.baremetal.nodes(details=True))

    def rows() -> int:
        return len(database.execute(RAW_QUERY, (PROVIDER,)).fetchall())

    listed, read = await asyncio.gather(asyncio.to_thread(nodes), asyncio.to_thread(rows))
    total = len(fleet.ours) + len(fleet.free) + len(fleet.theirs)
    assert (listed, read) == (total, len(fleet.ours)), f"the script saw {listed} nodes and {read} rows"


async def shepherd(client: Client, settings: Settings, fleet: Fleet) -> WorkflowHandle[Any, FleetPassResult]:
    """One whole pass, as the fleet schedule starts it; its handle, for its history."""
    handle = await client.start_workflow(
        FleetWorkflow.run, fleet_input(settings, PROVIDER), id=f"bench-pass-{uuid.uuid4()}", task_queue=FLEET_QUEUE
    )
    result = await handle.result()
    plan = result.plan
    assert result.error is None and not result.admitted and not result.silent and result.workflows_started == 0
    assert plan is not None and plan.managed_count == len(fleet.ours), plan
    assert plan.provider_count == len(fleet.ours) + len(fleet.free), plan
    assert sum(plan.left_alone.values()) == len(fleet.theirs), plan
    return handle


async def activity_seconds(handle: WorkflowHandle[Any, Any]) -> dict[str, float]:
    """Each activity's time in the pass's history, from its start by a worker to its completion."""
    names: dict[int, str] = {}
    started: dict[int, datetime] = {}
    took: dict[str, float] = {}
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            names[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.HasField("activity_task_started_event_attributes"):
            started[event.activity_task_started_event_attributes.scheduled_event_id] = event.event_time.ToDatetime()
        elif event.HasField("activity_task_completed_event_attributes"):
            scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
            took[names[scheduled]] = (event.event_time.ToDatetime() - started[scheduled]).total_seconds()
    return took


async def listing_alone(deps: ActivityDeps) -> float:
    """Seconds of the plan's Ironic listing alone, the pass's provider half, timed after the pass."""
    started = time.perf_counter()
    await deps.provider(PROVIDER).list_machines()
    return time.perf_counter() - started


async def measure(
    ironic: Ironic, nodes: int, rounds: int, tmp: Path, url: str
) -> tuple[Fleet, dict[str, list[Measured]]]:
    options = provider_options(ironic)
    instance = ProviderInstance(PROVIDER, "ironic", options)
    # At the limit, as a fleet that has all the machines it wants: free capacity stays free.
    settings = Settings(task_queue=FLEET_QUEUE, providers=(instance,), max_machines=Fleet.ours_of(nodes))
    environment = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        data_converter=DATA_CONVERTER,
    )
    key = asyncssh.generate_private_key("ssh-ed25519")
    deps = ActivityDeps(
        settings=settings,
        bmdb=BMDB(url),
        providers={PROVIDER: from_settings(instance, settings)},
        client=environment.client,
        ssh_key=key,
        ssh_public_key=public_key_openssh(key),
    )
    connection = script_connection(ironic)
    results: dict[str, list[Measured]] = {"raw": [], "shepherd": []}
    try:
        fleet = await set_up(ironic, nodes, deps, url)
        cpu = StackCpu.of(ironic.process.pid, tmp / "pg")
        with psycopg.connect(url, autocommit=True) as database:
            async with serving(environment.client, deps):
                # Untimed: the session's version discovery, Ironic's and PostgreSQL's caches, and the worker's
                # first pass, which lists the running workflows where the later ones count them.
                await raw(connection, database, fleet)
                await shepherd(environment.client, settings, fleet)
                for round_ in range(rounds):
                    heartbeat_now(url)
                    for variant in ("raw", "shepherd") if round_ % 2 == 0 else ("shepherd", "raw"):
                        before, started = cpu.read(), time.perf_counter()
                        if variant == "raw":
                            await raw(connection, database, fleet)
                            handle = None
                        else:
                            handle = await shepherd(environment.client, settings, fleet)
                        took, used = time.perf_counter() - started, cpu.read() - before
                        steps = {}
                        if handle is not None:
                            steps = await activity_seconds(handle)
                            steps[LISTING_ALONE] = await listing_alone(deps)
                        results[variant].append(Measured(took, used, steps))
    finally:
        connection.close()
        await deps.close()
        await environment.shutdown()
    return fleet, results


def report(fleet: Fleet, results: dict[str, list[Measured]]) -> None:
    """Each variant's median time and CPU, Shepherd's steps, and its ratio to the script's, round by round."""
    print(
        f"{len(fleet.ours):,} nodes Shepherd's, {len(fleet.free):,} free, {len(fleet.theirs):,} someone else's;"
        f" {len(results['raw'])} rounds taking turns. Medians (wall min-max); CPU: this process, Ironic, Temporal,"
        " PostgreSQL:"
    )
    for name, runs in results.items():
        walls = [run.seconds for run in runs]

        def cpu(of: str, runs: list[Measured] = runs) -> float:
            return statistics.median(getattr(run.cpu, of) for run in runs) * 1000

        print(
            f"  {name:9} {statistics.median(walls) * 1000:7.0f} ms ({min(walls) * 1000:.0f}-{max(walls) * 1000:.0f});"
            f" CPU {cpu('here'):5.0f} ms, {cpu('ironic'):5.0f} ms, {cpu('temporal'):5.0f} ms, {cpu('postgres'):4.0f} ms"
        )
    passes = results["shepherd"]
    for step in [step for step in passes[0].steps if step != LISTING_ALONE]:
        print(f"    {step:28} {statistics.median(run.steps[step] for run in passes) * 1000:6.0f} ms")
    rest = [run.seconds - sum(took for step, took in run.steps.items() if step != LISTING_ALONE) for run in passes]
    print(f"    {'the rest (Temporal)':28} {statistics.median(rest) * 1000:6.0f} ms")
    alone = statistics.median(run.steps[LISTING_ALONE] for run in passes)
    print(f"  the plan's Ironic listing alone, after each pass: {alone * 1000:.0f} ms")
    ratios = [s.seconds / r.seconds for s, r in zip(results["shepherd"], results["raw"], strict=True)]
    print(f"  shepherd / raw, round by round: {', '.join(f'{ratio:.2f}' for ratio in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ironic_fleet_pass",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.nodes < 1 or args.rounds < 1:
        parser.error("--nodes and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-ironic-") as tmp_name:
        tmp = Path(tmp_name)
        with running_ironic(tmp / "ironic") as ironic, LocalPostgres(tmp / "pg") as url:
            migrate.upgrade(url)
            fleet, results = asyncio.run(measure(ironic, args.nodes, args.rounds, tmp, url))
    report(fleet, results)


if __name__ == "__main__":
    main()
