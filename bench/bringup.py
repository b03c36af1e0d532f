"""Benchmark: bringing machines up over SSH, Shepherd against raw asyncssh.

Both variants take over the same number of simulated machines (the
simulator's asyncssh servers, in the measuring process) with the same agent:
the reference agent built without heartbeats, so it answers the takeover and
exits (a thousand resident agents would not fit on one host). Each variant
runs in a process of its own, so its peak memory is its own.

raw       for every machine, asyncssh alone: connect with the key, upload the
          agent over SFTP, run it with the TakeoverInit on standard input,
          parse its TakeoverResponse; at most --concurrency at once. The
          machines are created through the provider API beforehand, untimed.
shepherd  the machines are admitted to BMDB and created with their workflow
          id as idempotency key (untimed); then every machine's
          MachineWorkflow is started on a Temporal dev server, and a worker
          with --concurrency activity slots provisions it (provider API, which
          finds it created, and BMDB) and takes it over (SSH, BMDB), as in
          production. Timed until BMDB holds every agent's start.
merged    (with --merged) as shepherd, with bench.merged_bringup's workflow in place of MachineWorkflow: a design
          option the product does not take, provisioning and the agent start as ONE activity (the product's
          two, run in turn), so two workflow tasks a machine instead of three. Timed as shepherd.

Both run from compiled bytecode, as installed code does (a bytecode cache of
their own): without it, the workflow sandbox compiles the workflow module at
every workflow run. Beside the process's own CPU, the Shepherd variant reads
from /proc the CPU of the Temporal dev server and of PostgreSQL, which share
the cores.

Options for Temporal's eager paths: --eager-start asks for each workflow's
first task in the start response (the worker is in the same process, on the
same client), and --dynamic-config KEY=VALUE (repeatable) starts the dev
server with that dynamic config, e.g. system.enableActivityEagerExecution=false
or system.enableEagerWorkflowStart=false to compare against the dev server's
defaults. The report counts the workflows whose start the server made eager.

Left out on purpose: a fleet pass admits one machine per
device_creation_interval and at most chunk_size a pass, the provider's rate
limit; this measures what the worker does once machines are admitted (after a
fleet-wide recovery, or with those limits raised). Run:

    python -m bench.bringup [--machines 1000] [--concurrency 200] [--eager-start] [--merged]
        [--dynamic-config KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncssh

from activities.fleet import each_at_most
from agent.build import build_agent_executable
from bench.heartbeats import postgres_cpu_seconds, process_cpu_seconds
from foundation.procfs import children_of
from foundation.settings import Settings
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from foundation.temporal_payloads import DATA_CONVERTER
from proto import takeover_pb2
from providers import ProviderMachine
from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig

DEFAULTS = Settings()
PROVIDER = "sim"
PROGRESS_POLL = 0.5
START_CONCURRENCY = 50
LIMIT_SECONDS = 1800.0
# Told to the agents, which send no heartbeats: nothing listens there.
ENDPOINT = "127.0.0.1:9"


@dataclass
class Outcome:
    variant: str
    machines: int
    concurrency: int
    seconds: float
    failed_attempts: int
    peak_rss_mib: float
    # CPU seconds of this process (SSH both ends, the worker) and of the agents it ran, while timed.
    cpu_process: float
    cpu_agents: float
    p50: float | None = None
    p99: float | None = None
    # Shepherd's other processes on the same cores while timed: the Temporal dev server and PostgreSQL.
    cpu_temporal: float = 0.0
    cpu_postgres: float = 0.0
    # Workflows whose first task the server handed back in the start response.
    eager_started: int = 0


def raise_file_limit() -> None:
    # A thousand machines hold a listening socket each, and both ends of every SSH session are here.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> tuple[float, float]:
    """CPU time so far of this process and of its waited-for children (the agents)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class Stopwatch:
    """Wall and CPU time from its creation to stop()."""

    def __init__(self) -> None:
        self.started, self.cpu_started = time.perf_counter(), cpu_seconds()
        self.seconds, self.cpu = 0.0, (0.0, 0.0)

    def stop(self) -> None:
        own, agents = cpu_seconds()
        self.seconds = time.perf_counter() - self.started
        self.cpu = (own - self.cpu_started[0], agents - self.cpu_started[1])

    def outcome(self, variant: str, machines: int, concurrency: int, failures: int, **more: Any) -> Outcome:
        return Outcome(variant, machines, concurrency, self.seconds, failures, peak_rss_mib(), *self.cpu, **more)


