"""``shepherd recover`` and ``shepherd reimage``: ask one machine's workflow for a recovery reboot, or a reimage.

Both send the ``force_recover`` signal the Temporal CLI and UI send (a reimage with ``"reimage": true``); these
commands only find the workflow from whatever name the operator has at hand.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import RecoveryRequest
from operations.client import OperatorClient
from operations.machine_actions import Target
from operations.policy_file import RECOVER, REIMAGE
from shepherd.commands.base import EXIT_OK, Subcommands, add_common, operate_machines, operator
from shepherd.commands.bulk import add_machines, check_target, run_bulk


def register(commands: Subcommands) -> None:
    """Add ``shepherd recover`` and ``shepherd reimage`` to the commands."""
    recover = commands.add_parser("recover", help="reboot a machine and take it over again (force_recover)")
    reimage = commands.add_parser(
        "reimage",
        help="put a fresh OS on a machine through its provider and take it over again (force_recover, reimage)",
    )
    for parser, reimaging in ((recover, False), (reimage, True)):
        add_common(parser)
        add_machines(parser, "why; shown in status and the event log")
        parser.set_defaults(run=run, reimage=reimaging)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Ask MACHINE, or each machine --where selects, for a recovery reboot (or a reimage)."""
    check_target(args)
    request = RecoveryRequest(args.reason, args.by or operator(), reimage=args.reimage)
    what = "reimage" if args.reimage else "recovery"
    if args.where is not None:

        async def force(operators: OperatorClient, target: Target) -> str:
            await operators.signal_recovery(target.workflow_id, request)
            return f"{target.workflow_id}: {what} requested ({args.reason}); it was {target.stage}"

        doing = "a reimage and a new takeover" if args.reimage else "a reboot and a new takeover"
        action = REIMAGE if args.reimage else RECOVER
        return run_bulk(settings, args, doing, force, action, {"reason": args.reason})
    print(operate_machines(settings, args, lambda operators: operators.recover(args.machine, request)))
    return EXIT_OK
