"""Benchmark: bringing Ironic nodes up to WATCHING at the provider instance's rate limit, Shepherd against the floor.

Starts OpenStack Ironic standalone (SQLite, one process, as the tests run it) with --nodes fake-hardware nodes
available, and the simulator with as many machines (their asyncssh servers in this process). Each node's
extra/ssh_address points at one machine, which lets Shepherd's key in as the deployed OS would once the config drive
gave it the key. The agent is the reference agent built without heartbeats: it answers the takeover and exits.
Then --rounds of each variant, taking turns, the order swapped every round; before each, untimed, every node is
undeployed back to available and Shepherd's marks on it removed, so every round starts from the same Ironic.

raw       a script, each node's steps through one limiter of --rate starts a second (evenly spaced, in the order
          asked) and at most --concurrency at once: the claim (PATCH of instance_uuid, Shepherd's marks and the
          image) with the deploy (the same config drive) as one step; reading the node, on provisioning's back-off,
          until Ironic has it active, a step each; the takeover with asyncssh alone (bench.bringup's: SFTP upload,
          run, read the answer) as the last. Those are the steps Shepherd's provider activities take. openstacksdk
          for Ironic, as an operator's script would use it.
shepherd  each node admitted to BMDB (untimed), then its MachineWorkflow started on a Temporal dev server and run
          by the production worker: its provider instance has activities_per_second = --rate (Temporal's limit,
          kept by the server) and the worker --concurrency activity slots. Provisioning claims and deploys the node,
          then asks again on its back-off until Ironic has it active; the takeover follows. Each round is a
          provider instance of its own (round1, round2, ...), so its BMDB rows and workflows are new.

Both look at a deploy on the same back-off: 1 s after it was asked for, then 1.2 times longer after each look that
found it under way, at most 5 s (the benchmark's provisioning back-off: fake hardware deploys in about a second; a
real deploy takes minutes, and the production back-off is a minute). Timed from the first step until every node is
taken over (raw) or every workflow shows WATCHING (shepherd, polled every 0.2 s). Beside the wall time: the CPU of
this process (the worker or the script, both ends of SSH), of the agents, Ironic, the Temporal server and
PostgreSQL, and from Ironic's log the calls of each variant with Ironic's own time answering them.

--dynamic-config KEY=VALUE (repeatable) starts the Temporal dev server with that dynamic config: with
matching.numTaskqueueReadPartitions=1 and matching.numTaskqueueWritePartitions=1 every task queue has one partition,
which keeps the provider queue's whole rate limit in one place instead of a share in each of four. Run:

    python -m bench.ironic_bringup [--nodes 50] [--rate 2] [--concurrency 200] [--rounds 3]
        [--dynamic-config KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncssh
import openstack.exceptions
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.deps import open_activity_deps
from activities.fleet import each_at_most
from activities.workflow_start import start_machine_workflow
from agent.build import build_agent_executable
from bench.bringup import (
    ENDPOINT,
    START_CONCURRENCY,
    add_dynamic_config_option,
    dev_server_arguments,
    raise_file_limit,
    raw_takeover,
)
from bench.ironic_nodes import enroll_available, in_parallel, provider_options, script_connection
from bench.stack_cpu import CpuTimes, StackCpu
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import MACHINE_STAGE, SEARCH_ATTRIBUTES, MachineStage, running_machines_of
from lifecycle.machine_state import Backoff
from processes.worker import serving
from proto import takeover_pb2
from providers.sim import SimProvider
from providers.ssh_address import parse_ssh_address
from shepherd.commands.dev_stack.children import temporal_cli
from simulator import Simulator, SimulatorConfig
from tests.ironic_fixtures import Ironic, running_ironic

DEFAULTS = Settings()
# The benchmark's provisioning and agent-start back-off, in both variants.
BACKOFF = Backoff(initial=1.0, maximum=5.0, multiplier=DEFAULTS.provision_backoff_multiplier)
PROGRESS_POLL = 0.2
LIMIT_SECONDS = 1800.0
IMAGE = "http://127.0.0.1:9/os.qcow2"
# Ironic's log line of a request it answered: method, path, status and its own time to answer.
REQUEST_LOGGED = re.compile(r" - (GET|PATCH|PUT|POST|DELETE) (/v1/\S*) - \d{3} \(([0-9.]+)ms\)")
# The calls both variants make, by the method and path of their log lines.
IRONIC_CALLS = {
    "claims": re.compile(r"PATCH /v1/nodes/[^/]+"),
    "deploys": re.compile(r"PUT /v1/nodes/[^/]+/states/provision"),
    "reads": re.compile(r"GET /v1/nodes/[^/]+"),
}
# Shepherd's activity retries within one attempt, for blips; the script tries as often, as far apart.
BLIP_TRIES = 3

T = TypeVar("T")


@dataclass(frozen=True)
class Round:
    """A variant's round, set up: run is what is timed; failures, asked after it, are the attempts that failed and
    were made again, each its error (the script's blips, Shepherd's failed takeovers)."""

    run: Callable[[], Awaitable[None]]
    failures: Callable[[], Awaitable[list[str]]]


@dataclass
class Measured:
    """One round of one variant: its wall seconds, the stack's CPU over it, its calls as Ironic logged them, and its
    failed attempts."""

    seconds: float
    cpu: CpuTimes
    # By kind: how many, and Ironic's seconds answering them, summed.
    calls: dict[str, tuple[int, float]]
    failures: list[str]


@dataclass(frozen=True)
class Machines:
    """What both variants bring up: the Ironic nodes, the key the machines behind them trust, the agent."""

    nodes: list[str]
    key: asyncssh.SSHKey
    agent_path: Path


class RateLimit:
    """At most rate starts a second, evenly spaced, in the order they are asked for."""

    def __init__(self, rate: float) -> None:
        self.interval = 1 / rate
        self.next_start = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        start = max(now, self.next_start)
        self.next_start = start + self.interval
        await asyncio.sleep(start - now)


class Script:
    """The raw variant: a script's bring-up of every node, each step through one rate limit and one concurrency."""

    def __init__(self, connection: Any, machines: Machines, rate: float, concurrency: int) -> None:
        self.connection = connection
        self.machines = machines
        self.limit = RateLimit(rate)
        self.slots = asyncio.Semaphore(concurrency)
        self.public_key = public_key_openssh(machines.key)
        self.agent = machines.agent_path.read_bytes()
        self.blips: list[str] = []

    async def step(self, act: Callable[[], Awaitable[T]]) -> T:
        """One step: a slot, then its turn at the rate; tried again on a blip (no answer, a 5xx), each try a turn of
        its own. openstacksdk waits out a node's lock itself."""
        async with self.slots:
            for attempt in range(1, BLIP_TRIES + 1):
                await self.limit.wait()
                try:
                    return await act()
                except openstack.exceptions.HttpException as error:
                    if attempt == BLIP_TRIES or (error.status_code or 500) < 500:
                        raise
                    self.blips.append(str(error))
                await asyncio.sleep(1)
        raise AssertionError("unreachable")

    async def bring_up(self, node: str) -> None:
        """Claim and deploy the node, read it until active, take the machine behind it over."""
        instance = str(uuid.uuid4())
        await self.step(lambda: asyncio.to_thread(self._claim_and_deploy, node, instance))
        looks = 0
        while True:
            looks += 1
            await asyncio.sleep(BACKOFF.delay(looks))
            found = await self.step(lambda: asyncio.to_thread(self.connection.baremetal.get_node, node))
            if found.provision_state == "active":
                break
            if found.provision_state not in ("deploying", "wait call-back"):
                raise RuntimeError(f"node {node} is {found.provision_state}: {found.last_error}")
        host, port = parse_ssh_address(found.extra["ssh_address"], f"node {node}'s extra/ssh_address")
        init = takeover_pb2.TakeoverInit(machine_id=str(uuid.uuid4()), endpoint=ENDPOINT)
        await self.step(lambda: raw_takeover(host, port or 22, self.machines.key, self.agent, init))

    def _claim_and_deploy(self, node: str, instance: str) -> None:
        claim = [
            {"op": "add", "path": "/instance_uuid", "value": instance},
            {"op": "add", "path": "/extra/shepherd_provider", "value": "script"},
            {"op": "add", "path": "/extra/shepherd_instance_uuid", "value": instance},
            {"op": "add", "path": "/instance_info/image_source", "value": IMAGE},
        ]
        self.connection.baremetal.patch_node(node, claim)
        drive = {"meta_data": {"uuid": instance, "hostname": node, "public_keys": {"shepherd": self.public_key}}}
        self.connection.baremetal.set_node_provision_state(node, "active", config_drive=drive)


