"""What every command shares: its errors and exit codes, argument types, the common flags, and the operator client.

Every subcommand reads its settings from ``SHEPHERD_*`` environment variables
(below them an optional TOML file); flags override them.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeAlias, TypeVar

from foundation.setting_values import parse_duration
from foundation.settings import Settings
from lifecycle.contracts import MaintenanceRequest, OperatorRequest
from operations.api_client import ApiOperatorClient
from operations.client import MachineOperators, OperatorClient, operator_client
from operations.connections import OperatorError
from operations.machine_actions import check_reason

# What each command's register() adds its parser to.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

T = TypeVar("T")
C = TypeVar("C", bound="Closing")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

# What `shepherd COMMAND -h` calls the MACHINE argument.
MACHINE_HELP = "BMDB machine id (or a unique prefix), provider id or workflow id"

# The flags that are settings too; a flag given wins over the environment and the file.
_SETTING_FLAGS = (
    "temporal_address",
    "temporal_namespace",
    "database_url",
    "state_dir",
    "task_queue",
    "heartbeat_listen",
    "heartbeat_processes",
)


class Closing(Protocol):
    """A client that is closed once a command is done with it."""

    async def close(self) -> None: ...


class CommandError(Exception):
    """A command could not do its job; the message is shown as it is, and the exit code is 1."""


class UsageError(Exception):
    """The arguments do not go together; shown with the usage, and the exit code is 2."""


def duration_arg(text: str) -> float:
    """An argparse type: seconds from 30s, 250ms, 5m, 4h."""
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def reason_arg(text: str) -> str:
    """An argparse type: check_reason."""
    try:
        return check_reason(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def operator() -> str:
    """Who runs this command, for the record of an operator action: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid, in a bare container
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def add_by(parser: argparse.ArgumentParser) -> None:
    """--by: who asked, recorded with the action; the default is the user and host running the command. And
    --break-glass, as every command that reaches machines takes."""
    parser.add_argument(
        "--by",
        type=_by_arg,
        help="who asks, recorded with the action (default: user@host); not through the operator API, which "
        "records who logged in",
    )
    parser.add_argument(
        "--confirm",
        metavar="WHAT",
        help="through the operator API, what its policy asks typed back: the machine's provider id, the provider "
        "instance's name, or the count of machines --where selects",
    )
    add_break_glass(parser)


def add_break_glass(parser: argparse.ArgumentParser) -> None:
    """--break-glass: straight to Temporal and BMDB although api_url names an operator API."""
    parser.add_argument(
        "--break-glass",
        action="store_true",
        help="with api_url set: straight to Temporal and BMDB, not through the operator API, for when it is down; "
        "needs their credentials, and actions are recorded unverified",
    )


def _by_arg(text: str) -> str:
    by = text.strip()
    if not by or len(by) > 100:
        raise argparse.ArgumentTypeError(f"--by names who asks, in 1 to 100 characters; got {text!r}")
    return by


def show(
    out: TextIO | None,
    as_json: bool,
    document: Callable[[], Any],
    lines: Callable[[], Iterable[str]],
    *,
    indent: int | None = 2,
) -> int:
    """Print a command's answer to out (stdout): the document as JSON with --json, else its lines; exit code 0."""
    out = out or sys.stdout
    if as_json:
        json.dump(document(), out, indent=indent)
        out.write("\n")
    else:
        for line in lines():
            print(line, file=out)
    return EXIT_OK


def add_common(parser: argparse.ArgumentParser) -> None:
    """The flags every command takes: where Temporal, BMDB, the state and the settings file are."""
    defaults = Settings()
    parser.add_argument("--temporal-address", help=f"Temporal frontend host:port (default {defaults.temporal_address})")
    parser.add_argument("--namespace", dest="temporal_namespace", help="Temporal namespace")
    parser.add_argument("--database-url", help="BMDB URL; unset: a local PostgreSQL under --state-dir")
    parser.add_argument("--state-dir", type=Path, help=f"directory for local state (default {defaults.state_dir})")
    parser.add_argument("--config", type=Path, help="TOML file of settings, below the environment (SHEPHERD_CONFIG)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")


def resolve_settings(args: argparse.Namespace) -> tuple[Settings, dict[str, str]]:
    """The settings with the flags given on top, and where each one came from."""
    overrides: dict[str, Any] = {}
    for name in _SETTING_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings.resolve(config_path=getattr(args, "config", None), **overrides)


def operate(settings: Settings, act: Callable[[OperatorClient], Awaitable[T]]) -> T:
    """Run act with an operator client straight to Temporal and BMDB; a request it could not do ends the command
    with why. For what only goes that way (the embedded stack, --break-glass)."""
    return _run_closing(OperatorClient(settings), act)


def through_api(settings: Settings, args: argparse.Namespace) -> bool:
    """Whether the command goes through the operator API: api_url is set and --break-glass not given. --by is
    refused through it, and --break-glass said on stderr, since both change who the record names."""
    if not settings.api_url or getattr(args, "break_glass", False):
        if getattr(args, "confirm", None) is not None:
            raise UsageError("--confirm answers the operator API's policy, and this command does not go through it")
    if not settings.api_url:
        return False
    if getattr(args, "break_glass", False):
        print(
            f"break glass: straight to Temporal and BMDB, not through the operator API at {settings.api_url}; "
            "recorded unverified",
            file=sys.stderr,
        )
        return False
    if getattr(args, "by", None) is not None:
        raise UsageError(
            "--by is not taken through the operator API, which records the operator it verified; "
            "it goes with --break-glass"
        )
    return True


def operate_machines(
    settings: Settings, args: argparse.Namespace, act: Callable[[MachineOperators], Awaitable[T]]
) -> T:
    """Run act with the operator client args and settings choose: through the operator API where api_url names
    one, else (or with --break-glass) straight to Temporal and BMDB; a request it could not do ends the command
    with why."""
    confirm = getattr(args, "confirm", None)
    client = operator_client(settings, break_glass=not through_api(settings, args), confirm=confirm)
    return _run_closing(client, act)


def operate_api(
    settings: Settings, act: Callable[[ApiOperatorClient], Awaitable[T]], args: argparse.Namespace | None = None
) -> T:
    """Run act with a client of the operator API (sending args' --confirm); a request it could not do ends the
    command with why. For a command whose through_api() said so."""
    return _run_closing(ApiOperatorClient(settings, confirm=getattr(args, "confirm", None)), act)


def _run_closing(client: C, act: Callable[[C], Awaitable[T]]) -> T:
    async def run() -> T:
        try:
            return await act(client)
        finally:
            await client.close()

    try:
        return asyncio.run(run())
    except OperatorError as error:
        raise CommandError(str(error)) from None


def ask_machine(
    settings: Settings,
    args: argparse.Namespace,
    update: str,
    request: OperatorRequest | MaintenanceRequest,
    *,
    then: str,
) -> int:
    """Send the update to args.machine's workflow and print its answer; a refusal ends the command with its reason.

    then: what the operator should do once a workflow that does not run runs again.
    """
    print(operate_machines(settings, args, lambda operators: operators.ask(args.machine, update, request, then=then)))
    return EXIT_OK
