"""``shepherd events MACHINE``: a machine's event log from BMDB, newest first."""

from __future__ import annotations

import argparse
from typing import TextIO

from bmdb.store import BMDB, Event, MachineRecord
from foundation.settings import Settings
from lifecycle.contracts import machine_workflow_id
from shepherd.commands.base import MACHINE_HELP, Subcommands, add_common, no_temporal, positive_int, show, with_bmdb
from shepherd.commands.machine_ref import resolve_machine

_DETAIL_WIDTH = 80 - 19 - 18 - 2


def format_events(record: MachineRecord, events: list[Event]) -> list[str]:
    """A heading and one line per event, 80 columns; long details are cut, --json has them whole."""
    lines = [
        f"{record.provider_id} ({machine_workflow_id(record.provider, record.provider_id)}), "
        f"BMDB machine {record.machine_id}",
        f"{'AT (UTC)':<19} {'KIND':<18} DETAIL",
    ]
    for event in events:
        detail = " ".join(event.detail.split())
        if len(detail) > _DETAIL_WIDTH:
            detail = detail[: _DETAIL_WIDTH - 3] + "..."
        lines.append(f"{event.at.strftime('%Y-%m-%d %H:%M:%S'):<19} {event.kind:<18} {detail}")
    if not events:
        lines.append("(no events)")
    return lines


async def print_events(bmdb: BMDB, name: str, limit: int, *, as_json: bool = False, out: TextIO | None = None) -> int:
    record = await resolve_machine(bmdb, name)
    events = await bmdb.list_events(record.machine_id, limit=limit)
    rows = [{"at": e.at.isoformat(), "kind": e.kind, "detail": e.detail} for e in events]
    return show(
        out,
        as_json,
        lambda: {"machine_id": str(record.machine_id), "provider_id": record.provider_id, "events": rows},
        lambda: format_events(record, events),
        indent=None,
    )


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("events", help="a machine's event log, newest first")
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--limit", type=positive_int, default=50, help="at most this many events (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="JSON, with details uncut")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    return with_bmdb(
        settings, no_temporal, lambda _, bmdb: print_events(bmdb, args.machine, args.limit, as_json=args.json)
    )
