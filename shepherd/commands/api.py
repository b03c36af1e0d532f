"""``shepherd api``: serve the operator API until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio

from foundation.settings import Settings
from processes.operator_api import run_operator_api
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common


def register(commands: Subcommands) -> None:
    """Add ``shepherd api`` to the commands."""
    parser = commands.add_parser(
        "api", help="serve the operator API: machines and operators' requests over HTTP, for verified operators"
    )
    add_common(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Serve the operator API until stopped."""
    settings.check_api()
    try:
        asyncio.run(run_operator_api(settings))
    except OSError as error:
        raise CommandError(str(error)) from None
    return EXIT_OK