def simulator(tmp: Path, machines: int) -> Simulator:
    return Simulator(SimulatorConfig(machines=machines, state_dir=tmp / "sim", api_port=0))


async def raw_takeover(
    address: str, port: int, key: asyncssh.SSHKey, agent: bytes, init: takeover_pb2.TakeoverInit
) -> float:
    started = time.perf_counter()
    directory, name = DEFAULTS.agent_target_path.rsplit("/", 1)
    upload = f"{directory}/.{name}.upload"
    async with asyncssh.connect(
        address, port, username="root", known_hosts=None, client_keys=[key], agent_path=None, config=[]
    ) as connection:
        async with connection.start_sftp_client() as sftp:
            async with sftp.open(upload, "wb") as file:
                await file.write(agent)
            await sftp.chmod(upload, 0o755)
            await sftp.posix_rename(upload, DEFAULTS.agent_target_path)
        run = await connection.run(DEFAULTS.agent_target_path, input=init.SerializeToString(), encoding=None)
    stdout = run.stdout if isinstance(run.stdout, bytes) else b""
    response = takeover_pb2.TakeoverResponse.FromString(stdout)
    if run.exit_status != 0 or response.WhichOneof("result") != "success" or len(response.success.key) != 32:
        raise RuntimeError(f"{address}:{port}: the agent did not answer the takeover: {run.stderr!r}")
    return time.perf_counter() - started


async def measure_raw(tmp: Path, machines: int, concurrency: int, agent: bytes) -> Outcome:
    key = load_or_create_ssh_key(tmp / "ssh_key")
    sim = simulator(tmp, machines)
    await sim.start()
    provider = SimProvider(sim.api_url)
    try:
        created = [
            await provider.create_machine(slot, str(uuid.uuid4()), public_key_openssh(key)) for slot in sim.slots
        ]
        failures = 0

        async def one(machine: ProviderMachine) -> float | None:
            nonlocal failures
            init = takeover_pb2.TakeoverInit(machine_id=str(uuid.uuid4()), endpoint=ENDPOINT)
            try:
                return await raw_takeover(machine.address or "", machine.ssh_port, key, agent, init)
            except (OSError, asyncssh.Error, RuntimeError) as error:
                print(f"raw takeover failed: {error}", file=sys.stderr)
                failures += 1
                return None

        stopwatch = Stopwatch()
        took = await each_at_most(created, concurrency, one)
        stopwatch.stop()
    finally:
        await provider.close()
        await sim.stop()
    done = sorted(t for t in took if t is not None)
    latency = {"p50": statistics.median(done), "p99": done[math.ceil(len(done) * 0.99) - 1]} if done else {}
    return stopwatch.outcome("raw asyncssh", machines, concurrency, failures, **latency)


