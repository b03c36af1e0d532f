"""``shepherd recover``: ask one machine's workflow for a recovery reboot.

The same ``force_recover`` signal the Temporal CLI and UI send; this command
only finds the workflow from whatever name the operator has at hand.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import RecoveryRequest
from operations.client import OperatorClient
from operations.machine_actions import Target
from shepherd.commands.base import EXIT_OK, Subcommands, add_common, operate, operator
from shepherd.commands.bulk import add_machines, check_target, run_bulk


def register(commands: Subcommands) -> None:
    """Add ``shepherd recover`` to the commands."""
    parser = commands.add_parser("recover", help="reboot a machine and take it over again (force_recover)")
    add_common(parser)
    add_machines(parser, "why; shown in status and the event log")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Ask MACHINE, or each machine --where selects, for a recovery reboot."""
    check_target(args)
    request = RecoveryRequest(args.reason, args.by or operator())
    if args.where is not None:

        async def force(operators: OperatorClient, target: Target) -> str:
            await operators.signal_recovery(target.workflow_id, request)
            return f"{target.workflow_id}: recovery requested ({args.reason}); it was {target.stage}"

        return run_bulk(settings, args, "a reboot and a new takeover", force)
    print(operate(settings, lambda operators: operators.recover(args.machine, request)))
    return EXIT_OK
