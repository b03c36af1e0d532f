"""Benchmark: a rack back after a power loss, Shepherd against its floor.

Shepherd  the stack of bench.chaos (Temporal dev server, PostgreSQL, the
          simulator, the heartbeat server and a worker, separate processes on
          free loopback ports), its one provider instance limited to
          --activities-per-second (default: --rate). --machines machines come
          up and heartbeat; then every agent is killed at once through the
          simulator's admin API, as a rack losing power leaves its machines
          silent. The watchdog's circuit breaker must hold the recoveries
          (nothing rebooted while held); once a pass has held all of them
          silent, `shepherd fleet --release-recoveries` releases them, and
          the time runs from the release BMDB records until every machine is
          WATCHING (Temporal visibility) with an agent started and heard from
          since the release (BMDB), polled every POLL seconds; and, beside it,
          until every machine is WATCHING with a new agent started, heard
          from or not.
floor     in the same run, while the stack idles with its fleet heartbeating,
          once before the storm and once after Shepherd's recovery:
          a simulator of its own, in this process, with as many machines and
          the same boot time; a raw script reboots them through its API at
          --rate reboots a second, waits for each machine's SSH port to
          answer (polled every FLOOR_POLL seconds), and takes it over with
          bench.bringup's raw asyncssh takeover, at most the worker's activity
          slots at once, starting the same agent as Shepherd's, which starts
          its daemon and heartbeats to a server in this process that accepts
          every heartbeat. Timed from the first reboot until the last new
          agent was heard from, and until the last takeover answered; each
          ratio is Shepherd's time to the mean of the two floors' same end.
          A machine whose agent was heard from is powered off (its agent
          stopped, its /tmp emptied) within FLOOR_STOP_HEARD_EVERY seconds,
          as the floor needs it no more: the host holds one fleet's agents,
          the stack's, not two (an agent holds about 26 MiB, and unpacks
          about 20 MiB on disk). Spared its agents' heartbeats, the floor
          can only be quicker: the ratio is not flattered.

Then the damage the storm did: machines rebooted more than once (the
simulator's count from the kill to the end, and BMDB's `rebooted` events
since the kill), reimaged or quarantined (BMDB events), and where Shepherd's time went
(from BMDB's events: the release, the first heartbeat_lost, the first and last
reboot, the last agent start). Run (10 to 13 minutes for 200 machines at 3 a
second on two cores; 33 for 600 at 1.5 on two cores and 24 GiB, docs/benchmarks.md):

    python -m bench.mass_recovery [--machines 200] [--rate 3] [--activities-per-second R] [--workers N]
        [--dynamic-config KEY=VALUE ...] [--json] [--keep]

--workers runs that many worker processes on the same task queues, as an
operator adds workers where one process's CPU is the limit.

--dynamic-config starts the Temporal dev server with that dynamic config; with
matching.numTaskqueueReadPartitions=1 and matching.numTaskqueueWritePartitions=1
the provider's queue dispatches at its rate limit rather than below it, as
docs/providers.md advises where a provider's rate must be met closely.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import aiohttp
import asyncssh
import grpc
from temporalio.service import RPCError, RPCStatusCode

from agent.build import build_agent_executable
from bench.agent import AcceptingServer, throwaway_tls
from bench.bringup import add_dynamic_config_option, dev_server_arguments, raise_file_limit, raw_takeover
from bench.chaos import PROVIDER, SIM_BOOT_SECONDS, WATCHING, ChaosError, Stack, positive, run_on_stack
from bench.chaos import Options as StackOptions
from foundation.provider_instances import ProviderInstance
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from lifecycle.contracts import MACHINE_STAGE, RUNNING_MACHINES
from operations.machine_reads import machine_stages
from proto import agent_api_pb2, agent_api_pb2_grpc, takeover_pb2
from providers import ProviderMachine
from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig
from simulator.machine import power_off

POLL = 0.5
FLOOR_POLL = 0.1
PROGRESS_EVERY = 10.0
CALL_TIMEOUT = 10.0
KILLS_IN_FLIGHT = 50
# The heartbeat interval the floor's heartbeat server asks for, as the stack's does.
FLOOR_HEARTBEAT_EVERY = 5.0
# How often the floor powers off the machines whose agents it has heard from since, in one look at /proc.
FLOOR_STOP_HEARD_EVERY = 5.0
RELEASE_REASON = "the rack's power is back"
STORM_KINDS = ("rebooted", "reimaged", "quarantined")
SQL_REBOOTED = "SELECT count(*) FROM events WHERE kind = 'rebooted'"
# What Temporal answers while it is too busy to answer in time.
BUSY = (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.UNAVAILABLE, RPCStatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class Options:
    machines: int
    rate: float
    activities_per_second: float
    heartbeat_timeout: float
    reconcile_interval: float
    limit: float
    # Dynamic config values of the Temporal dev server, KEY=VALUE.
    dynamic_config: tuple[str, ...] = ()
    workers: int = 1

    def stack(self) -> StackOptions:
        """bench.chaos's options for the same fleet and timings, without its faults."""
        return StackOptions(
            machines=self.machines,
            seed=0,
            worker_kills=0,
            heartbeat_timeout=self.heartbeat_timeout,
            reconcile_interval=self.reconcile_interval,
            margin=0.0,
            after_outage=self.limit,
            bringup_limit=self.limit,
        )


