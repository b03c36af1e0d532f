"""``shepherd events [MACHINE] [--actions]``: BMDB's event log, newest first.

Of one machine, or without MACHINE the fleet's own events (a refused pass, recoveries held). ``--actions``
keeps what operators asked for, each naming who, and the reboots: of one machine, or of every machine and the
fleet, which answers "who rebooted node-17 last night".
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from bmdb.store import Event
from foundation.settings import Settings
from operations.api_client import ApiOperatorClient
from operations.client import OperatorClient
from operations.documents import events_document, events_from_document
from shepherd.commands.base import (
    MACHINE_HELP,
    Subcommands,
    add_break_glass,
    add_common,
    operate,
    operate_api,
    positive_int,
    show,
    through_api,
)

_CLOCK = "%Y-%m-%d %H:%M:%S"
_FLEET = "(fleet)"


def _cut(detail: str, width: int) -> str:
    detail = " ".join(detail.split())
    return detail if len(detail) <= width else detail[: width - 3] + "..."


def format_events(heading: str, events: list[Event], *, by_machine: bool = False) -> list[str]:
    """A heading and one line per event, 80 columns; long details are cut, --json has them whole.

    by_machine: a column naming each event's machine, for a listing that spans machines.
    """
    if by_machine:
        lines = [heading, f"{'AT (UTC)':<19} {'MACHINE':<13} {'KIND':<16} DETAIL"]
        lines += [
            f"{e.at.strftime(_CLOCK):<19} {(e.provider_id or _FLEET)[:13]:<13} {e.kind:<16} {_cut(e.detail, 28)}"
            for e in events
        ]
    else:
        lines = [heading, f"{'AT (UTC)':<19} {'KIND':<18} DETAIL"]
        lines += [f"{e.at.strftime(_CLOCK):<19} {e.kind:<18} {_cut(e.detail, 41)}" for e in events]
    if not events:
        lines.append("(no events)")
    return lines


async def print_events(
    operators: OperatorClient,
    name: str | None,
    limit: int,
    *,
    actions: bool = False,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Print the event log of the machine of that name, or the fleet's, as lines or as JSON."""
    record, events = await operators.events(name, limit, actions=actions)
    return show_events(events_document(record, events), actions=actions, as_json=as_json, out=out)


def show_events(document: dict[str, Any], *, actions: bool, as_json: bool = False, out: TextIO | None = None) -> int:
    """Print an event log's document, as lines or as JSON, whether BMDB or the operator API gave it."""
    heading, events = events_from_document(document)
    if heading is None:
        heading = "the fleet's " + ("operator actions and reboots on every machine" if actions else "events")
    lines = format_events(heading, events, by_machine=actions and document["machine_id"] is None)
    return show(out, as_json, lambda: document, lambda: lines, indent=None)


def register(commands: Subcommands) -> None:
    """Add ``shepherd events`` to the commands."""
    parser = commands.add_parser(
        "events", help="a machine's event log, or the fleet's, newest first; --actions: who asked for what"
    )
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", nargs="?", help=f"{MACHINE_HELP}; none: the fleet's")
    parser.add_argument(
        "--actions", action="store_true", help="only operator actions (each naming who) and reboots; of every machine"
    )
    parser.add_argument("--limit", type=positive_int, default=50, help="at most this many events (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="JSON, with details uncut")
    add_break_glass(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Print the event log of MACHINE, or the fleet's; --actions: only operator actions and reboots."""
    if through_api(settings, args):

        async def ask(operators: ApiOperatorClient) -> dict[str, Any]:
            return await operators.events_document(args.machine, args.limit, actions=args.actions)

        document = operate_api(settings, ask)
        return show_events(document, actions=args.actions, as_json=args.json)
    return operate(
        settings,
        lambda operators: print_events(operators, args.machine, args.limit, actions=args.actions, as_json=args.json),
    )
