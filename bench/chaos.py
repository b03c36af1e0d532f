"""Benchmark: a fleet coming up under faults, then a heartbeat outage.

Assembles the stack from separate processes, as an installation against an
existing Temporal and PostgreSQL runs it: a Temporal dev server with a state
file, a PostgreSQL (bmdb.local_postgres), the simulator (shepherd sim), the
heartbeat server and a worker, each configured through SHEPHERD_* variables
only, on free loopback ports (never the embedded stack's) and under a
temporary directory. Timings are short (stack_settings) so a few hundred
machines come up in minutes.

While --machines machines come up, at seeded random points of the bring-up
(once so many machines are WATCHING, then a random delay), it

  - SIGKILLs the worker --worker-kills times, starting it again at once;
  - stops the Temporal dev server and starts it again on the same port and
    state file, once;
  - stops PostgreSQL and starts it again on the same data directory, once.

Once every machine is WATCHING and heartbeating, it stops the heartbeat server
for the heartbeat timeout plus two reconcile intervals plus --margin, starts it
again, and watches until every agent has sent a heartbeat again, then two more
reconcile intervals plus --margin (at most --after-outage), so a wrongful
recovery has every chance to show. It reports:

  machines WATCHING   at the end, from `shepherd machines --json` (BMDB joined
                      with Temporal visibility, as an operator sees it)
  time to WATCHING    from the worker's start until every machine was WATCHING
                      (Temporal visibility) with every fault done
  created twice       devices the simulator created more than once for one
                      slot (its per-slot creation count in /admin/state), and
                      the create calls it answered, by status (/metrics)
  BMDB duplicated     machine_provided rows sharing (provider, provider_id)
  BMDB orphaned       machines rows without machine_provided, agent rows of no
                      provided machine, heartbeat rows of no agent, rows the
                      provider does not know, provider machines BMDB does not
  rebooted by outage  machines with a `rebooted` event in BMDB between the stop
                      of the heartbeat server and the end of the watch after it,
                      split into reboots while it was down and after its restart

Run (about ten minutes with the defaults on two cores):

    python -m bench.chaos [--machines 200] [--seed 1] [--worker-kills 10] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import psycopg
from temporalio.client import Client

from agent.build import build_agent_executable
from bmdb.local_postgres import LocalPostgres
from foundation.procfs import process_environments, processes_mentioning
from foundation.provider_instances import ProviderInstance
from foundation.setting_values import ENV_PREFIX
from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from foundation.tls import local_certificates
from lifecycle.contracts import MachineStage, machine_workflow_id
from operations.machine_reads import machine_stages
from proto import AGENT_MAX_RETRY_INTERVAL
from shepherd.commands.dev_stack.children import simulator_argv, temporal_dev_server_argv
from shepherd.commands.dev_stack.stack_settings import providers_file, settings_environment
from simulator.machine import MACHINE_ROOT_VARIABLE

PROVIDER = "sim"
PROJECT = Path(__file__).resolve().parents[1]
# The embedded stack's ports (shepherd dev), which other runs on the same host may hold.
RESERVED_PORTS = frozenset({7233, 8233, 8800, 8900, 9464, 9465, 9466})
# Listening ports come from below the kernel's ephemeral range: while the Temporal server is down for its
# restart, an outgoing connection could otherwise take its port.
PORT_RANGE = range(20000, 32768)

HEARTBEAT_INTERVAL = 5.0
SIM_BOOT_SECONDS = 5.0
WATCHING = MachineStage.WATCHING.value
# Faults strike once this fraction of the machines is WATCHING (seeded, uniform), then after a random delay.
FAULT_WINDOW = (0.03, 0.85)
FAULT_DELAY = (0.0, 4.0)
KILL_WORKER, RESTART_TEMPORAL, RESTART_POSTGRES = "kill worker", "restart Temporal", "restart PostgreSQL"
# Between stopping the Temporal server or PostgreSQL and starting it again.
RESTART_PAUSE = 2.0

POLL = 1.0
PROGRESS_EVERY = 10.0
CALL_TIMEOUT = 10.0
START_LIMIT = 90.0
STOP_GRACE = 20.0
SETTLE_LIMIT = 90.0
# A service that keeps dying on its own is a broken run, not a measurement.
UNPLANNED_EXITS_LIMIT = 5
WORKER_READY = "worker polling task queue"


class ChaosError(Exception):
    """The stack could not start or broke beyond what the benchmark injects; the message says which part."""


@dataclass(frozen=True)
class Options:
    machines: int
    seed: int
    worker_kills: int
    heartbeat_timeout: float
    reconcile_interval: float
    margin: float
    after_outage: float
    bringup_limit: float

    @property
    def outage_seconds(self) -> float:
        """How long the heartbeat server stays down: long enough for every agent to look silent to two passes."""
        return self.heartbeat_timeout + 2 * self.reconcile_interval + self.margin

    @property
    def linger(self) -> float:
        """How long to keep watching once every agent is back: a pass that found it silent has signalled by then."""
        return 2 * self.reconcile_interval + self.margin


@dataclass(frozen=True)
class Ports:
    temporal: int
    temporal_http: int
    temporal_metrics: int
    sim_api: int
    sim_metrics: int
    heartbeat: int


def ephemeral_ports() -> range:
    try:
        low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def choose_ports(count: int) -> list[int]:
    """Free loopback ports outside the embedded stack's and the ephemeral range, in random order."""
    ephemeral = ephemeral_ports()
    candidates = [port for port in PORT_RANGE if port not in RESERVED_PORTS and port not in ephemeral]
    random.Random().shuffle(candidates)  # not the run's seed: ports need not repeat
    chosen: list[int] = []
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise ChaosError(f"found only {len(chosen)} free ports in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")