@dataclass
class Damage:
    """What the storm did to the machines beyond one reboot each."""

    rebooted: int = 0
    rebooted_twice: list[str] = field(default_factory=list)
    reimaged: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    never_rebooted: list[str] = field(default_factory=list)


def storm_damage(slots: Sequence[str], reboots: Mapping[str, int], events: Sequence[tuple[str, str]]) -> Damage:
    """The damage from the provider's reboot count of each slot and BMDB's (provider id, kind) events of the storm.

    A slot counts as rebooted twice when either side saw two reboots: the provider's count misses none that
    reached it, BMDB's events none that Shepherd recorded.
    """
    recorded = Counter(provider_id for provider_id, kind in events if kind == "rebooted")
    twice = sorted(s for s in slots if max(reboots.get(s, 0), recorded.get(s, 0)) > 1)
    return Damage(
        rebooted=sum(1 for s in slots if reboots.get(s, 0) >= 1),
        rebooted_twice=twice,
        reimaged=sorted({p for p, kind in events if kind == "reimaged"}),
        quarantined=sorted({p for p, kind in events if kind == "quarantined"}),
        never_rebooted=sorted(s for s in slots if reboots.get(s, 0) == 0),
    )


@dataclass
class Floor:
    # From the first reboot until the last new agent was heard from.
    seconds: float = 0.0
    # From the first reboot until the last takeover answered.
    answered_seconds: float = 0.0
    failures: int = 0
    # Processes of the floor's agents stopped by powering their machines off once heard from (each agent is two:
    # its one-file executable's bootloader and the interpreter under it).
    agent_processes_stopped: int = 0
    damage: Damage = field(default_factory=Damage)


@dataclass
class Phases:
    """Seconds from the release to each step of Shepherd's recovery, from BMDB's clock."""

    first_signal: float | None = None
    first_reboot: float | None = None
    last_reboot: float | None = None
    last_agent_start: float | None = None
    # Takeover attempts that failed (agent_start_failed): each waits out the agent-start back-off.
    takeovers_failed: int = 0


@dataclass
class Report:
    machines: int
    rate: float
    activities_per_second: float
    concurrency: int
    boot_seconds: float
    heartbeat_timeout: float
    reconcile_interval: float
    dynamic_config: list[str] = field(default_factory=list)
    workers: int = 1
    bringup_seconds: float = 0.0
    # BMDB's `rebooted` events before the agents were killed: none on a host that keeps up.
    rebooted_before_storm: int = 0
    hold_after_kill: float | None = None
    hold_reason: str = ""
    rebooted_while_held: int = 0
    shepherd_seconds: float | None = None
    # Until every machine was WATCHING with a new agent started, heard from or not.
    watching_seconds: float | None = None
    phases: Phases = field(default_factory=Phases)
    damage: Damage = field(default_factory=Damage)
    # The floor measured before the storm and after Shepherd's recovery.
    floors: list[Floor] = field(default_factory=list)
    not_back: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def floor_seconds(self) -> float | None:
        """The mean of the floors' times until the last new agent was heard from."""
        return mean([floor.seconds for floor in self.floors])

    @property
    def ratio(self) -> float | None:
        return ratio_to(self.shepherd_seconds, self.floor_seconds)

    @property
    def floor_answered_seconds(self) -> float | None:
        """The mean of the floors' times until the last takeover answered."""
        return mean([floor.answered_seconds for floor in self.floors])

    @property
    def watching_ratio(self) -> float | None:
        """Shepherd's time until every machine was WATCHING to the floor's until every takeover answered."""
        return ratio_to(self.watching_seconds, self.floor_answered_seconds)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio_to(shepherd: float | None, floor: float | None) -> float | None:
    """Shepherd's time to the floor's, when both were measured."""
    return None if shepherd is None or not floor else shepherd / floor