@asynccontextmanager
async def raw_round(connection: Any, machines: Machines, rate: float, concurrency: int) -> AsyncIterator[Round]:
    """The raw variant's round."""
    script = Script(connection, machines, rate, concurrency)

    async def bring_up() -> None:
        await asyncio.gather(*(script.bring_up(node) for node in machines.nodes))

    async def failures() -> list[str]:
        return script.blips

    yield Round(bring_up, failures)


@asynccontextmanager
async def shepherd_round(
    client: Client, ironic: Ironic, machines: Machines, tmp: Path, url: str, round_: int, rate: float, concurrency: int
) -> AsyncIterator[Round]:
    """The shepherd variant's round, set up: its provider instance, BMDB's admissions, the worker polling."""
    name = f"round{round_}"
    options = provider_options(ironic) | {"image_source": IMAGE, "ssh_user": "root"}
    settings = Settings(
        task_queue=f"bench-ironic-{name}",
        state_dir=tmp / "state",
        providers=(ProviderInstance(name, "ironic", options, activities_per_second=rate),),
        ssh_key_path=tmp / "ssh_key",
        agent_executable_path=machines.agent_path,
        agent_endpoint=ENDPOINT,
        max_concurrent_activities=concurrency,
        agent_start_backoff_initial=BACKOFF.initial,
        agent_start_backoff_maximum=BACKOFF.maximum,
        provision_backoff_initial=BACKOFF.initial,
        provision_backoff_maximum=BACKOFF.maximum,
    )
    watching = f'{running_machines_of(name)} AND {MACHINE_STAGE.name} = "{MachineStage.WATCHING}"'
    deps = await open_activity_deps(settings, client, url)
    try:
        admitted = [(node, (await deps.bmdb.admit_machine(name, node))[0]) for node in machines.nodes]

        async def start(node_and_machine: tuple[str, uuid.UUID]) -> bool:
            node, machine_id = node_and_machine
            return await start_machine_workflow(client, settings, name, node, str(machine_id))

        async def bring_up() -> None:
            started = time.perf_counter()
            await each_at_most(admitted, START_CONCURRENCY, start)
            while (await client.count_workflows(watching)).count < len(admitted):
                if time.perf_counter() - started > LIMIT_SECONDS:
                    raise RuntimeError(f"not every machine WATCHING within {LIMIT_SECONDS:.0f}s")
                await asyncio.sleep(PROGRESS_POLL)

        async def failures() -> list[str]:
            events = [event for _, machine_id in admitted for event in await deps.bmdb.list_events(machine_id)]
            return [event.detail for event in events if event.kind == "agent_start_failed"]

        async with serving(client, deps):
            yield Round(bring_up, failures)
    finally:
        await deps.close()


