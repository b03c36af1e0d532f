"""``shepherd machines``: what the fleet looks like, BMDB's records joined with each workflow's stage and recoveries."""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TextIO

from foundation.setting_values import format_duration
from foundation.settings import Settings
from lifecycle.contracts import MachineStage
from operations.client import MachineOperators
from operations.machine_documents import machine_json
from operations.machine_reads import NO_WORKFLOW, MachineView
from shepherd.commands.base import Subcommands, add_break_glass, add_common, operate_machines, show


def age(then: datetime | None, now: datetime) -> str:
    """How long ago, in at most six characters: 42s, 3m07s, 5h12m, 12d04h."""
    if then is None:
        return "-"
    return format_duration(max(0, int((now - then).total_seconds())), most_units=2)


def format_machines(views: list[MachineView], now: datetime) -> list[str]:
    """Lines of a table that fits 80 columns; agent start and last heartbeat as ages.

    A machine its provider no longer lists shows as MISSING: it is left alone until listed again. Machines
    flagged stuck are named below the table, with how long they have been.
    """
    row = "{:<14} {:<21} {:<14} {:>6} {:>9} {:>10}"
    lines = [row.format("PROVIDER ID", "ADDRESS", "STAGE", "AGENT", "HEARTBEAT", "RECOVERIES")]
    for view in views:
        record = view.record
        address = f"{record.address}:{record.ssh_port}" if record.address else "-"
        lines.append(
            row.format(
                record.provider_id,
                address,
                "MISSING" if record.missing_since else view.stage,
                age(record.agent_started_at, now),
                age(record.agent_heartbeat_at, now),
                view.recoveries,
            )
        )
    stuck = [f"{v.record.provider_id} ({age(v.record.stuck_since, now)})" for v in views if v.record.stuck_since]
    if stuck:
        lines += textwrap.wrap(
            ", ".join(stuck),
            80,
            initial_indent="stuck past their stage's deadline: ",
            subsequent_indent="  ",
        )
    return lines


@dataclass(frozen=True)
class MachineFilter:
    """Which machines ``shepherd machines`` lists: of one stage, of one provider; None admits any but the
    decommissioned, which are history."""

    stage: str | None = None  # a MachineStage, or NO_WORKFLOW
    provider: str | None = None

    def admits(self, view: MachineView) -> bool:
        """Whether the machine is one the listing shows."""
        if self.stage is None and view.stage == MachineStage.DECOMMISSIONED:
            return False
        return (self.stage is None or view.stage == self.stage) and (
            self.provider is None or view.record.provider == self.provider
        )


async def print_machines(
    operators: MachineOperators,
    out: TextIO | None = None,
    *,
    only: MachineFilter = MachineFilter(),
    as_json: bool = False,
) -> int:
    """Print the fleet's machines the filter admits, as a table or as JSON."""
    views = [view for view in await operators.fleet_view() if only.admits(view)]
    return show(
        out, as_json, lambda: [machine_json(view) for view in views], lambda: format_machines(views, datetime.now(UTC))
    )


def stage_arg(text: str) -> str:
    """An argparse type: a MachineStage, or NO_WORKFLOW for machines without a running workflow."""
    stages = [stage.value for stage in MachineStage] + [NO_WORKFLOW]
    if text.upper() not in stages:
        raise argparse.ArgumentTypeError(f"{text!r} is not a stage; one of {', '.join(stages)}")
    return text.upper()


def register(commands: Subcommands) -> None:
    """Add ``shepherd machines`` to the commands."""
    parser = commands.add_parser("machines", help="each machine's stage, agent age, last heartbeat and recoveries")
    add_common(parser)
    parser.add_argument("--stage", type=stage_arg, help="only machines in this stage (or - for no workflow)")
    parser.add_argument("--provider", help="only machines of this provider")
    parser.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    add_break_glass(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Print the fleet's machines, narrowed by --stage and --provider, as a table or as JSON."""
    only = MachineFilter(stage=args.stage, provider=args.provider)
    return operate_machines(settings, args, lambda operators: print_machines(operators, only=only, as_json=args.json))
