"""``shepherd ssh-key``: Shepherd's public SSH key, for the machines' authorized_keys; created when absent."""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from foundation.ssh_identity import SSHIdentityError, load_or_create_ssh_key, public_key_openssh
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common


def register(commands: Subcommands) -> None:
    """Add ``shepherd ssh-key`` to the commands."""
    parser = commands.add_parser(
        "ssh-key", help="print Shepherd's public SSH key for authorized_keys (created when absent)"
    )
    add_common(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Print Shepherd's public SSH key in OpenSSH form, creating the key when absent."""
    try:
        key = load_or_create_ssh_key(settings.effective_ssh_key_path)
    except SSHIdentityError as error:
        raise CommandError(f"{error} (setting ssh_key_path)") from None
    print(public_key_openssh(key))
    return EXIT_OK
