"""``shepherd config``: the effective settings and where each one comes from, secrets hidden."""

from __future__ import annotations

import argparse

from foundation.settings import Settings, effective_settings
from shepherd.commands.base import EXIT_OK, Subcommands, add_common, resolve_settings


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("config", help="the effective settings and where each comes from, secrets hidden")
    add_common(parser)
    parser.add_argument("--json", action="store_true", help="JSON instead of TOML")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    _, sources = resolve_settings(args)
    print(effective_settings(settings, sources, as_json=args.json), end="")
    return EXIT_OK
