"""Benchmark: a worker's memory with many machines WATCHING, bounded by its workflow cache, not the fleet.

A real `shepherd worker` process (its own PostgreSQL-backed BMDB, a Temporal
dev server in this process) runs the MachineWorkflows of a growing number of
machines. Each workflow starts as a machine whose agent runs (as after a
continue-as-new in WATCHING), so it takes one workflow task and then waits, as
every healthy machine of a fleet does. After each size, once every workflow
shows WATCHING, the worker's resident memory is read from /proc.

Two workers are measured in turn: one with the default cache
(SHEPHERD_MAX_CACHED_WORKFLOWS, 1,000 runs), and one whose cache holds the
whole fleet: the baseline of what the cache bounds. Run:

    python -m bench.worker_memory [--sizes 1000,3000,10000] [--cache 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.fleet import each_at_most
from agent.build import build_agent_executable
from bench.heartbeats import peak_rss_mib, status_mib
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import (
    MACHINE_STAGE,
    MACHINE_WORKFLOW_TYPE,
    RUNNING_MACHINES,
    SEARCH_ATTRIBUTES,
    AgentFacts,
    MachineInput,
    MachineStage,
    MachineStatus,
    initial_search_attributes,
    machine_workflow_id,
)
from lifecycle.inputs import lifecycle_policy
from shepherd.commands.dev_stack.children import temporal_cli
from shepherd.commands.dev_stack.stack_settings import settings_environment

PROVIDER = "sim"
TASK_QUEUE = "bench-memory"
STARTS_IN_FLIGHT = 50
WATCHING = f'{RUNNING_MACHINES} AND {MACHINE_STAGE.name} = "{MachineStage.WATCHING.value}"'


@dataclass
class Reading:
    watching: int
    rss_mib: float
    peak_mib: float


def watching_input(settings: Settings, n: int) -> MachineInput:
    provider_id, machine_id = f"node-{n:06d}", str(uuid.uuid4())
    watching = MachineStatus(
        machine_id=machine_id,
        provider=PROVIDER,
        provider_id=provider_id,
        stage=MachineStage.WATCHING,
        stage_since="",
        address=f"10.1.{n // 250}.{n % 250 + 1}",
        agent=AgentFacts(started_at=datetime.now(UTC).isoformat(), key_fingerprint="SHA256:bench", warnings=[]),
    )
    return MachineInput(PROVIDER, provider_id, machine_id, lifecycle_policy(settings), status=watching)


async def start_watching(client: Client, settings: Settings, first: int, last: int) -> None:
    async def start(n: int) -> None:
        machine = watching_input(settings, n)
        await client.start_workflow(
            MACHINE_WORKFLOW_TYPE,
            machine,
            id=machine_workflow_id(PROVIDER, machine.provider_id),
            task_queue=TASK_QUEUE,
            search_attributes=initial_search_attributes(PROVIDER, machine.provider_id, machine.machine_id),
        )

    await each_at_most(range(first, last + 1), STARTS_IN_FLIGHT, start)


async def all_watching(client: Client, count: int, worker: asyncio.subprocess.Process) -> None:
    while (await client.count_workflows(WATCHING)).count < count:
        if worker.returncode is not None:
            raise RuntimeError(f"the worker exited with status {worker.returncode}")
        await asyncio.sleep(1.0)


async def measure(tmp: Path, database_url: str, sizes: list[int], cache: int) -> list[Reading]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        data_converter=DATA_CONVERTER,
    )
    settings = Settings(
        temporal_address=env.client.service_client.config.target_host,
        task_queue=TASK_QUEUE,
        state_dir=tmp / "state",
        # Nothing answers there: no pass runs while measured (the schedule's interval is an hour).
        sim_api_url="http://127.0.0.1:9",
        ssh_key_path=tmp / "ssh_key",
        agent_executable_path=build_agent_executable(tmp / "agent", heartbeats=False),
        agent_endpoint="127.0.0.1:9",
        reconcile_interval=3600.0,
        max_cached_workflows=cache,
    )
    variables = {**os.environ, **settings_environment(settings), "SHEPHERD_DATABASE_URL": database_url}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shepherd", "worker", env=variables, stderr=subprocess.DEVNULL
    )
    readings = []
    try:
        await asyncio.sleep(3.0)
        readings.append(Reading(0, status_mib(worker.pid, "VmRSS"), peak_rss_mib(worker.pid)))
        started = 0
        for size in sizes:
            began = time.perf_counter()
            await start_watching(env.client, settings, started + 1, size)
            await all_watching(env.client, size, worker)
            started = size
            # Let the worker settle: evictions and garbage collection after the last tasks.
            await asyncio.sleep(3.0)
            reading = Reading(size, status_mib(worker.pid, "VmRSS"), peak_rss_mib(worker.pid))
            print(
                f"  cache {cache:,}: {size:,} WATCHING ({time.perf_counter() - began:.0f} s): worker resident"
                f" {reading.rss_mib:.0f} MiB, peak {reading.peak_mib:.0f} MiB",
                flush=True,
            )
            readings.append(reading)
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 60)
        await env.shutdown()
    return readings


def report(bounded: list[Reading], whole: list[Reading], cache: int, fleet_cache: int) -> None:
    print(f"machines WATCHING | worker resident, cache {cache:,} | cache {fleet_cache:,} (the whole fleet) | ratio")
    for mine, theirs in zip(bounded, whole, strict=True):
        print(
            f"  {mine.watching:>8,}  {mine.rss_mib:7.0f} MiB (peak {mine.peak_mib:4.0f})"
            f"   {theirs.rss_mib:7.0f} MiB (peak {theirs.peak_mib:4.0f})   {mine.rss_mib / theirs.rss_mib:.2f}"
        )
    if len(bounded) >= 3:
        # Beyond the cache, each further machine should cost next to nothing.
        small, large = bounded[-2], bounded[-1]
        each = (large.rss_mib - small.rss_mib) * 1024 / (large.watching - small.watching)
        whole_each = (whole[-1].rss_mib - whole[-2].rss_mib) * 1024 / (large.watching - small.watching)
        print(
            f"  from {small.watching:,} to {large.watching:,}: {each:.1f} KiB a further machine with the cache of"
            f" {cache:,}, {whole_each:.1f} KiB with the whole fleet cached"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker_memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000,3000,10000", help="machines WATCHING, growing")
    parser.add_argument("--cache", type=int, default=Settings().max_cached_workflows, help="the cache measured")
    args = parser.parse_args()
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes growing numbers separated by commas, got {args.sizes!r}")
    if not sizes or sizes != sorted(sizes) or sizes[0] < 1 or args.cache < 0:
        parser.error("--sizes must grow from at least 1, and --cache be at least 0")
    fleet_cache = 2 * sizes[-1]
    results = []
    for cache in (args.cache, fleet_cache):
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            with LocalPostgres(tmp / "pg") as url:
                migrate.upgrade(url)
                results.append(asyncio.run(measure(tmp, url, sizes, cache)))
    report(results[0], results[1], args.cache, fleet_cache)


if __name__ == "__main__":
    main()