def stack_settings(root: Path, ports: Ports, database_url: str, options: Options) -> Settings:
    """What every Shepherd process of the stack runs with: local services, short timings, the fleet's size."""
    certificates = local_certificates(root / "tls")
    endpoint = f"127.0.0.1:{ports.heartbeat}"
    return Settings(
        temporal_address=f"127.0.0.1:{ports.temporal}",
        database_url=database_url,
        state_dir=root / "state",
        sim_api_url=f"http://127.0.0.1:{ports.sim_api}",
        # An activity lost with a killed worker is tried again once its timeout passes: keep them short.
        provider_timeout=5.0,
        reboot_timeout=60.0,
        ssh_exec_timeout=30.0,
        agent_executable_path=root / "agent",
        agent_endpoint=endpoint,
        agent_endpoint_ca_certificate_path=certificates.ca_certificate,
        heartbeat_listen=endpoint,
        heartbeat_tls_certificate_path=certificates.server_certificate,
        heartbeat_tls_key_path=certificates.server_key,
        heartbeat_interval=HEARTBEAT_INTERVAL,
        agent_start_backoff_initial=5.0,
        agent_start_backoff_maximum=30.0,
        agent_start_backoff_multiplier=1.5,
        provision_backoff_initial=5.0,
        provision_backoff_maximum=30.0,
        provision_backoff_multiplier=1.5,
        recovery_backoff_initial=5.0,
        recovery_backoff_maximum=30.0,
        recovery_backoff_multiplier=1.5,
        first_heartbeat_timeout=60.0,
        heartbeat_timeout=options.heartbeat_timeout,
        # One host, one clock: no more skew than the short timeout allows.
        heartbeat_max_skew=min(10.0, options.heartbeat_timeout),
        # The whole fleet in one pass; admissions then go at about one a second (the dev server's timers).
        max_machines=options.machines,
        chunk_size=options.machines,
        reconcile_interval=options.reconcile_interval,
        # The workers look for silent machines as often as a pass comes: the runs keep their timings.
        watchdog_interval=options.reconcile_interval,
        device_creation_interval=0.2,
    ).check()


def clean_environment() -> dict[str, str]:
    """This process's environment without SHEPHERD_* variables: children get exactly the stack's settings."""
    return {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}


class Service:
    """One process of the stack: started again with the same command after a kill or a stop, output in one log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = dict(env)
        self.process: subprocess.Popen[bytes] | None = None
        # Whether it should be running: an exit while wanted is one it was not asked for.
        self.wanted = False
        self.log_offset = 0
        self.unplanned_exits = 0

    def start(self) -> None:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=PROJECT,
                # Own session: a Ctrl-C reaches only the benchmark, which stops the stack in order.
                start_new_session=True,
            )
        self.wanted = True

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exited_unasked(self) -> int | None:
        """The exit status, if it exited while it should be running."""
        if not self.wanted or self.process is None:
            return None
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer ends a process: no shutdown of any kind."""
        self.wanted = False
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM, as an operator or a service manager stops it; SIGKILL to its process group after grace."""
        self.wanted = False
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_since_start(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def agent_processes(machines_dir: Path) -> Counter[str]:
    """Processes started on each simulated machine (its agents, detached), by slot, from the simulator's marker."""
    marker = f"{MACHINE_ROOT_VARIABLE}={machines_dir}/".encode()
    counts: Counter[str] = Counter()
    for _, environment in process_environments():
        for variable in environment:
            if variable.startswith(marker):
                counts[variable[len(marker) :].decode(errors="replace").split("/")[0]] += 1
    return counts


