"""``shepherd decommission``: retire a machine for good (the ``decommission`` update).

The machine's workflow answers when the decommission begins, or refuses and says why (being decommissioned
already, or in another operator's maintenance, which it names: ``--force`` overrides that). Its agent is
stopped, the machine released or powered off through its provider, BMDB marks it retired, and its workflow
completes; no fleet pass adopts it again. The same update the Temporal CLI sends with
``temporal workflow update execute --name decommission``.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import DECOMMISSION_UPDATE
from operations.policy_file import DECOMMISSION
from shepherd.commands.base import Subcommands, add_common
from shepherd.commands.bulk import add_machines, run_update


def register(commands: Subcommands) -> None:
    """Add ``shepherd decommission`` to the commands."""
    parser = commands.add_parser(
        "decommission", help="retire a machine for good: stop its agent, release or power it off, never adopt it again"
    )
    add_common(parser)
    add_machines(parser, "why; kept in BMDB, the event log and history")
    parser.add_argument(
        "--force", action="store_true", help="decommission a machine in maintenance too, ending that maintenance"
    )
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Ask MACHINE, or each machine --where selects, to be decommissioned for good."""
    return run_update(
        settings,
        args,
        DECOMMISSION_UPDATE,
        DECOMMISSION,
        doing="decommission (for good)",
        then="decommission it",
        force=args.force,
    )