async def wait_for_ssh(address: str, port: int, limit: float) -> None:
    """Until the port accepts a connection, tried every FLOOR_POLL seconds; ChaosError after limit seconds."""
    deadline = time.monotonic() + limit
    while True:
        try:
            _, writer = await asyncio.open_connection(address, port)
        except OSError:
            if time.monotonic() > deadline:
                raise ChaosError(f"{address}:{port} did not answer within {limit:.0f}s of its reboot") from None
            await asyncio.sleep(FLOOR_POLL)
            continue
        writer.close()
        await writer.wait_closed()
        return


def floor_keys_and_agent(root: Path) -> tuple[asyncssh.SSHKey, bytes]:
    """The floor's SSH key and its agent, the same as Shepherd's: it answers the takeover, then starts its daemon,
    which heartbeats."""
    root.mkdir(parents=True)
    key = load_or_create_ssh_key(root / "ssh_key")
    return key, build_agent_executable(root / "agent").read_bytes()


class FirstHeartbeats(AcceptingServer):
    """The floor's heartbeat server: accepts every heartbeat, and tells when each machine's agent was first heard."""

    def __init__(self) -> None:
        super().__init__(FLOOR_HEARTBEAT_EVERY)
        self.heard: dict[str, asyncio.Event] = {}

    def first(self, machine_id: str) -> asyncio.Event:
        """Set once the machine's agent is first heard from."""
        return self.heard.setdefault(machine_id, asyncio.Event())

    def _accept(self, request: agent_api_pb2.HeartbeatRequest) -> agent_api_pb2.HeartbeatResponse:
        self.first(request.machine_id).set()
        return super()._accept(request)


async def measure_floor(root: Path, options: Options, concurrency: int, limit: float) -> Floor:
    """The raw script: reboots at options.rate, the boot, the takeovers at most concurrency at once, and each new
    agent's first heartbeat."""
    key, agent = await asyncio.to_thread(floor_keys_and_agent, root)
    credentials, ca_der = throwaway_tls()
    heartbeats = FirstHeartbeats()
    server = grpc.aio.server()
    agent_api_pb2_grpc.add_AgentCallbackServicer_to_server(heartbeats, server)
    endpoint = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', credentials)}"
    await server.start()
    sim = Simulator(
        SimulatorConfig(machines=options.machines, state_dir=root / "sim", api_port=0, boot_seconds=SIM_BOOT_SECONDS)
    )
    await sim.start()
    provider = SimProvider(sim.api_url)
    floor = Floor()
    answered: list[float] = []
    heard: list[float] = []
    heard_slots: list[str] = []

    async def power_off_heard() -> None:
        machines = [sim.machines[slot] for slot in heard_slots if slot in sim.machines]
        heard_slots.clear()
        if machines:
            floor.agent_processes_stopped += await asyncio.to_thread(power_off, machines)

    async def power_off_heard_every_while() -> None:
        while True:
            await asyncio.sleep(FLOOR_STOP_HEARD_EVERY)
            await power_off_heard()

    stopper = asyncio.create_task(power_off_heard_every_while())
    try:
        created = [
            await provider.create_machine(slot, str(uuid.uuid4()), public_key_openssh(key)) for slot in sim.slots
        ]
        takeovers = asyncio.Semaphore(concurrency)
        started = time.perf_counter()

        async def recover(index: int, machine: ProviderMachine) -> None:
            await asyncio.sleep(max(0.0, started + index / options.rate - time.perf_counter()))
            await provider.reboot_machine(machine.provider_id)
            await wait_for_ssh(machine.address or "", machine.ssh_port, limit)
            machine_id = str(uuid.uuid4())
            init = takeover_pb2.TakeoverInit(machine_id=machine_id, endpoint=endpoint, ca_certificates=[ca_der])
            async with takeovers:
                try:
                    await raw_takeover(machine.address or "", machine.ssh_port, key, agent, init)
                except (OSError, RuntimeError) as error:
                    print(f"floor: takeover of {machine.provider_id} failed: {error}", file=sys.stderr)
                    floor.failures += 1
                    return
            answered.append(time.perf_counter())
            try:
                await asyncio.wait_for(heartbeats.first(machine_id).wait(), limit)
            except TimeoutError:
                print(f"floor: the agent of {machine.provider_id} was not heard from", file=sys.stderr)
                floor.failures += 1
                return
            heard.append(time.perf_counter())
            heard_slots.append(machine.provider_id)

        await asyncio.gather(*(recover(index, machine) for index, machine in enumerate(created)))
        stopper.cancel()
        await power_off_heard()
        floor.seconds = round(max(heard, default=started) - started, 1)
        floor.answered_seconds = round(max(answered, default=started) - started, 1)
        floor.damage = storm_damage(sim.slots, sim.reboots, [])
    finally:
        stopper.cancel()
        await provider.close()
        # The machines' shutdown ends their agents, which would heartbeat on.
        await sim.stop()
        await server.stop(None)
    return floor


