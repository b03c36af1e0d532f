"""``shepherd heartbeat-server``: serve the agents' authenticated heartbeats until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio

from bmdb.local_postgres import heartbeat_bmdb_url
from foundation.settings import Settings
from processes.heartbeat_server import HeartbeatProcessStopped, run_heartbeat_server, serve_in_processes
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common, positive_int


def register(commands: Subcommands) -> None:
    """Add ``shepherd heartbeat-server`` to the commands."""
    parser = commands.add_parser("heartbeat-server", help="serve the agents' authenticated heartbeats")
    add_common(parser)
    parser.add_argument("--listen", dest="heartbeat_listen", help=f"host:port (default {Settings().heartbeat_listen})")
    parser.add_argument(
        "--processes",
        dest="heartbeat_processes",
        type=positive_int,
        help="processes sharing the port, for hosts with more cores (default 1)",
    )
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Serve the agents' heartbeats, in one process or several sharing the port, until stopped."""
    settings.check_heartbeat_server()
    with heartbeat_bmdb_url(settings) as url:
        try:
            if settings.heartbeat_processes > 1:
                serve_in_processes(settings, url, settings.heartbeat_processes, verbose=args.verbose)
            else:
                asyncio.run(run_heartbeat_server(settings, url))
        except (OSError, HeartbeatProcessStopped) as error:
            raise CommandError(str(error)) from None
    return EXIT_OK
