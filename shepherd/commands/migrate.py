"""``shepherd migrate``: create or upgrade the BMDB schema; safe to run again."""

from __future__ import annotations

import argparse

from bmdb import migrate
from bmdb.connection_errors import first_line
from bmdb.local_postgres import bmdb_url
from bmdb.store import BMDBUnavailable
from foundation.settings import Settings
from foundation.settings_report import redact_url
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common


def register(commands: Subcommands) -> None:
    """Add ``shepherd migrate`` to the commands."""
    parser = commands.add_parser("migrate", help="create or upgrade the BMDB schema")
    add_common(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Create or upgrade the BMDB schema and print the revision it is at."""
    with bmdb_url(settings) as url:
        try:
            migrate.upgrade(url)
        except BMDBUnavailable:
            raise  # the command line names the setting, database_url
        except Exception as error:
            raise CommandError(f"cannot migrate BMDB at {redact_url(url)}: {first_line(error)}") from None
        print(f"BMDB at {redact_url(url)} is at schema revision {migrate.current_revision(url)}")
    return EXIT_OK