def ironic_calls(log: Path, since: int) -> dict[str, tuple[int, float]]:
    """The calls of each kind in Ironic's log after byte since: how many, and Ironic's seconds answering them."""
    with log.open("rb") as lines:
        lines.seek(since)
        logged = [REQUEST_LOGGED.search(line) for line in lines.read().decode(errors="replace").splitlines()]
    calls = {kind: (0, 0.0) for kind in IRONIC_CALLS}
    for found in filter(None, logged):
        request = f"{found[1]} {found[2]}"
        for kind, pattern in IRONIC_CALLS.items():
            if pattern.fullmatch(request):
                count, seconds = calls[kind]
                calls[kind] = (count + 1, seconds + float(found[3]) / 1000)
    return calls


def release_all(ironic: Ironic, nodes: list[str]) -> None:
    """Every node undeployed back to available, without the marks of whoever claimed it."""

    def release(node: str) -> None:
        if ironic.node(node)["provision_state"] != "available":
            ironic.api("PUT", f"/nodes/{node}/states/provision", {"target": "deleted"})
            ironic.wait_for(node, "available", timeout=120)
        marks = [key for key in ("shepherd_provider", "shepherd_instance_uuid") if key in ironic.node(node)["extra"]]
        if marks:
            ironic.api("PATCH", f"/nodes/{node}", [{"op": "remove", "path": f"/extra/{key}"} for key in marks])

    in_parallel(release, nodes)


async def set_up(ironic: Ironic, sim: Simulator, key: asyncssh.SSHKey, count: int) -> list[str]:
    """A simulated machine for each node that trusts the key, and the nodes pointing at them, available."""
    provider = SimProvider(sim.api_url)
    try:
        public_key = public_key_openssh(key)
        made = [await provider.create_machine(slot, str(uuid.uuid4()), public_key) for slot in sim.slots]
    finally:
        await provider.close()
    addresses = [f"{machine.address}:{machine.ssh_port}" for machine in made]
    return await asyncio.to_thread(enroll_available, ironic, count, extra_of=lambda n: {"ssh_address": addresses[n]})


