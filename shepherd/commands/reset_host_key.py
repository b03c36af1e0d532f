"""``shepherd reset-host-key``: forget a machine's pinned SSH host key after a reinstall.

Shepherd pins the host key it sees at first contact and refuses a different
one, because a changed key may be an impostor. When the operator knows the
machine was reinstalled, this command forgets the pin (logging who said why)
and asks the machine's workflow to retry its takeover now; that takeover pins
the key it sees.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from shepherd.commands.base import (
    EXIT_OK,
    MACHINE_HELP,
    Subcommands,
    add_by,
    add_common,
    operate_machines,
    operator,
    reason_arg,
)


def register(commands: Subcommands) -> None:
    """Add ``shepherd reset-host-key`` to the commands."""
    parser = commands.add_parser(
        "reset-host-key", help="forget a reinstalled machine's pinned SSH host key and retry its takeover now"
    )
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help="why; kept in the event log")
    add_by(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Forget MACHINE's host key pin and ask its workflow to retry its takeover now."""
    by = args.by or operator()
    print(operate_machines(settings, args, lambda operators: operators.reset_host_key(args.machine, args.reason, by)))
    return EXIT_OK
