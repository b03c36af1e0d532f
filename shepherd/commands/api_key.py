"""``shepherd api-key create FILE``: a new signing key for the operator API, and the line workers trust it by."""

from __future__ import annotations

import argparse
from pathlib import Path

from foundation.operator_proof import public_key_text
from foundation.settings import Settings
from processes.api_signing_key import create_signing_key
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands


def register(commands: Subcommands) -> None:
    """Add ``shepherd api-key`` to the commands."""
    parser = commands.add_parser("api-key", help="make the operator API's signing key (api-key create FILE)")
    actions = parser.add_subparsers(dest="api_key_action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="write a new key to FILE (mode 0600, never over an existing file)")
    create.add_argument("file", metavar="FILE", type=Path, help="where to write it: api_signing_key_path")
    create.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Write a new key to FILE and print its public half as SHEPHERD_API_TRUSTED_KEYS takes it."""
    try:
        signer = create_signing_key(args.file)
    except FileExistsError:
        raise CommandError(f"{args.file} exists; a key workers trust is not replaced (remove it to rotate)") from None
    except OSError as error:
        raise CommandError(f"cannot write {args.file}: {error.strerror}") from None
    print(f"SHEPHERD_API_TRUSTED_KEYS={public_key_text(signer.public_key)}")
    return EXIT_OK
