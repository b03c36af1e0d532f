"""``shepherd worker``: run a worker process against Temporal and BMDB until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio

from bmdb.local_postgres import bmdb_url
from foundation.settings import Settings
from processes.worker import run_worker
from shepherd.commands.base import EXIT_OK, Subcommands, add_common


def register(commands: Subcommands) -> None:
    """Add ``shepherd worker`` to the commands."""
    parser = commands.add_parser("worker", help="run a worker against Temporal and BMDB")
    add_common(parser)
    parser.add_argument("--task-queue", help=f"task queue (default {Settings().task_queue})")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run a worker against Temporal and BMDB until stopped."""
    settings.check_agent()
    with bmdb_url(settings) as url:
        asyncio.run(run_worker(settings, url))
    return EXIT_OK
