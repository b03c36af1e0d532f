"""``shepherd heartbeat-server``: serve the agents' authenticated heartbeats until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio

from foundation.settings import Settings
from processes.heartbeat_server import run_heartbeat_server
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common, database


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("heartbeat-server", help="serve the agents' authenticated heartbeats")
    add_common(parser)
    parser.add_argument("--listen", dest="heartbeat_listen", help=f"host:port (default {Settings().heartbeat_listen})")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    settings.check_heartbeat_server()
    with database(settings) as url:
        try:
            asyncio.run(run_heartbeat_server(settings, url))
        except OSError as error:
            raise CommandError(str(error)) from None
    return EXIT_OK
