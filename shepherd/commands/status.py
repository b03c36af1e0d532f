"""``shepherd status MACHINE``: one machine whole, its workflow's answer beside BMDB's records.

The workflow's ``status`` query knows the stage, attempts, errors and
recoveries; the agent's heartbeats live in BMDB only (a healthy machine's
workflow is never woken for them). This command puts both on one page.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import TextIO

from foundation.settings import Settings
from lifecycle.contracts import MachineStatus
from operations.client import MachineOperators
from operations.machine_documents import detail_json
from operations.machine_reads import MachineDetail
from shepherd.commands.base import MACHINE_HELP, Subcommands, add_break_glass, add_common, operate_machines, show
from shepherd.commands.machines import age

_LABEL = "{:<19} {}"
_VALUE_WIDTH = 80 - 20


def _fit(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 3] + "..."


def _at(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    return f"{moment.astimezone(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC ({age(moment, now)} ago)"


def _at_text(iso: str | None, now: datetime) -> str:
    return "-" if iso is None else _at(datetime.fromisoformat(iso), now)


def format_detail(detail: MachineDetail, now: datetime) -> list[str]:
    """Label and value lines that fit 80 columns; --json has every value uncut."""
    record, status = detail.record, detail.status
    address = f"{record.address}:{record.ssh_port}" if record.address else "-"
    rows: list[tuple[str, str]] = [
        ("machine", f"{record.provider_id} ({record.provider}), BMDB {record.machine_id}"),
        ("workflow", f"{detail.workflow_id}, {detail.workflow_state}"),
    ]
    if status is None:
        rows.append(("stage", f"unknown: {detail.status_missing}"))
    else:
        rows.append(("stage", f"{status.stage} since {_at_text(status.stage_since, now)}"))
        if status.attempts:
            rows.append(("attempts", str(status.attempts)))
        if status.last_error:
            rows.append(("last error", status.last_error))
        if status.next_attempt_at:
            rows.append(("next attempt", _at_text(status.next_attempt_at, now)))
    rows += [
        ("address", address),
        ("BMDB status", record.status),
        ("agent started", _at(record.agent_started_at, now)),
    ]
    if record.retired_at:
        rows.append(("decommissioned", f"{_at(record.retired_at, now)}: {record.retired_reason}"))
    if record.missing_since:
        rows.append(("missing", f"not listed by its provider since {_at(record.missing_since, now)}; left alone"))
    if status is not None and status.agent is not None:
        rows.append(("agent key", status.agent.key_fingerprint))
        rows += [("agent warning", warning) for warning in status.agent.warnings]
    rows.append(("last heartbeat", _at(record.agent_heartbeat_at, now)))
    rows.append(("recoveries", str(detail.recoveries)))
    if status is not None:
        if status.last_recovery_reason:
            rows.append(("last recovery", status.last_recovery_reason))
        if status.recovery_requested:
            rows.append(("recovery requested", status.recovery_requested.describe()))
        if status.recovery_requests_coalesced:
            rows.append(("requests coalesced", str(status.recovery_requests_coalesced)))
        rows += _operator_rows(status, now)
    return [_LABEL.format(label, _fit(value)) for label, value in rows]


def _operator_rows(status: MachineStatus, now: datetime) -> list[tuple[str, str]]:
    """What holds the machine apart from automation, and who put it there."""
    rows: list[tuple[str, str]] = []
    if status.maintenance:
        m = status.maintenance
        rows.append(("maintenance", f"since {_at_text(m.since, now)}, by {m.by}: {m.reason}"))
    if status.quarantine:
        rows.append(("quarantined", f"since {_at_text(status.quarantine.since, now)}: {status.quarantine.reason}"))
    if status.stuck:
        rows.append(("stuck", f"since {_at_text(status.stuck.since, now)}: {status.stuck.reason}"))
    if status.decommission:
        d = status.decommission
        rows.append(("decommission", f"asked {_at_text(d.since, now)} by {d.by}: {d.reason}"))
        if d.agent:
            rows.append(("agent stop", d.agent))
        if d.provider_action:
            rows.append(("provider", f"{d.provider_action}: {d.provider_detail}"))
    # The last few, newest last; `shepherd events MACHINE --actions` has them all.
    rows += [("asked", f"{a.action} by {a.by}, {_at_text(a.at, now)}: {a.reason}") for a in status.actions[-3:]]
    return rows


async def print_status(
    operators: MachineOperators, name: str, *, as_json: bool = False, out: TextIO | None = None
) -> int:
    """Print the machine of that name whole, as lines or as JSON."""
    detail = await operators.machine_detail(name)
    return show(out, as_json, lambda: detail_json(detail), lambda: format_detail(detail, datetime.now(UTC)))


def register(commands: Subcommands) -> None:
    """Add ``shepherd status`` to the commands."""
    parser = commands.add_parser(
        "status", help="one machine whole: its workflow's status query beside BMDB's agent and last heartbeat"
    )
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--json", action="store_true", help="JSON, with every value uncut")
    add_break_glass(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Print MACHINE whole: its workflow's status beside BMDB's records."""
    return operate_machines(settings, args, lambda operators: print_status(operators, args.machine, as_json=args.json))