async def measure_shepherd(
    tmp: Path,
    machines: int,
    concurrency: int,
    agent_path: Path,
    database_url: str,
    *,
    eager_start: bool = False,
    dynamic_config: tuple[str, ...] = (),
    merged: bool = False,
) -> Outcome:
    """The shepherd variant; merged: the merged variant, bench.merged_bringup's workflow and workers instead."""
    from temporalio.testing import WorkflowEnvironment

    from activities.deps import open_activity_deps
    from activities.workflow_start import start_machine_workflow
    from bench.merged_workers import merged_serving, start_merged_bringup
    from lifecycle.contracts import SEARCH_ATTRIBUTES, machine_workflow_id
    from processes.worker import serving
    from shepherd.commands.dev_stack.children import temporal_cli

    sim = simulator(tmp, machines)
    await sim.start()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        data_converter=DATA_CONVERTER,
        dev_server_extra_args=dev_server_arguments(dynamic_config),
    )
    try:
        settings = Settings(
            temporal_address=env.client.service_client.config.target_host,
            task_queue="bench-bringup",
            state_dir=tmp / "state",
            sim_api_url=sim.api_url,
            ssh_key_path=tmp / "ssh_key",
            agent_executable_path=agent_path,
            agent_endpoint=ENDPOINT,
            max_concurrent_activities=concurrency,
            # A failed step is tried again soon, so a failure costs seconds here, not the production back-off.
            agent_start_backoff_initial=1.0,
            agent_start_backoff_maximum=5.0,
            provision_backoff_initial=1.0,
            provision_backoff_maximum=5.0,
        )
        deps = await open_activity_deps(settings, env.client, database_url)
        try:
            admitted = [await deps.bmdb.admit_machine(PROVIDER, slot) for slot in sim.slots]
            # Created as provisioning creates them (same idempotency key), so the timed provisioning finds
            # them made, and neither variant times the simulator making a machine.
            for slot in sim.slots:
                await deps.provider(PROVIDER).create_machine(
                    slot, machine_workflow_id(PROVIDER, slot), deps.ssh_public_key
                )

            async def start(slot_and_machine: tuple[str, uuid.UUID]) -> bool:
                slot, machine_id = slot_and_machine
                starting = start_merged_bringup if merged else start_machine_workflow
                return await starting(env.client, settings, PROVIDER, slot, str(machine_id), eager=eager_start)

            async def started_eagerly(slot: str) -> bool:
                handle = env.client.get_workflow_handle(machine_workflow_id(PROVIDER, slot))
                async for first in handle.fetch_history_events(page_size=1):
                    return first.workflow_execution_started_event_attributes.eager_execution_accepted
                return False

            (temporal_server,) = children_of(os.getpid(), mentioning="start-dev")
            others_before = process_cpu_seconds(temporal_server), postgres_cpu_seconds(tmp / "pg") or 0.0
            async with (merged_serving if merged else serving)(env.client, deps):
                stopwatch = Stopwatch()
                machine_ids = [machine_id for machine_id, _ in admitted]
                await each_at_most(list(zip(sim.slots, machine_ids, strict=True)), START_CONCURRENCY, start)
                while (await deps.bmdb.count_by_status())["agent_started"] < machines:
                    if time.perf_counter() - stopwatch.started > LIMIT_SECONDS:
                        raise RuntimeError(f"not every agent started within {LIMIT_SECONDS:.0f}s")
                    await asyncio.sleep(PROGRESS_POLL)
                stopwatch.stop()
            others = process_cpu_seconds(temporal_server), postgres_cpu_seconds(tmp / "pg") or 0.0
            eager_started = sum(await each_at_most(sim.slots, START_CONCURRENCY, started_eagerly))
            failures = sum(
                [
                    1
                    for m, _ in admitted
                    for event in await deps.bmdb.list_events(m)
                    if event.kind == "agent_start_failed"
                ]
            )
        finally:
            await deps.close()
    finally:
        await env.shutdown()
        await sim.stop()
    return stopwatch.outcome(
        "merged" if merged else "shepherd",
        machines,
        concurrency,
        failures,
        cpu_temporal=others[0] - others_before[0],
        cpu_postgres=others[1] - others_before[1],
        eager_started=eager_started,
    )


def run_variant(args: argparse.Namespace) -> Outcome:
    from bmdb import migrate
    from bmdb.local_postgres import LocalPostgres

    raise_file_limit()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        agent_path = build_agent_executable(tmp / "agent", heartbeats=False)
        if args.variant == "raw":
            return asyncio.run(measure_raw(tmp, args.machines, args.concurrency, agent_path.read_bytes()))
        with LocalPostgres(tmp / "pg") as url:
            migrate.upgrade(url)
            shepherd = measure_shepherd(
                tmp,
                args.machines,
                args.concurrency,
                agent_path,
                url,
                eager_start=args.eager_start,
                dynamic_config=tuple(args.dynamic_config),
                merged=args.variant == "merged",
            )
            return asyncio.run(shepherd)


