"""``shepherd decommission``: retire a machine for good (the ``decommission`` update).

The machine's workflow answers when the decommission begins, or refuses and says why (being decommissioned
already). Its agent is stopped, the machine released or powered off through its provider, BMDB marks it retired,
and its workflow completes; no fleet pass adopts it again. The same update the Temporal CLI sends with
``temporal workflow update execute --name decommission``.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import DECOMMISSION_UPDATE
from shepherd.commands.base import (
    MACHINE_HELP,
    Subcommands,
    add_by,
    add_common,
    ask_machine,
    operator,
    reason_arg,
)
from shepherd.commands.bulk import add_where, check_target, run_bulk, updating


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "decommission", help="retire a machine for good: stop its agent, release or power it off, never adopt it again"
    )
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", nargs="?", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help="why; kept in BMDB, the event log and history")
    add_by(parser)
    add_where(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    check_target(args)
    request = {"reason": args.reason, "by": args.by or operator()}
    if args.where is not None:
        return run_bulk(settings, args, "decommission (for good)", updating(DECOMMISSION_UPDATE, request))
    return ask_machine(settings, args.machine, DECOMMISSION_UPDATE, request, then="decommission it")
