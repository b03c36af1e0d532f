"""The ``shepherd`` command.

Every subcommand reads its settings from ``SHEPHERD_*`` environment variables;
flags override them. A bad setting or an unreachable service ends the command
with one line naming the problem and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from temporalio.service import RPCError

from bmdb.store import BMDB, BMDBUnavailable
from foundation.logs import configure_logging
from foundation.settings import Settings, SettingsError, parse_duration

T = TypeVar("T")
C = TypeVar("C")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A command could not do its job; the message is shown as it is."""


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _reason_arg(text: str) -> str:
    from shepherd.commands.recover import check_reason

    try:
        return check_reason(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


MACHINE_HELP = "BMDB machine id (or a unique prefix), provider id or workflow id"


def _stage_arg(text: str) -> str:
    from lifecycle.contracts import MachineStage
    from shepherd.commands.machines import NO_WORKFLOW

    stages = [stage.value for stage in MachineStage] + [NO_WORKFLOW]
    if text.upper() not in stages:
        raise argparse.ArgumentTypeError(f"{text!r} is not a stage; one of {', '.join(stages)}")
    return text.upper()


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temporal-address", help="Temporal frontend host:port (SHEPHERD_TEMPORAL_ADDRESS)")
    parser.add_argument("--namespace", dest="temporal_namespace", help="Temporal namespace")
    parser.add_argument("--database-url", help="BMDB URL; unset: a local PostgreSQL under --state-dir")
    parser.add_argument("--state-dir", type=Path, help="directory for local state (default .shepherd)")
    parser.add_argument("--config", type=Path, help="TOML file of settings, below the environment (SHEPHERD_CONFIG)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shepherd", description="Bare-metal fleet manager on Temporal.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dev = commands.add_parser("dev", help="run the embedded stack with a simulated fleet")
    _add_common(dev)
    dev.add_argument("--machines", type=_positive_int, default=20, help="simulated machines (default 20)")
    dev.add_argument(
        "--until-ready", action="store_true", help="exit 0 once every machine is WATCHING, non-zero after --timeout"
    )
    dev.add_argument("--timeout", type=_duration_arg, default=600.0, help="limit for --until-ready (default 10m)")
    dev.add_argument("--fresh", action="store_true", help="forget the fleet of earlier runs and start over")
    dev.add_argument("--chaos", action="store_true", help="kill a random machine's agent every --chaos-interval")
    dev.add_argument("--chaos-interval", type=_duration_arg, default=60.0, help="time between agent kills (default 1m)")
    dev.add_argument("--chaos-kills", type=_positive_int, help="stop killing after this many (default: never)")

    worker = commands.add_parser("worker", help="run a worker against Temporal and BMDB")
    _add_common(worker)
    worker.add_argument("--task-queue", help="task queue (default shepherd)")

    migrate = commands.add_parser("migrate", help="create or upgrade the BMDB schema")
    _add_common(migrate)

    heartbeat = commands.add_parser("heartbeat-server", help="serve the agents' authenticated heartbeats")
    _add_common(heartbeat)
    heartbeat.add_argument("--listen", dest="heartbeat_listen", help="host:port (default 0.0.0.0:8900)")

    recover = commands.add_parser("recover", help="reboot a machine and take it over again (force_recover)")
    _add_common(recover)
    recover.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    recover.add_argument("--reason", required=True, type=_reason_arg, help="why; shown in status and the event log")

    reset_key = commands.add_parser(
        "reset-host-key", help="forget a reinstalled machine's pinned SSH host key and retry its takeover now"
    )
    _add_common(reset_key)
    reset_key.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    reset_key.add_argument("--reason", required=True, type=_reason_arg, help="why; kept in the event log")

    machines = commands.add_parser("machines", help="each machine's stage, agent age, last heartbeat and recoveries")
    _add_common(machines)
    machines.add_argument("--stage", type=_stage_arg, help="only machines in this stage (or - for no workflow)")
    machines.add_argument("--provider", help="only machines of this provider")
    machines.add_argument("--json", action="store_true", help="a JSON list instead of the table")

    status = commands.add_parser(
        "status", help="one machine whole: its workflow's status query beside BMDB's agent and last heartbeat"
    )
    _add_common(status)
    status.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    status.add_argument("--json", action="store_true", help="JSON, with every value uncut")

    events = commands.add_parser("events", help="a machine's event log, newest first")
    _add_common(events)
    events.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    events.add_argument("--limit", type=_positive_int, default=50, help="at most this many events (default 50)")
    events.add_argument("--json", action="store_true", help="JSON, with details uncut")

    fleet = commands.add_parser("fleet", help="the fleet schedule and its last passes; pause, resume, trigger")
    _add_common(fleet)
    change = fleet.add_mutually_exclusive_group()
    change.add_argument("--pause", action="store_true", help="stop scheduling passes (machines keep their workflows)")
    change.add_argument("--resume", action="store_true", help="schedule passes again")
    change.add_argument("--trigger", action="store_true", help="run a pass now")
    fleet.add_argument("--note", default="", help="why, kept with the schedule's state (with --pause/--resume)")
    fleet.add_argument("--passes", type=_positive_int, default=5, help="how many recent passes to show (default 5)")
    fleet.add_argument("--json", action="store_true", help="JSON instead of the table")

    config = commands.add_parser("config", help="the effective settings and where each comes from, secrets hidden")
    _add_common(config)
    config.add_argument("--json", action="store_true", help="JSON instead of TOML")

    sim = commands.add_parser("sim", help="run the fleet simulator (provider API and SSH machines)", add_help=False)
    sim.add_argument("sim_args", nargs=argparse.REMAINDER)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    return resolve_settings(args)[0].check()


def resolve_settings(args: argparse.Namespace) -> tuple[Settings, dict[str, str]]:
    overrides: dict[str, Any] = {}
    for name in (
        "temporal_address",
        "temporal_namespace",
        "database_url",
        "state_dir",
        "task_queue",
        "heartbeat_listen",
    ):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings.resolve(config_path=getattr(args, "config", None), **overrides)


@contextmanager
def database(settings: Settings) -> Iterator[str]:
    """The BMDB URL from settings, or a local PostgreSQL's while the block runs."""
    if settings.database_url:
        yield settings.database_url
        return
    from bmdb.local_postgres import LocalPostgres

    with LocalPostgres(settings.state_dir / "postgres") as url:
        yield url


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from simulator.__main__ import main as simulator_main

        return simulator_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "fleet" and args.note and not (args.pause or args.resume):
        parser.error("--note goes with --pause or --resume")
    if args.command == "dev":
        from shepherd.commands.dev import DevOptions

        try:
            args.dev_options = DevOptions(
                machines=args.machines,
                until_ready=args.until_ready,
                timeout=args.timeout,
                fresh=args.fresh,
                chaos=args.chaos,
                chaos_interval=args.chaos_interval,
                chaos_kills=args.chaos_kills,
            )
        except ValueError as error:
            parser.error(str(error))
    configure_logging(verbose=args.verbose)
    try:
        return _run(args)
    except (SettingsError, CommandError) as error:
        print(f"shepherd {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, SettingsError) else EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`shepherd machines | head`): nothing more to say, and nowhere to say it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


def _run(args: argparse.Namespace) -> int:
    from worker import StartupError

    settings = settings_from(args)
    configure_logging(settings.log_format, verbose=args.verbose)
    try:
        if args.command == "dev":
            from shepherd.commands.dev import run_dev

            return run_dev(settings, args.dev_options)
        if args.command == "config":
            return _config(args)
        if args.command == "migrate":
            return _migrate(settings)
        if args.command == "worker":
            return _worker(settings)
        if args.command == "machines":
            return _machines(settings, args)
        if args.command == "reset-host-key":
            return _reset_host_key(settings, args)
        if args.command == "status":
            return _status(settings, args)
        if args.command == "events":
            return _events(settings, args)
        if args.command == "fleet":
            return _fleet(settings, args)
        if args.command == "heartbeat-server":
            return _heartbeat_server(settings)
        if args.command == "recover":
            return _recover(settings, args.machine, args.reason)
    except StartupError as error:
        raise CommandError(str(error)) from None
    except RPCError as error:
        raise CommandError(f"Temporal at {settings.temporal_address} refused: {error.message}") from None
    except BMDBUnavailable as error:
        raise CommandError(f"{error} (setting database_url)") from None
    raise CommandError(f"unknown command {args.command!r}")


def _migrate(settings: Settings) -> int:
    from bmdb import migrate
    from bmdb.store import redact_url

    with database(settings) as url:
        try:
            migrate.upgrade(url)
        except Exception as error:
            raise CommandError(f"cannot migrate BMDB at {redact_url(url)}: {error}") from None
        print(f"BMDB at {redact_url(url)} is at schema revision {migrate.current_revision(url)}")
    return EXIT_OK


def _worker(settings: Settings) -> int:
    from worker import run_worker

    settings.check_agent()
    with database(settings) as url:
        asyncio.run(run_worker(settings, url))
    return EXIT_OK


def _heartbeat_server(settings: Settings) -> int:
    from heartbeat_server import run_heartbeat_server

    settings.check_heartbeat_server()
    with database(settings) as url:
        try:
            asyncio.run(run_heartbeat_server(settings, url))
        except OSError as error:
            raise CommandError(str(error)) from None
    return EXIT_OK


def _machines(settings: Settings, args: argparse.Namespace) -> int:
    from shepherd.commands.machines import MachineFilter, print_machines

    only = MachineFilter(stage=args.stage, provider=args.provider)
    with database(settings) as url:
        return asyncio.run(print_machines(settings, url, only=only, as_json=args.json))


async def _no_temporal() -> None:
    return None


def _with_bmdb(
    settings: Settings,
    first: Callable[[], Awaitable[C]],
    act: Callable[[C, BMDB], Awaitable[T]],
    *errors: type[Exception],
) -> T:
    """Run act with what first connects (Temporal, or nothing) and BMDB open.

    A machine not found, or one of errors, ends the command with its message.
    """
    from shepherd.commands.machine_ref import MachineNotFound
    from worker import open_bmdb

    async def run(url: str) -> T:
        connected = await first()
        bmdb = await open_bmdb(url)
        try:
            return await act(connected, bmdb)
        finally:
            await bmdb.close()

    told: tuple[type[Exception], ...] = (MachineNotFound, *errors)
    with database(settings) as url:
        try:
            return asyncio.run(run(url))
        except told as error:
            raise CommandError(str(error)) from None


def _events(settings: Settings, args: argparse.Namespace) -> int:
    from shepherd.commands.events import print_events

    return _with_bmdb(
        settings, _no_temporal, lambda _, bmdb: print_events(bmdb, args.machine, args.limit, as_json=args.json)
    )


def _reset_host_key(settings: Settings, args: argparse.Namespace) -> int:
    from shepherd.commands.reset_host_key import HostKeyError, reset_host_key
    from worker import connect_temporal

    # Temporal first: a pin is not reset when the workflow cannot be told.
    message = _with_bmdb(
        settings,
        lambda: connect_temporal(settings),
        lambda client, bmdb: reset_host_key(client, bmdb, args.machine, args.reason),
        HostKeyError,
    )
    print(message)
    return EXIT_OK


def _status(settings: Settings, args: argparse.Namespace) -> int:
    from shepherd.commands.status import print_status
    from worker import connect_temporal

    return _with_bmdb(
        settings,
        lambda: connect_temporal(settings),
        lambda client, bmdb: print_status(client, bmdb, args.machine, as_json=args.json),
    )


def _fleet(settings: Settings, args: argparse.Namespace) -> int:
    from shepherd.commands.fleet import FleetAction, FleetError, print_fleet
    from worker import connect_temporal

    action = FleetAction(pause=args.pause, resume=args.resume, trigger=args.trigger, note=args.note)

    async def show() -> int:
        client = await connect_temporal(settings)
        return await print_fleet(client, action, passes=args.passes, as_json=args.json)

    try:
        return asyncio.run(show())
    except FleetError as error:
        raise CommandError(str(error)) from None


def _recover(settings: Settings, machine: str, reason: str) -> int:
    from shepherd.commands.recover import RecoverError, RecoverRequest, request_recovery
    from worker import connect_temporal, open_bmdb

    async def recover(url_of_bmdb: Callable[[], str]) -> str:
        client = await connect_temporal(settings)
        return await request_recovery(client, lambda: open_bmdb(url_of_bmdb()), RecoverRequest(machine, reason))

    # BMDB (and a local PostgreSQL) only when the workflow id alone does not do.
    with ExitStack() as stack:
        try:
            print(asyncio.run(recover(lambda: stack.enter_context(database(settings)))))
        except RecoverError as error:
            raise CommandError(str(error)) from None
    return EXIT_OK


def _config(args: argparse.Namespace) -> int:
    from foundation.settings import effective_settings

    settings, sources = resolve_settings(args)
    settings.check()
    print(effective_settings(settings, sources, as_json=args.json), end="")
    return EXIT_OK
