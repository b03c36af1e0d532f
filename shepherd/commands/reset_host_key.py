"""``shepherd reset-host-key``: forget a machine's pinned SSH host key after a reinstall.

Shepherd pins the host key it sees at first contact and refuses a different
one, because a changed key may be an impostor. When the operator knows the
machine was reinstalled, this command forgets the pin (logging who said why)
and asks the machine's workflow to retry its takeover now. That takeover pins
the first key to answer, unless the operator names the fingerprint the new key
has (--expect-fingerprint): then only a key with it is pinned, and an impostor
that answers first is refused.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from operations.machine_actions import check_fingerprint
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
    parser.add_argument(
        "--expect-fingerprint",
        metavar="SHA256:...",
        type=fingerprint_arg,
        help="pin only a host key with this fingerprint, as `ssh-keygen -lf` prints it on the machine's console; "
        "without it, the first key to answer is pinned",
    )
    add_by(parser)
    parser.set_defaults(run=run)


def fingerprint_arg(text: str) -> str:
    """An argparse type: check_fingerprint."""
    try:
        return check_fingerprint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Forget MACHINE's host key pin and ask its workflow to retry its takeover now."""
    by = args.by or operator()
    expect = args.expect_fingerprint
    print(
        operate_machines(
            settings, args, lambda operators: operators.reset_host_key(args.machine, args.reason, by, expect)
        )
    )
    return EXIT_OK