async def measure(
    ironic: Ironic, tmp: Path, url: str, args: argparse.Namespace
) -> tuple[dict[str, list[Measured]], float]:
    """Every round of both variants, and the seconds it took to make the machines and the nodes."""
    key = load_or_create_ssh_key(tmp / "ssh_key")
    agent_path = build_agent_executable(tmp / "agent", heartbeats=False)
    sim = Simulator(SimulatorConfig(machines=args.nodes, state_dir=tmp / "sim", api_port=0))
    await sim.start()
    environment = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        data_converter=DATA_CONVERTER,
        dev_server_extra_args=dev_server_arguments(args.dynamic_config),
    )
    connection = script_connection(ironic)
    results: dict[str, list[Measured]] = {"raw": [], "shepherd": []}
    try:
        started = time.perf_counter()
        machines = Machines(await set_up(ironic, sim, key, args.nodes), key, agent_path)
        setup = time.perf_counter() - started
        cpu = StackCpu.of(ironic.process.pid, tmp / "pg")
        for round_ in range(1, args.rounds + 1):
            for variant in ("raw", "shepherd") if round_ % 2 else ("shepherd", "raw"):
                await asyncio.to_thread(release_all, ironic, machines.nodes)
                if variant == "raw":
                    variant_round = raw_round(connection, machines, args.rate, args.concurrency)
                else:
                    variant_round = shepherd_round(
                        environment.client, ironic, machines, tmp, url, round_, args.rate, args.concurrency
                    )
                async with variant_round as timed:
                    logged = ironic.log.stat().st_size
                    before, started = cpu.read(), time.perf_counter()
                    await timed.run()
                    took, used = time.perf_counter() - started, cpu.read() - before
                    calls = ironic_calls(ironic.log, logged)
                    failures = await timed.failures()
                results[variant].append(Measured(took, used, calls, failures))
                made = ", ".join(f"{count} {kind} ({answering:.1f}s)" for kind, (count, answering) in calls.items())
                print(
                    f"round {round_}, {variant}: {took:.1f}s; Ironic answered {made}; {len(failures)} failed attempts"
                )
                # By what went wrong, the machine and its address left out.
                for failure, count in Counter(failure.rpartition(" failed: ")[2] for failure in failures).most_common():
                    print(f"  {count} x {failure}")
    finally:
        connection.close()
        await environment.shutdown()
        await sim.stop()
    return results, setup


def report(results: dict[str, list[Measured]], args: argparse.Namespace, setup: float) -> None:
    """Each variant's times and CPU, its Ironic calls, and Shepherd's ratio to the script's, round by round."""
    steps = 3 * args.nodes
    print(
        f"{args.nodes} Ironic nodes to WATCHING at {args.rate:g} provider steps a second, {args.concurrency} at once;"
        f" {len(results['raw'])} rounds taking turns ({setup:.0f}s to make the nodes and machines, untimed)."
        f" At least {steps} steps (claim and deploy, one read, the takeover), {steps / args.rate:.1f}s at the rate."
    )
    print(f"  Temporal dev server's dynamic config: {', '.join(args.dynamic_config) or 'its defaults'}")
    print("  variant    rounds (s)            median   CPU a node: here, agents, Ironic, Temporal, PostgreSQL")
    for name, runs in results.items():
        walls = [run.seconds for run in runs]

        def per_node(of: str, runs: list[Measured] = runs) -> float:
            return statistics.median(getattr(run.cpu, of) for run in runs) / args.nodes * 1000

        cpu = ", ".join(f"{per_node(of):.0f}" for of in ("here", "agents", "ironic", "temporal", "postgres"))
        calls = ", ".join(
            f"{statistics.median(run.calls[kind][0] for run in runs):g} {kind}"
            f" ({statistics.median(run.calls[kind][1] for run in runs):.1f}s)"
            for kind in IRONIC_CALLS
        )
        print(
            f"  {name:9}  {', '.join(f'{wall:.1f}' for wall in walls):20}  {statistics.median(walls):5.1f}s  {cpu} ms;"
            f" Ironic answered (median) {calls}; failed attempts {', '.join(str(len(run.failures)) for run in runs)}"
        )
    ratios = [s.seconds / r.seconds for s, r in zip(results["shepherd"], results["raw"], strict=True)]
    print(f"  shepherd / raw, round by round: {', '.join(f'{ratio:.2f}' for ratio in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ironic_bringup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--rate", type=float, default=2.0, help="the provider instance's activities_per_second")
    parser.add_argument("--concurrency", type=int, default=DEFAULTS.max_concurrent_activities)
    parser.add_argument("--rounds", type=int, default=3)
    add_dynamic_config_option(parser)
    args = parser.parse_args()
    if args.nodes < 1 or args.rounds < 1 or args.concurrency < 1 or args.rate <= 0:
        parser.error("--nodes, --rounds and --concurrency must be at least 1, --rate above 0")
    # Every node's first provisioning attempt ends "no address yet", by design: the SDK would log each as a warning
    # with its traceback. The takeovers that failed are printed from BMDB's events instead.
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    raise_file_limit()
    with tempfile.TemporaryDirectory(prefix="bench-ironic-") as tmp_name:
        tmp = Path(tmp_name)
        with running_ironic(tmp / "ironic") as ironic, LocalPostgres(tmp / "pg") as url:
            migrate.upgrade(url)
            results, setup = asyncio.run(measure(ironic, tmp, url, args))
    report(results, args, setup)


if __name__ == "__main__":
    main()
