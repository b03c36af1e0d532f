"""``shepherd maintenance``: take a machine out of automation for hardware work, and back (``set_maintenance``).

The machine's workflow answers what happens, or refuses and says why (already in maintenance, not in it,
quarantined). The same update the Temporal CLI sends with ``temporal workflow update execute --name
set_maintenance``.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import SET_MAINTENANCE_UPDATE, MaintenanceRequest
from operations.policy_file import MAINTENANCE
from shepherd.commands.base import (
    MACHINE_HELP,
    Subcommands,
    UsageError,
    add_by,
    add_common,
    ask_machine,
    operator,
    reason_arg,
)
from shepherd.commands.bulk import add_where, check_target, run_bulk, updating


def register(commands: Subcommands) -> None:
    """Add ``shepherd maintenance`` to the commands."""
    parser = commands.add_parser(
        "maintenance", help="take a machine out of automation (--on) for hardware work, and back (--off)"
    )
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", nargs="?", help=MACHINE_HELP)
    switch = parser.add_mutually_exclusive_group(required=True)
    switch.add_argument("--on", action="store_true", help="never reboot or take it over until --off")
    switch.add_argument("--off", action="store_true", help="back to automation; its agent's heartbeat decides")
    parser.add_argument("--reason", type=reason_arg, help="why; required with --on, kept in the event log")
    parser.add_argument("--recover", action="store_true", help="with --off: reboot it and take it over again")
    add_by(parser)
    add_where(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Put MACHINE, or each machine --where selects, into maintenance (--on) or back (--off)."""
    check_target(args)
    if args.on and args.reason is None:
        raise UsageError("--on needs --reason: why the machine goes into maintenance")
    if args.recover and not args.off:
        raise UsageError("--recover goes with --off")
    request = MaintenanceRequest(on=args.on, reason=args.reason or "", by=args.by or operator(), recover=args.recover)

    if args.where is not None:
        doing = "maintenance on" if args.on else "maintenance off" + (" and a reboot" if args.recover else "")
        body = (
            {"on": args.on}
            | ({"reason": args.reason} if args.reason else {})
            | ({"recover": True} if args.recover else {})
        )
        return run_bulk(settings, args, doing, updating(SET_MAINTENANCE_UPDATE, request), MAINTENANCE, body)
    return ask_machine(settings, args, SET_MAINTENANCE_UPDATE, request, then="ask again once it runs")