def report(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    print(
        f"{'variant':<13} {'machines':>8} {'in flight':>9} {'total':>7} {'per s':>6} {'p50':>6} {'p99':>6} "
        f"{'failed':>6} {'CPU here':>8} {'agents':>7} {'peak RSS':>8}"
    )

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}s"

    for o in outcomes:
        print(
            f"{o.variant:<13} {o.machines:>8} {o.concurrency:>9} {o.seconds:>6.1f}s {o.machines / o.seconds:>6.1f} "
            f"{seconds(o.p50):>6} {seconds(o.p99):>6} {o.failed_attempts:>6} "
            f"{o.cpu_process:>7.1f}s {o.cpu_agents:>6.1f}s {o.peak_rss_mib:>5.0f}MiB"
        )
    raw, *temporal = outcomes
    for shepherd in temporal:
        name = shepherd.variant
        print(
            f"{name} took {shepherd.seconds / raw.seconds:.2f}x raw asyncssh's time; CPU of the process a machine:"
            f" {shepherd.cpu_process / shepherd.machines * 1e3:.0f} ms against"
            f" {raw.cpu_process / raw.machines * 1e3:.0f} ms (both ends of SSH and the provider API are in it)"
        )
        print(
            f"beside {name}, on the same cores: the Temporal server"
            f" {shepherd.cpu_temporal / shepherd.machines * 1e3:.0f} ms a machine, PostgreSQL"
            f" {shepherd.cpu_postgres / shepherd.machines * 1e3:.0f} ms; the agents"
            f" {shepherd.cpu_agents / shepherd.machines * 1e3:.0f} ms"
            f" (raw: {raw.cpu_agents / raw.machines * 1e3:.0f} ms)"
        )
        # Part 3 of the performance goals, as CPU, which holds on any host: the process at most 3.5 times raw's a
        # bring-up, the Temporal server at most 2.5 times raw's process.
        raw_ms = raw.cpu_process / raw.machines * 1e3
        process_ms = shepherd.cpu_process / shepherd.machines * 1e3
        server_ms = shepherd.cpu_temporal / shepherd.machines * 1e3
        print(
            f"{name} CPU a bring-up against raw asyncssh's {raw_ms:.1f} ms a takeover: the process {process_ms:.1f} ms"
            f" ({process_ms / raw_ms:.2f}x, goal 3.5x), the Temporal server {server_ms:.1f} ms"
            f" ({server_ms / raw_ms:.2f}x, goal 2.5x)"
        )
        print(f"{name}: {shepherd.eager_started} of {shepherd.machines} started eagerly")
    print(
        f"eager workflow start {'asked' if args.eager_start else 'not asked'}; dev server dynamic config:"
        f" {', '.join(args.dynamic_config) or 'its defaults'}"
    )


def add_dynamic_config_option(parser: argparse.ArgumentParser) -> None:
    """--dynamic-config KEY=VALUE, repeatable: a dynamic config value of the Temporal dev server to start."""
    parser.add_argument(
        "--dynamic-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dynamic config value of the Temporal dev server (VALUE in JSON); repeatable",
    )


def dev_server_arguments(dynamic_config: Sequence[str]) -> list[str]:
    """The dev server's command-line arguments for these --dynamic-config values."""
    return [arg for value in dynamic_config for arg in ("--dynamic-config-value", value)]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bringup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=DEFAULTS.max_concurrent_activities)
    parser.add_argument(
        "--variant", choices=["raw", "shepherd", "merged"], help="run one variant here and print it as JSON"
    )
    parser.add_argument(
        "--merged",
        action="store_true",
        help="run the merged variant too: provisioning and the agent start as one activity (a design option)",
    )
    parser.add_argument(
        "--eager-start", action="store_true", help="ask for each workflow's first task in its start response"
    )
    add_dynamic_config_option(parser)
    args = parser.parse_args()
    if args.machines < 1 or args.concurrency < 1:
        parser.error("--machines and --concurrency must be at least 1")
    if args.variant:
        print(json.dumps(asdict(run_variant(args))))
        return
    outcomes = []
    with tempfile.TemporaryDirectory() as bytecode:
        # As installed by pip, which compiles: without bytecode the workflow sandbox would compile the workflow
        # module at every run, which is no production worker's cost (the worker warns about it at start).
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        environment["PYTHONPYCACHEPREFIX"] = bytecode
        for variant in ("raw", "shepherd", "merged")[: 3 if args.merged else 2]:
            command = [sys.executable, "-m", "bench.bringup", "--machines", str(args.machines)]
            command += ["--concurrency", str(args.concurrency), "--variant", variant]
            command += ["--eager-start"] * args.eager_start
            command += [arg for value in args.dynamic_config for arg in ("--dynamic-config", value)]
            completed = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env=environment)
            outcomes.append(Outcome(**json.loads(completed.stdout.strip().splitlines()[-1])))
    report(outcomes, args)


if __name__ == "__main__":
    main()
