"""``shepherd sim``: run the fleet simulator; its arguments are the simulator's own."""

from __future__ import annotations

import argparse

from shepherd.commands.base import Subcommands
from simulator.__main__ import main

__all__ = ["main", "register"]


def register(commands: Subcommands) -> None:
    """Add ``shepherd sim`` to the commands, for the help; main runs it."""
    # Listed for `shepherd -h`; the cli hands `shepherd sim ...` to main before parsing.
    parser = commands.add_parser("sim", help="run the fleet simulator (provider API and SSH machines)", add_help=False)
    parser.add_argument("sim_args", nargs=argparse.REMAINDER)