class MassRecovery:
    """The benchmark's Shepherd side, with the floor run while its fleet idles."""

    def __init__(self, stack: Stack, options: Options) -> None:
        self.stack = stack
        self.options = options
        self.say = stack.say
        self.report = Report(
            machines=options.machines,
            rate=options.rate,
            activities_per_second=options.activities_per_second,
            concurrency=0,
            boot_seconds=SIM_BOOT_SECONDS,
            heartbeat_timeout=options.heartbeat_timeout,
            reconcile_interval=options.reconcile_interval,
            dynamic_config=list(options.dynamic_config),
            workers=options.workers,
        )

    async def run(self) -> Report:
        await self.stack.start()
        self.report.concurrency = self.stack.settings.max_concurrent_activities
        self.report.bringup_seconds = await self.bring_up()
        # Before and after Shepherd's recovery, on the same idle stack: a load that comes and goes on the host
        # shows as two floors apart.
        self.report.floors.append(await self.floor("floor-before"))
        # The floor loads the host: whatever it made late (a heartbeat, a recovery) is over before the storm.
        await self.bring_up()
        self.report.rebooted_before_storm = int((await self.stack.sql(SQL_REBOOTED))[0][0])
        reboots_before = await self.provider_reboots()
        killed_at = await self.kill_agents()
        await self.wait_for_hold(killed_at)
        released_at = await self.release()
        await self.wait_until_back(released_at)
        await self.measure(killed_at, released_at, reboots_before)
        self.report.floors.append(await self.floor("floor-after"))
        self.report.wall_seconds = round(time.monotonic() - self.stack.started, 1)
        return self.report

    def slots(self) -> list[str]:
        """The stack simulator's slots, all of them machines once the fleet is up."""
        return SimulatorConfig(machines=self.options.machines, state_dir=self.stack.root).slot_ids()

    async def floor(self, name: str) -> Floor:
        self.say(f"floor: {self.options.machines} reboots at {self.options.rate:g}/s, boots and raw takeovers")
        floor = await measure_floor(self.stack.root / name, self.options, self.report.concurrency, self.options.limit)
        self.say(f"floor: {floor.seconds:.1f}s ({floor.answered_seconds:.1f}s to the last takeover answered)")
        return floor

    async def counts(self, since: datetime | None = None) -> tuple[int, int, int, int]:
        """Machines WATCHING (Temporal visibility), with a fresh heartbeat, with an agent started and heard from since
        the moment given, and with an agent started since then, heard from or not (BMDB)."""
        watching = await self.watching()
        rows = await self.stack.sql(
            """
            SELECT
              (SELECT count(*) FROM machine_agent_heartbeat
                WHERE agent_heartbeat_at > now() - make_interval(secs => %(timeout)s)),
              (SELECT count(*) FROM machine_agent_started a JOIN machine_agent_heartbeat h USING (machine_id)
                WHERE a.agent_started_at >= %(since)s AND h.agent_heartbeat_at >= a.agent_started_at),
              (SELECT count(*) FROM machine_agent_started WHERE agent_started_at >= %(since)s)
            """,
            {"timeout": self.options.heartbeat_timeout, "since": since or datetime.now().astimezone()},
        )
        fresh, back, started = (int(n) for n in rows[0])
        return watching, fresh, back, started

    async def watching(self) -> int:
        """Machines WATCHING, counted by Temporal visibility, asked again while the server is too busy to answer
        within CALL_TIMEOUT. A count, not the listing an operator reads: a listing of every machine twice a second
        would load the server the time is measured on."""
        query = f'{RUNNING_MACHINES} AND {MACHINE_STAGE.name} = "{WATCHING}"'
        while True:
            try:
                counted = await self.stack.client.count_workflows(query, rpc_timeout=timedelta(seconds=CALL_TIMEOUT))
            except RPCError as error:
                if error.status not in BUSY:
                    raise
                self.say(f"visibility did not count the WATCHING machines ({error.message}); asking again")
                continue
            return counted.count

    async def bring_up(self) -> float:
        """Until every machine is WATCHING with a fresh heartbeat; how many seconds that took."""
        machines, started = self.options.machines, time.monotonic()
        last_progress = 0.0
        while True:
            await self.stack.restart_unasked_exits()
            watching, fresh, _, _ = await self.counts()
            if watching == machines and fresh == machines:
                took = round(time.monotonic() - started, 1)
                self.say(f"all {machines} machines WATCHING and heartbeating after {took}s")
                return took
            if time.monotonic() - last_progress >= PROGRESS_EVERY:
                self.say(f"bring-up: {watching}/{machines} WATCHING, {fresh} heartbeating")
                last_progress = time.monotonic()
            if time.monotonic() - started > self.options.limit:
                raise ChaosError(f"only {watching} of {machines} machines came up within {self.options.limit:.0f}s")
            await asyncio.sleep(POLL)

    async def kill_agents(self) -> datetime:
        """Kill every machine's agent at once, as a rack losing power silences them; when the kills began."""
        killed_at = (await self.stack.sql("SELECT now()"))[0][0]
        base = f"http://127.0.0.1:{self.stack.ports.sim_api}/admin/machines"
        in_flight = asyncio.Semaphore(KILLS_IN_FLIGHT)
        slots = self.slots()
        async with aiohttp.ClientSession() as session:

            async def kill(slot: str) -> int:
                async with in_flight, session.post(f"{base}/{slot}/kill-agent") as response:
                    response.raise_for_status()
                    return int((await response.json())["killed"])

            killed = await asyncio.gather(*(kill(slot) for slot in slots))
        self.say(f"killed the agents of {sum(1 for n in killed if n)} machines")
        return killed_at

    async def wait_for_hold(self, killed_at: datetime) -> None:
        """Until a pass holds the recoveries with every machine silent; nothing may be rebooted meanwhile."""
        machines, started = self.options.machines, time.monotonic()
        while True:
            rows = await self.stack.sql(
                "SELECT held_since, reason, silent_count FROM recovery_holds"
                " WHERE provider = %(provider)s AND ended_at IS NULL",
                {"provider": PROVIDER},
            )
            if rows and int(rows[0][2]) >= machines:
                held_since, reason, _ = rows[0]
                self.report.hold_after_kill = round((held_since - killed_at).total_seconds(), 1)
                self.report.hold_reason = str(reason)
                self.say(f"recoveries held {self.report.hold_after_kill}s after the kill: {reason}")
                break
            if time.monotonic() - started > self.options.limit:
                raise ChaosError(f"the recoveries were not held with all silent within {self.options.limit:.0f}s")
            await asyncio.sleep(POLL)
        rebooted = await self.stack.sql(
            "SELECT count(*) FROM events WHERE kind = 'rebooted' AND at >= %(since)s", {"since": killed_at}
        )
        self.report.rebooted_while_held = int(rebooted[0][0])

    async def release(self) -> datetime:
        """`shepherd fleet --release-recoveries`, as an operator runs it; when BMDB recorded the release."""
        said = await self.stack.shepherd(
            "fleet", "--release-recoveries", "--provider", PROVIDER, "--reason", RELEASE_REASON, "--by", "bench"
        )
        rows = await self.stack.sql(
            "SELECT released_at FROM recovery_holds WHERE provider = %(provider)s", {"provider": PROVIDER}
        )
        if not rows or rows[0][0] is None:
            raise ChaosError(f"the release was not recorded in BMDB: {said}")
        released_at: datetime = rows[0][0]
        self.say("recoveries released")
        return released_at

    async def wait_until_back(self, released_at: datetime) -> None:
        machines = self.options.machines
        last_progress = 0.0
        while True:
            watching, _, back, started = await self.counts(since=released_at)
            now = (await self.stack.sql("SELECT now()"))[0][0]
            elapsed = (now - released_at).total_seconds()
            if watching == machines and started == machines and self.report.watching_seconds is None:
                self.report.watching_seconds = round(elapsed, 1)
            if watching == machines and back == machines:
                self.report.shepherd_seconds = round(elapsed, 1)
                self.say(f"every machine WATCHING with a new agent {elapsed:.1f}s after the release")
                return
            if time.monotonic() - last_progress >= PROGRESS_EVERY:
                self.say(f"recovery: {watching}/{machines} WATCHING, {back} with a new agent heard from")
                last_progress = time.monotonic()
            if elapsed > self.options.limit:
                self.say(f"not every machine was back within {self.options.limit:.0f}s")
                return
            await self.stack.restart_unasked_exits()
            await asyncio.sleep(POLL)

    async def provider_reboots(self) -> dict[str, int]:
        """The simulator's count of reboots of each machine since it started."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.stack.ports.sim_api}/admin/state") as response,
        ):
            response.raise_for_status()
            reboots: dict[str, int] = (await response.json())["reboots"]
        return reboots

    async def measure(self, killed_at: datetime, released_at: datetime, reboots_before: Mapping[str, int]) -> None:
        report, stack = self.report, self.stack
        rows = await stack.sql(
            "SELECT p.provider_id, e.kind, e.at FROM events e JOIN machine_provided p USING (machine_id)"
            " WHERE e.at >= %(since)s ORDER BY e.at",
            {"since": killed_at},
        )
        events = [(str(p), str(kind)) for p, kind, _ in rows]
        reboots = {slot: n - reboots_before.get(slot, 0) for slot, n in (await self.provider_reboots()).items()}
        slots = self.slots()
        report.damage = storm_damage(slots, reboots, [(p, kind) for p, kind in events if kind in STORM_KINDS])

        def after(kind: str, last: bool = False) -> float | None:
            times = [at for _, k, at in rows if k == kind and at >= released_at]
            if not times:
                return None
            return round(((times[-1] if last else times[0]) - released_at).total_seconds(), 1)

        report.phases = Phases(
            first_signal=after("heartbeat_lost"),
            first_reboot=after("rebooted"),
            last_reboot=after("rebooted", last=True),
            last_agent_start=after("agent_started", last=True),
            takeovers_failed=sum(1 for _, k, at in rows if k == "agent_start_failed" and at >= released_at),
        )
        stages = await machine_stages(stack.client)
        report.not_back = sorted(wid for wid, stage in stages.items() if stage != WATCHING)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def names(items: Sequence[str]) -> str:
    more = f" (+{len(items) - 10} more)" if len(items) > 10 else ""
    return f"{len(items)}{': ' + ', '.join(items[:10]) + more if items else ''}"


def table(report: Report) -> list[str]:
    damage, phases, floors = report.damage, report.phases, report.floors
    floor_seconds = ", ".join(seconds(floor.seconds) for floor in floors)
    floor_answered = ", ".join(seconds(floor.answered_seconds) for floor in floors)
    floor_failures = sum(floor.failures for floor in floors)
    floor_twice = sorted({slot for floor in floors for slot in floor.damage.rebooted_twice})
    ratio = "-" if report.ratio is None else f"{report.ratio:.2f}x"
    watching_ratio = "-" if report.watching_ratio is None else f"{report.watching_ratio:.2f}x"
    rows = [
        ("Shepherd: release to all WATCHING, new agents heard from", seconds(report.shepherd_seconds)),
        ("floor: first reboot to last new agent heard from", f"{floor_seconds}  ({floor_failures} takeovers failed)"),
        ("ratio Shepherd / mean floor", ratio),
        ("Shepherd: release to all WATCHING, new agents started", seconds(report.watching_seconds)),
        ("floor: first reboot to last takeover answered", floor_answered),
        ("ratio of those", watching_ratio),
        ("recoveries held after the kill", f"{seconds(report.hold_after_kill)}  ({report.hold_reason})"),
        ("rebooted while held", str(report.rebooted_while_held)),
        ("machines rebooted (provider's count)", f"{damage.rebooted} of {report.machines}"),
        ("rebooted more than once", names(damage.rebooted_twice)),
        ("reimaged", names(damage.reimaged)),
        ("quarantined", names(damage.quarantined)),
        ("floor: rebooted more than once", names(floor_twice)),
        ("after the release: first heartbeat_lost", seconds(phases.first_signal)),
        ("  first reboot", seconds(phases.first_reboot)),
        ("  last reboot", seconds(phases.last_reboot)),
        ("  last agent started", seconds(phases.last_agent_start)),
        ("  takeover attempts failed", str(phases.takeovers_failed)),
        ("not WATCHING at the end", names(report.not_back)),
        ("bring-up before the storm", seconds(report.bringup_seconds)),
        ("rebooted before the storm", str(report.rebooted_before_storm)),
        ("wall time", seconds(report.wall_seconds)),
    ]
    width = max(len(name) for name, _ in rows)
    head = (
        f"mass recovery: {report.machines} machines, {report.workers} worker process(es), reboots at {report.rate:g}/s"
        " (provider queue limited to"
        f" {report.activities_per_second:g} activities/s), {report.concurrency} takeovers at once, boot"
        f" {report.boot_seconds:g}s, heartbeat timeout {report.heartbeat_timeout:g}s, a pass every"
        f" {report.reconcile_interval:g}s; Temporal's dynamic config:"
        f" {', '.join(report.dynamic_config) or 'its defaults'}"
    )
    return [head, "", *(f"{name:<{width}}  {value}" for name, value in rows)]


def parse_options(argv: Sequence[str] | None = None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mass_recovery", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=positive(int), default=200, help="simulated machines (default %(default)s)")
    parser.add_argument(
        "--rate", type=positive(float), default=3.0, help="reboots a second of the floor (default %(default)s)"
    )
    parser.add_argument(
        "--activities-per-second",
        type=positive(float),
        help="the provider instance's activities_per_second (default: --rate)",
    )
    parser.add_argument("--heartbeat-timeout", type=positive(float), default=60.0, help="seconds (default %(default)s)")
    parser.add_argument(
        "--reconcile-interval", type=positive(float), default=5.0, help="seconds between passes (default %(default)s)"
    )
    parser.add_argument(
        "--limit", type=positive(float), default=900.0, help="give up a step after this many seconds (%(default)s)"
    )
    parser.add_argument(
        "--workers", type=positive(int), default=1, help="worker processes of the stack (default %(default)s)"
    )
    add_dynamic_config_option(parser)
    parser.add_argument("--json", action="store_true", help="print the report as a JSON document")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, state) and say where")
    args = parser.parse_args(argv)
    options = Options(
        machines=args.machines,
        rate=args.rate,
        activities_per_second=args.activities_per_second or args.rate,
        heartbeat_timeout=args.heartbeat_timeout,
        reconcile_interval=args.reconcile_interval,
        limit=args.limit,
        dynamic_config=tuple(args.dynamic_config),
        workers=args.workers,
    )
    return options, args


def main(argv: Sequence[str] | None = None) -> int:
    options, args = parse_options(argv)
    raise_file_limit()
    root = Path(tempfile.mkdtemp(prefix="shepherd-mass-recovery-")).resolve()
    instance = ProviderInstance(PROVIDER, "sim", activities_per_second=options.activities_per_second)
    stack = Stack(
        root,
        options.stack(),
        time.monotonic(),
        providers=(instance,),
        temporal_arguments=dev_server_arguments(options.dynamic_config),
        workers=options.workers,
    )
    report = run_on_stack(stack, MassRecovery(stack, options).run, keep=args.keep)
    if args.json:
        document = {
            **asdict(report),
            "floor_seconds": report.floor_seconds,
            "ratio": report.ratio,
            "floor_answered_seconds": report.floor_answered_seconds,
            "watching_ratio": report.watching_ratio,
        }
        print(json.dumps(document, indent=2, default=str))
    else:
        print("\n".join(table(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
