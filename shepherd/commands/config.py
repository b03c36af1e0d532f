"""``shepherd config``: the effective settings and where each one comes from, secrets hidden."""

from __future__ import annotations

import argparse
import json

from foundation.settings import Settings
from foundation.settings_report import effective_settings
from foundation.temporal_connection import TemporalConfigError, load_temporal_connection
from providers.registry import declared_secret_options, provider_types
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common, resolve_settings


def register(commands: Subcommands) -> None:
    """Add ``shepherd config`` to the commands."""
    parser = commands.add_parser("config", help="the effective settings and where each comes from, secrets hidden")
    add_common(parser)
    parser.add_argument("--json", action="store_true", help="JSON instead of TOML")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Print the effective settings and the Temporal connection, each with its source, as TOML or JSON."""
    _, sources = resolve_settings(args)
    try:
        connection = load_temporal_connection(settings).described()
    except TemporalConfigError as error:
        raise CommandError(str(error)) from None
    types = provider_types()
    secret = {instance.name: declared_secret_options(instance, types) for instance in settings.provider_instances}
    text = effective_settings(settings, sources, as_json=args.json, secret_options=secret)
    if args.json:
        shown = json.loads(text)
        shown["temporal_connection"] = [{"part": p, "value": v, "source": s} for p, v, s in connection]
        print(json.dumps(shown, indent=2))
        return EXIT_OK
    # Comments, so the output stays a settings file Shepherd can read back.
    lines = ["", "# The Temporal connection in effect: the Temporal CLI's configuration, then the settings above."]
    lines += [f"#   {part} = {value}  ({source})" for part, value, source in connection]
    print(text + "\n".join(lines))
    return EXIT_OK