class Stack:
    """The stack's processes and PostgreSQL, started, faulted and stopped by the benchmark."""

    def __init__(
        self,
        root: Path,
        options: Options,
        started: float,
        providers: tuple[ProviderInstance, ...] = (),
        temporal_arguments: Sequence[str] = (),
        workers: int = 1,
    ) -> None:
        self.root = root
        self.options = options
        # [[providers]] of the stack (a rate limit, say); none: the one simulator instance the settings name.
        self.providers = providers
        # More arguments of the Temporal dev server (its dynamic config, say).
        self.temporal_arguments = tuple(temporal_arguments)
        # Worker processes on the same task queues: "worker", then "worker-2" and on.
        self.worker_names = ["worker", *(f"worker-{n}" for n in range(2, workers + 1))]
        self.started = started
        self._ports: Ports | None = None
        self.postgres = LocalPostgres(root / "postgres")
        self.postgres_running = False
        self.database_url = ""
        self.services: dict[str, Service] = {}
        self.logs = root / "logs"
        self._client: Client | None = None
        self._settings: Settings | None = None
        # What the stack's processes are started with: its settings as SHEPHERD_* variables, and its providers file.
        self._environment: dict[str, str] = {}

    @property
    def ports(self) -> Ports:
        assert self._ports is not None, "the stack has not started"
        return self._ports

    @property
    def client(self) -> Client:
        assert self._client is not None, "the stack has not started"
        return self._client

    @property
    def settings(self) -> Settings:
        assert self._settings is not None, "the stack has not started"
        return self._settings

    @property
    def machines_dir(self) -> Path:
        return self.root / "sim" / "machines"

    def service(self, name: str) -> Service:
        return self.services[name]

    async def shepherd(self, *args: str, within: float | None = 120.0) -> str:
        """What a `shepherd` command against the stack printed, run as an operator runs it, killed after within
        seconds; ChaosError when it fails."""
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "shepherd", *args],
            env=self._environment,
            cwd=PROJECT,
            capture_output=True,
            text=True,
            check=False,
            timeout=within,
        )
        if done.returncode != 0:
            raise ChaosError(f"shepherd {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def say(self, message: str) -> None:
        """A progress line on standard error, with the seconds since the run began."""
        print(f"[chaos {time.monotonic() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)

    async def start(self) -> None:
        self._ports = Ports(*choose_ports(6))
        self.logs.mkdir(parents=True)
        temporal_env = clean_environment()
        self.services["temporal"] = Service("temporal", self.temporal_argv(), self.logs / "temporal.log", temporal_env)
        self.say(f"starting the Temporal dev server on 127.0.0.1:{self.ports.temporal}")
        self.service("temporal").start()
        self.say("starting PostgreSQL (BMDB)")
        await self.start_postgres()

        settings = stack_settings(self.root, self.ports, self.database_url, self.options)
        if self.providers:
            settings = settings.replace(providers=self.providers).check()
        self._settings = settings
        assert settings.agent_executable_path is not None
        build_agent_executable(settings.agent_executable_path)
        env = {**clean_environment(), **settings_environment(settings), "PYTHONUNBUFFERED": "1"}
        if self.providers:
            # [[providers]] have no variable: every child reads them from one settings file.
            env["SHEPHERD_CONFIG"] = str(providers_file(settings, self.root / "providers.toml"))
        self._environment = env
        await self.shepherd("migrate", within=None)
        await self.wait_ready(self.service("temporal"), self.connect_temporal, "the Temporal server")

        python_shepherd = [sys.executable, "-m", "shepherd"]
        sim_argv = simulator_argv(
            self.options.machines,
            self.root / "sim",
            self.ports.sim_api,
            f"127.0.0.1:{self.ports.sim_metrics}",
            SIM_BOOT_SECONDS,
        )
        for name, argv in (
            ("simulator", sim_argv),
            ("heartbeat-server", [*python_shepherd, "heartbeat-server"]),
            *((name, [*python_shepherd, "worker"]) for name in self.worker_names),
        ):
            self.services[name] = Service(name, argv, self.logs / f"{name}.log", env)
        self.say(f"starting the simulator with {self.options.machines} machines on 127.0.0.1:{self.ports.sim_api}")
        await self.start_service("simulator")
        self.say(f"starting the heartbeat server on {settings.heartbeat_listen}")
        await self.start_service("heartbeat-server")
        for name in self.worker_names:
            self.say(f"starting the {name}")
            await self.start_service(name)

    def temporal_argv(self) -> list[str]:
        # The state file keeps workflows, schedules and search attributes across the restart.
        return temporal_dev_server_argv(
            self.ports.temporal,
            self.root / "temporal.db",
            "--http-port",
            str(self.ports.temporal_http),
            "--metrics-port",
            str(self.ports.temporal_metrics),
            "--headless",
            *self.temporal_arguments,
        )

    async def start_postgres(self) -> None:
        url = await asyncio.to_thread(self.postgres.start)
        self.postgres_running = True
        if self.database_url and url != self.database_url:
            raise ChaosError(f"PostgreSQL came back at {url}, not at {self.database_url} where the stack looks")
        self.database_url = url

    async def start_service(self, name: str) -> None:
        """Start a service (again) and wait until it serves."""
        probes: dict[str, Callable[[], Awaitable[None]]] = {
            "temporal": self.connect_temporal,
            "simulator": self.simulator_serves,
            "heartbeat-server": self.heartbeat_server_listens,
            **{worker: partial(self.worker_polls, worker) for worker in self.worker_names},
        }
        service = self.service(name)
        service.start()
        await self.wait_ready(service, probes[name], name)

    async def wait_ready(self, service: Service, probe: Callable[[], Awaitable[None]], what: str) -> None:
        deadline = time.monotonic() + START_LIMIT
        while True:
            if not service.running():
                raise ChaosError(f"{service.name} exited while starting; its log ends:\n{service.log_tail()}")
            try:
                await asyncio.wait_for(probe(), CALL_TIMEOUT)
                return
            except Exception as error:
                if time.monotonic() > deadline:
                    raise ChaosError(f"{what} did not come up within {START_LIMIT:.0f}s: {error!r}") from None
            await asyncio.sleep(0.5)

    async def connect_temporal(self) -> None:
        client = await Client.connect(f"127.0.0.1:{self.ports.temporal}", data_converter=DATA_CONVERTER)
        await client.count_workflows()
        self._client = client

    async def simulator_serves(self) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.ports.sim_api}/healthz") as response,
        ):
            response.raise_for_status()

    async def heartbeat_server_listens(self) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", self.ports.heartbeat)
        writer.close()
        await writer.wait_closed()

    async def worker_polls(self, name: str = "worker") -> None:
        if WORKER_READY not in self.service(name).log_since_start():
            raise ChaosError(f"the {name} does not poll yet")

    async def kill_worker(self) -> None:
        worker = self.service("worker")
        worker.kill()
        await self.start_service("worker")

    async def restart_temporal(self) -> None:
        await asyncio.to_thread(self.service("temporal").stop)
        await asyncio.sleep(RESTART_PAUSE)
        await self.start_service("temporal")

    async def restart_postgres(self) -> None:
        self.postgres_running = False
        await asyncio.to_thread(self.postgres.stop)
        await asyncio.sleep(RESTART_PAUSE)
        await self.start_postgres()

    async def restart_unasked_exits(self) -> None:
        """Start the worker and heartbeat server again when they exited on their own; other exits end the run."""
        for service in self.services.values():
            code = service.exited_unasked()
            if code is None:
                continue
            service.unplanned_exits += 1
            self.say(f"{service.name} exited on its own with status {code}; its log ends:\n{service.log_tail()}")
            if service.name not in (*self.worker_names, "heartbeat-server"):
                raise ChaosError(f"{service.name} exited with status {code}")
            if service.unplanned_exits > UNPLANNED_EXITS_LIMIT:
                raise ChaosError(f"{service.name} exited on its own {service.unplanned_exits} times")
            await self.start_service(service.name)

    async def sql(self, query: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Rows of one query against BMDB, on a connection of its own (PostgreSQL may have restarted since)."""
        async with await psycopg.AsyncConnection.connect(self.database_url, connect_timeout=5) as conn:
            cursor = await conn.execute(query, params)
            return await cursor.fetchall()

    def close(self) -> None:
        """Stop everything this run started, in order; never raises, and may be called again."""
        for name in (*self.worker_names, "heartbeat-server", "simulator", "temporal"):
            service = self.services.get(name)
            if service is None:
                continue
            try:
                service.stop()
            except Exception as error:
                print(f"bench.chaos: could not stop {name}: {error}", file=sys.stderr)
        if self.postgres_running:
            try:
                self.postgres.stop()
                self.postgres_running = False
            except Exception as error:
                print(f"bench.chaos: could not stop PostgreSQL: {error}", file=sys.stderr)
        # Agents detach from the simulator: whatever of this run still runs (its path is in every one's
        # command line or environment) is stopped by its pid.
        for pid in processes_mentioning(str(self.root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Fault:
    kind: str
    # Strikes once this many machines are WATCHING, then after delay seconds.
    at_watching: int
    delay: float
    # Seconds since the worker first started; how many were WATCHING then; how long until the process served.
    struck_after: float | None = None
    watching_then: int | None = None
    back_within: float | None = None


def plan_faults(rng: random.Random, machines: int, worker_kills: int) -> list[Fault]:
    kinds = [KILL_WORKER] * worker_kills + [RESTART_TEMPORAL, RESTART_POSTGRES]
    rng.shuffle(kinds)
    points = sorted(rng.uniform(*FAULT_WINDOW) for _ in kinds)
    return [
        Fault(kind, max(1, round(point * machines)), round(rng.uniform(*FAULT_DELAY), 2))
        for kind, point in zip(kinds, points, strict=True)
    ]


@dataclass
class Snapshot:
    """The fleet at one moment: Temporal's stages and BMDB's counts; None where that side did not answer."""

    stages: Counter[str] | None = None
    provided: int | None = None
    agents: int | None = None
    fresh: int | None = None  # heartbeat within the heartbeat timeout
    silent: int | None = None  # silent by the watchdog's rule
    reboots: int | None = None
    heartbeated_since: int | None = None  # agents with a heartbeat since a given moment

    @property
    def watching(self) -> int | None:
        return None if self.stages is None else self.stages.get(WATCHING, 0)

    def line(self, machines: int) -> str:
        def known(value: int | None) -> str:
            return "?" if value is None else str(value)

        others = (
            ""
            if self.stages is None
            else ", ".join(f"{s} {n}" for s, n in sorted(self.stages.items()) if s != WATCHING)
        )
        return (
            f"{known(self.watching)}/{machines} WATCHING{f' ({others})' if others else ''}; BMDB: "
            f"{known(self.provided)} machines, {known(self.agents)} agents, {known(self.fresh)} heartbeating, "
            f"{known(self.silent)} silent, {known(self.reboots)} reboots"
        )


@dataclass
class Outage:
    seconds_down: float = 0.0
    silent_at_peak: int = 0
    watching_at_least: int | None = None
    # Seconds from the heartbeat server's restart until the fleet was whole again: every machine WATCHING, with
    # an agent that sent a heartbeat since (a rebooted machine's new agent counts).
    all_back_after: float | None = None
    watched_after: float = 0.0
    rebooted_machines: list[str] = field(default_factory=list)
    reboots: int = 0
    # Of those reboots: while the heartbeat server was down (the outage's leading edge), and after its restart.
    reboots_while_down: int = 0
    reboots_after_restart: int = 0
    reboot_causes: dict[str, int] = field(default_factory=dict)
    fleet_events: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    machines: int
    seed: int
    settings: dict[str, Any]
    faults: list[Fault]
    wall_seconds: float = 0.0
    time_to_all_watching: float | None = None
    watching_at_end: int = 0
    stages_at_end: dict[str, int] = field(default_factory=dict)
    not_watching_at_end: list[str] = field(default_factory=list)
    # Provider side: slots created, those created more than once, create calls by HTTP status.
    slots_created: int = 0
    created_twice: dict[str, int] = field(default_factory=dict)
    create_calls: dict[str, int] = field(default_factory=dict)
    foreign_idempotency_keys: int = 0
    # BMDB integrity.
    bmdb_duplicated: dict[str, list[str]] = field(default_factory=dict)
    bmdb_orphaned: dict[str, list[str]] = field(default_factory=dict)
    bmdb_still_creating: list[str] = field(default_factory=list)
    bringup_rebooted_machines: list[str] = field(default_factory=list)
    bringup_reboot_causes: dict[str, int] = field(default_factory=dict)
    outage: Outage = field(default_factory=Outage)
    # Machines running more than one agent process at the end, and how many extra.
    stray_agents: dict[str, int] = field(default_factory=dict)
    unplanned_exits: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def duplicated(self) -> int:
        return sum(len(rows) for rows in self.bmdb_duplicated.values())

    @property
    def orphaned(self) -> int:
        return sum(len(rows) for rows in self.bmdb_orphaned.values())

    def document(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "created_twice_total": sum(n - 1 for n in self.created_twice.values()),
            "bmdb_duplicated_total": self.duplicated,
            "bmdb_orphaned_total": self.orphaned,
        }


def reboot_cause(detail: str) -> str:
    """The cause of a `rebooted` event, without the machine's particulars: 'heartbeat lost', 'forced'."""
    return detail.removeprefix("rebooted: ").split(":")[0].strip() or "unknown"


def parse_create_calls(metrics: str) -> dict[str, int]:
    """POST /v1/machines calls by HTTP status, from the simulator's Prometheus text."""
    calls: Counter[str] = Counter()
    for line in metrics.splitlines():
        if not line.startswith("shepherd_sim_api_requests") or 'method="POST"' not in line:
            continue
        if 'route="/v1/machines"' not in line:
            continue
        status = re.search(r'status="(\d+)"', line)
        if status:
            calls[status.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return dict(sorted(calls.items()))


class ChaosRun:
    """The benchmark: bring-up under faults, the heartbeat outage, then what they left behind."""

    def __init__(self, stack: Stack, options: Options) -> None:
        self.stack = stack
        self.options = options
        self.say = stack.say
        self.faults = plan_faults(random.Random(options.seed), options.machines, options.worker_kills)
        self.report = Report(
            machines=options.machines, seed=options.seed, settings=self.described_settings(), faults=self.faults
        )
        self.worker_started = 0.0
        self.outage_start: datetime | None = None
        self.outage_restart: datetime | None = None
        self.outage_end: datetime | None = None

    def described_settings(self) -> dict[str, Any]:
        options = self.options
        return {
            "worker_kills": options.worker_kills,
            "heartbeat_interval": HEARTBEAT_INTERVAL,
            "heartbeat_timeout": options.heartbeat_timeout,
            "reconcile_interval": options.reconcile_interval,
            "heartbeat_outage": options.outage_seconds,
            "watch_after_outage_at_most": options.after_outage,
        }

    async def run(self) -> Report:
        self.say(
            "faults planned: "
            + ", ".join(f"{fault.kind} at {fault.at_watching} WATCHING +{fault.delay:.1f}s" for fault in self.faults)
        )
        await self.stack.start()
        self.worker_started = time.monotonic()
        await self.bring_up()
        await self.settle()
        await self.heartbeat_outage()
        await self.measure()
        self.report.wall_seconds = round(time.monotonic() - self.stack.started, 1)
        return self.report

    async def observe(self, since: datetime | None = None) -> Snapshot:
        snapshot = Snapshot()
        try:
            stages = await asyncio.wait_for(machine_stages(self.stack.client), CALL_TIMEOUT)
            snapshot.stages = Counter(stages.values())
        except Exception:
            pass  # the Temporal server is restarting, or slow: this poll shows "?"
        try:
            rows = await asyncio.wait_for(
                self.stack.sql(
                    """
                    SELECT
                      (SELECT count(*) FROM machine_provided),
                      (SELECT count(*) FROM machine_agent_started),
                      (SELECT count(*) FROM machine_agent_heartbeat
                        WHERE agent_heartbeat_at > now() - make_interval(secs => %(timeout)s)),
                      (SELECT count(*) FROM machine_agent_started a
                        LEFT JOIN machine_agent_heartbeat h USING (machine_id)
                        WHERE (h.machine_id IS NULL AND a.agent_started_at < now() - make_interval(secs => %(first)s))
                           OR h.agent_heartbeat_at < now() - make_interval(secs => %(timeout)s)),
                      (SELECT count(*) FROM events WHERE kind = 'rebooted'),
                      (SELECT count(*) FROM machine_agent_heartbeat WHERE agent_heartbeat_at >= %(since)s)
                    """,
                    {
                        "timeout": self.options.heartbeat_timeout,
                        "first": self.stack.settings.first_heartbeat_timeout,
                        "since": since or datetime.now(UTC),
                    },
                ),
                CALL_TIMEOUT,
            )
            provided, agents, fresh, silent, reboots, heartbeated = (int(n) for n in rows[0])
            snapshot.provided, snapshot.agents, snapshot.fresh = provided, agents, fresh
            snapshot.silent, snapshot.reboots = silent, reboots
            snapshot.heartbeated_since = heartbeated if since is not None else None
        except Exception:
            pass  # PostgreSQL is restarting
        return snapshot

    async def bring_up(self) -> None:
        machines = self.options.machines
        self.say(f"bringing {machines} machines up; {len(self.faults)} faults on the way")
        due_since: float | None = None
        last_progress = 0.0
        while True:
            await self.stack.restart_unasked_exits()
            snapshot = await self.observe()
            now = time.monotonic()
            watching = snapshot.watching
            pending = next((fault for fault in self.faults if fault.struck_after is None), None)
            if watching is not None and watching >= machines and pending is None:
                self.report.time_to_all_watching = round(now - self.worker_started, 1)
                self.say(f"all {machines} machines WATCHING after {self.report.time_to_all_watching:.1f}s")
                return
            if pending is not None and watching is not None and watching >= min(pending.at_watching, machines):
                due_since = due_since if due_since is not None else now
                if now - due_since >= pending.delay:
                    await self.strike(pending, watching)
                    due_since = None
                    last_progress = 0.0
                    continue
            if now - last_progress >= PROGRESS_EVERY:
                self.say(
                    snapshot.line(machines)
                    + f"; faults {self.faults.index(pending) if pending else len(self.faults)}/{len(self.faults)}"
                )
                last_progress = now
            if now - self.worker_started > self.options.bringup_limit:
                note = f"not every machine was WATCHING within {self.options.bringup_limit:.0f}s; went on regardless"
                self.report.notes.append(note)
                self.say(note)
                return
            await asyncio.sleep(POLL)

    async def strike(self, fault: Fault, watching: int) -> None:
        struck = time.monotonic()
        fault.struck_after = round(struck - self.worker_started, 1)
        fault.watching_then = watching
        self.say(f"fault: {fault.kind} ({watching} WATCHING)")
        if fault.kind == KILL_WORKER:
            await self.stack.kill_worker()
        elif fault.kind == RESTART_TEMPORAL:
            await self.stack.restart_temporal()
        else:
            await self.stack.restart_postgres()
        fault.back_within = round(time.monotonic() - struck, 1)
        self.say(f"fault: {fault.kind} done, serving again within {fault.back_within:.1f}s")

    async def settle(self) -> None:
        """Until every machine is WATCHING with a fresh heartbeat: the outage starts from a healthy fleet."""
        machines = self.options.machines
        deadline = time.monotonic() + SETTLE_LIMIT
        while time.monotonic() < deadline:
            await self.stack.restart_unasked_exits()
            snapshot = await self.observe()
            if snapshot.watching == machines and snapshot.fresh == machines:
                return
            await asyncio.sleep(POLL)
        note = f"the fleet was not all WATCHING and heartbeating {SETTLE_LIMIT:.0f}s after bring-up; outage regardless"
        self.report.notes.append(note)
        self.say(note)

    async def heartbeat_outage(self) -> None:
        options, outage, machines = self.options, self.report.outage, self.options.machines
        heartbeat_server = self.stack.service("heartbeat-server")
        self.say(f"stopping the heartbeat server for {options.outage_seconds:.0f}s")
        self.outage_start = datetime.now(UTC)
        stopped = time.monotonic()
        await asyncio.to_thread(heartbeat_server.stop)
        last_progress = 0.0
        while time.monotonic() - stopped < options.outage_seconds:
            await self.stack.restart_unasked_exits()
            snapshot = await self.observe()
            self.track(snapshot)
            if time.monotonic() - last_progress >= PROGRESS_EVERY:
                self.say("heartbeat server down: " + snapshot.line(machines))
                last_progress = time.monotonic()
            await asyncio.sleep(POLL)
        await self.stack.start_service("heartbeat-server")
        back_at = self.outage_restart = datetime.now(UTC)
        back = time.monotonic()
        outage.seconds_down = round(back - stopped, 1)
        self.say(f"heartbeat server serving again after {outage.seconds_down:.0f}s; watching for wrongful recoveries")
        everyone_back: float | None = None
        last_progress = 0.0
        while True:
            await self.stack.restart_unasked_exits()
            snapshot = await self.observe(since=back_at)
            self.track(snapshot)
            now = time.monotonic()
            if snapshot.watching == machines and snapshot.agents == machines and snapshot.heartbeated_since == machines:
                if everyone_back is None:
                    everyone_back = now
                    outage.all_back_after = round(now - back, 1)
                    self.say(f"every agent heartbeats again, {outage.all_back_after:.0f}s after the restart")
            elif snapshot.stages is not None and snapshot.heartbeated_since is not None:
                everyone_back, outage.all_back_after = None, None
            if everyone_back is not None and now - everyone_back >= options.linger:
                break
            if now - back >= options.after_outage:
                if everyone_back is None:
                    note = f"the fleet was not whole again {options.after_outage:.0f}s after the heartbeat outage"
                else:
                    note = (
                        f"the watch after the outage reached its limit of {options.after_outage:.0f}s"
                        f" {now - everyone_back:.0f}s after the fleet was whole again (not {options.linger:.0f}s)"
                    )
                self.report.notes.append(note)
                self.say(note)
                break
            if now - last_progress >= PROGRESS_EVERY:
                self.say(f"after the outage: {snapshot.line(machines)}, {snapshot.heartbeated_since} back")
                last_progress = now
            await asyncio.sleep(POLL)
        outage.watched_after = round(time.monotonic() - back, 1)
        self.outage_end = datetime.now(UTC)

    def track(self, snapshot: Snapshot) -> None:
        outage = self.report.outage
        if snapshot.silent is not None:
            outage.silent_at_peak = max(outage.silent_at_peak, snapshot.silent)
        if snapshot.watching is not None:
            least = outage.watching_at_least
            outage.watching_at_least = snapshot.watching if least is None else min(least, snapshot.watching)

    async def measure(self) -> None:
        """What the faults left behind: the final fleet, the provider's creations, BMDB's rows, the reboots."""
        report, stack = self.report, self.stack
        self.say("measuring")
        # As an operator sees the fleet: a separate `shepherd machines --json`, BMDB joined with Temporal.
        fleet = json.loads(await stack.shepherd("machines", "--json"))
        stages = Counter(str(machine["stage"] or "no workflow") for machine in fleet)
        report.stages_at_end = dict(sorted(stages.items()))
        report.watching_at_end = stages.get(WATCHING, 0)
        report.not_watching_at_end = sorted(
            f"{machine['provider_id']}: {machine['stage'] or 'no workflow'}"
            for machine in fleet
            if machine["stage"] != WATCHING
        )

        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{stack.ports.sim_api}/admin/state") as response:
                response.raise_for_status()
                provider = await response.json()
            async with session.get(f"http://127.0.0.1:{stack.ports.sim_metrics}/metrics") as response:
                response.raise_for_status()
                report.create_calls = parse_create_calls(await response.text())
        creations: dict[str, int] = provider["creations"]
        provider_machines = set(provider["machines"])
        report.slots_created = len(creations)
        report.created_twice = {slot: n for slot, n in sorted(creations.items()) if n > 1}
        expected_keys = {machine_workflow_id(PROVIDER, slot) for slot in provider_machines}
        report.foreign_idempotency_keys = len(set(provider["idempotency_keys"]) - expected_keys)

        duplicated = await stack.sql(
            "SELECT provider || '/' || provider_id || ' x' || count(*) FROM machine_provided"
            " GROUP BY provider, provider_id HAVING count(*) > 1"
        )
        report.bmdb_duplicated = {"machine_provided per (provider, provider_id)": [str(r[0]) for r in duplicated]}
        orphans = {
            "machines without machine_provided": "SELECT m.machine_id::text FROM machines m"
            " LEFT JOIN machine_provided p USING (machine_id) WHERE p.machine_id IS NULL",
            "agents of no provided machine": "SELECT a.machine_id::text FROM machine_agent_started a"
            " LEFT JOIN machine_provided p USING (machine_id) WHERE p.machine_id IS NULL",
            "heartbeats of no agent": "SELECT h.machine_id::text FROM machine_agent_heartbeat h"
            " LEFT JOIN machine_agent_started a USING (machine_id) WHERE a.machine_id IS NULL",
        }
        report.bmdb_orphaned = {what: [str(r[0]) for r in await stack.sql(query)] for what, query in orphans.items()}
        in_bmdb = {
            (str(r[0]), str(r[1])): str(r[2])
            for r in await stack.sql("SELECT provider, provider_id, status FROM machine_provided")
        }
        bmdb_ids = {provider_id for (p, provider_id) in in_bmdb if p == PROVIDER}
        report.bmdb_orphaned["BMDB machines the provider does not have"] = sorted(bmdb_ids - provider_machines)
        report.bmdb_orphaned["provider machines BMDB does not have"] = sorted(provider_machines - bmdb_ids)
        report.bmdb_still_creating = sorted(f"{p}/{i}" for (p, i), status in in_bmdb.items() if status != "provided")

        assert self.outage_start and self.outage_restart and self.outage_end
        reboots = await stack.sql(
            "SELECT coalesce(p.provider_id, e.machine_id::text), e.at, e.detail FROM events e"
            " LEFT JOIN machine_provided p USING (machine_id) WHERE e.kind = 'rebooted' ORDER BY e.at"
        )
        before = [(str(m), str(d)) for m, at, d in reboots if at < self.outage_start]
        during = [(str(m), str(d)) for m, at, d in reboots if self.outage_start <= at <= self.outage_end]
        while_down = [at for _, at, _ in reboots if self.outage_start <= at < self.outage_restart]
        report.bringup_rebooted_machines = sorted({m for m, _ in before})
        report.bringup_reboot_causes = dict(Counter(reboot_cause(d) for _, d in before))
        outage = report.outage
        outage.rebooted_machines = sorted({m for m, _ in during})
        outage.reboots = len(during)
        outage.reboots_while_down = len(while_down)
        outage.reboots_after_restart = len(during) - len(while_down)
        outage.reboot_causes = dict(Counter(reboot_cause(d) for _, d in during))
        fleet_events = await stack.sql(
            "SELECT kind, count(*) FROM events WHERE machine_id IS NULL AND at BETWEEN %(start)s AND %(end)s"
            " GROUP BY kind ORDER BY kind",
            {"start": self.outage_start, "end": self.outage_end},
        )
        outage.fleet_events = {str(kind): int(n) for kind, n in fleet_events}

        agents = await asyncio.to_thread(agent_processes, stack.machines_dir)
        report.stray_agents = {slot: n - 1 for slot, n in sorted(agents.items()) if n > 1}
        report.unplanned_exits = {name: s.unplanned_exits for name, s in stack.services.items() if s.unplanned_exits}


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def table(report: Report) -> list[str]:
    """The report as lines of a two-column table, the main measures first."""
    outage = report.outage
    settings = report.settings
    calls = ", ".join(f"{status} x{n}" for status, n in report.create_calls.items()) or "none counted"
    twice = sum(n - 1 for n in report.created_twice.values())
    rows = [
        ("machines WATCHING at the end", f"{report.watching_at_end} of {report.machines}"),
        ("time until all machines were WATCHING", seconds(report.time_to_all_watching)),
        (
            "devices created twice at the provider",
            f"{twice}  ({report.slots_created} slots created; POST /v1/machines answered {calls})",
        ),
        ("BMDB rows duplicated", str(report.duplicated)),
        ("BMDB rows orphaned", str(report.orphaned)),
        (
            "machines rebooted by the heartbeat outage",
            f"{len(outage.rebooted_machines)}  ({outage.reboots} reboots: {outage.reboots_while_down} while it was"
            f" down, {outage.reboots_after_restart} after; at most {outage.silent_at_peak} machines silent at once)",
        ),
        ("machines rebooted during bring-up", str(len(report.bringup_rebooted_machines))),
        ("fleet whole again after the outage", seconds(outage.all_back_after)),
        ("stray agent processes at the end", str(sum(report.stray_agents.values()))),
        ("unplanned process exits", str(sum(report.unplanned_exits.values()))),
        ("wall time", seconds(report.wall_seconds)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"chaos: {report.machines} machines, seed {report.seed}; during bring-up {settings['worker_kills']} worker "
        f"kills, one Temporal and one PostgreSQL restart; heartbeat server down {outage.seconds_down:.0f}s "
        f"(heartbeat timeout {settings['heartbeat_timeout']:g}s, reconcile every {settings['reconcile_interval']:g}s)",
        "",
    ]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    details = [
        ("not WATCHING at the end", report.not_watching_at_end),
        ("rebooted by the outage", [f"{m}" for m in outage.rebooted_machines]),
        ("reboot causes in the outage", [f"{c} x{n}" for c, n in outage.reboot_causes.items()]),
        ("fleet events in the outage", [f"{k} x{n}" for k, n in outage.fleet_events.items()]),
        ("rebooted during bring-up", report.bringup_rebooted_machines),
        ("reboot causes in bring-up", [f"{c} x{n}" for c, n in report.bringup_reboot_causes.items()]),
        ("created twice", [f"{slot} x{n}" for slot, n in report.created_twice.items()]),
        ("BMDB rows still creating", report.bmdb_still_creating),
        *((f"BMDB: {what}", rows) for what, rows in {**report.bmdb_duplicated, **report.bmdb_orphaned}.items()),
        ("stray agents", [f"{slot} +{n}" for slot, n in report.stray_agents.items()]),
        ("unplanned exits", [f"{name} x{n}" for name, n in report.unplanned_exits.items()]),
        ("notes", report.notes),
    ]
    shown = [(what, items) for what, items in details if items]
    if shown:
        lines.append("")
    for what, items in shown:
        more = f" (+{len(items) - 12} more)" if len(items) > 12 else ""
        lines.append(f"{what}: {', '.join(items[:12])}{more}")
    lines += ["", "faults (after s, WATCHING then, serving again within s):"]
    for fault in report.faults:
        then = "-" if fault.watching_then is None else str(fault.watching_then)
        lines.append(f"  {fault.kind:<20} {seconds(fault.struck_after):>6} {then:>5} {seconds(fault.back_within):>6}")
    return lines


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def parse_options(argv: Sequence[str] | None = None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=positive(int), default=200, help="simulated machines (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault plan (default %(default)s)")
    parser.add_argument("--worker-kills", type=int, default=10, help="SIGKILLs of the worker (default %(default)s)")
    parser.add_argument("--heartbeat-timeout", type=positive(float), default=30.0, help="seconds (default %(default)s)")
    parser.add_argument(
        "--reconcile-interval", type=positive(float), default=5.0, help="seconds between passes (default %(default)s)"
    )
    parser.add_argument(
        "--margin",
        type=positive(float),
        default=10.0,
        help="extra seconds of outage and of watch (default %(default)s)",
    )
    parser.add_argument(
        "--after-outage",
        type=positive(float),
        # The agents' retry back-off reaches its cap after an outage this long: give them all time to come back.
        default=AGENT_MAX_RETRY_INTERVAL + 100.0,
        help="watch at most this many seconds after the heartbeat outage (default %(default)s)",
    )
    parser.add_argument(
        "--bringup-limit",
        type=positive(float),
        default=420.0,
        help="go on to the outage after this many seconds of bring-up (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as a JSON document")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, state) and say where")
    args = parser.parse_args(argv)
    if args.worker_kills < 0:
        parser.error("--worker-kills must not be negative")
    options = Options(
        machines=args.machines,
        seed=args.seed,
        worker_kills=args.worker_kills,
        heartbeat_timeout=args.heartbeat_timeout,
        reconcile_interval=args.reconcile_interval,
        margin=args.margin,
        after_outage=args.after_outage,
        bringup_limit=args.bringup_limit,
    )
    return options, args


async def run(stack: Stack, options: Options) -> Report:
    task = asyncio.current_task()
    assert task is not None
    # SIGTERM stops the run as Ctrl-C does; the caller stops the stack.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await ChaosRun(stack, options).run()


T = TypeVar("T")


def run_on_stack(stack: Stack, work: Callable[[], Coroutine[Any, Any, T]], *, keep: bool = False) -> T:
    """What a benchmark's run on the stack found; the stack stopped after it, and its directory removed unless keep
    or the run broke (its logs and state are then kept, and said where). Raises SystemExit: 130 when interrupted,
    1 when the run broke (what broke it is said)."""
    try:
        return asyncio.run(work())
    except (KeyboardInterrupt, asyncio.CancelledError):
        stack.say("interrupted")
        raise SystemExit(130) from None
    except ChaosError as error:
        stack.say(f"the run broke: {error}")
        keep = True
        raise SystemExit(1) from None
    except Exception:
        keep = True
        raise
    finally:
        stack.say("stopping the stack")
        stack.close()
        if keep:
            stack.say(f"logs and state kept in {stack.root}")
        else:
            shutil.rmtree(stack.root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    options, args = parse_options(argv)
    stack = Stack(Path(tempfile.mkdtemp(prefix="shepherd-chaos-")).resolve(), options, time.monotonic())
    report = run_on_stack(stack, lambda: run(stack, options), keep=args.keep)
    if args.json:
        print(json.dumps(report.document(), indent=2, default=str))
    else:
        print("\n".join(table(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
