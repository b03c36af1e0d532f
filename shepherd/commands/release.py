"""``shepherd release``: let a quarantined machine be recovered again (the ``release`` update).

The machine's workflow answers: released, or refused and why (it is not quarantined). The same update the
Temporal CLI sends with ``temporal workflow update execute --name release``.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import RELEASE_UPDATE, OperatorRequest
from shepherd.commands.base import (
    MACHINE_HELP,
    Subcommands,
    add_by,
    add_common,
    ask_machine,
    operator,
    reason_arg,
)


def register(commands: Subcommands) -> None:
    """Add ``shepherd release`` to the commands."""
    parser = commands.add_parser("release", help="let a QUARANTINED machine be recovered again (the release update)")
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help="why; kept in the event log and the history")
    add_by(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Ask MACHINE's workflow to release it from quarantine."""
    request = OperatorRequest(args.reason, args.by or operator())
    return ask_machine(settings, args, RELEASE_UPDATE, request, then="release it if it is quarantined again")
