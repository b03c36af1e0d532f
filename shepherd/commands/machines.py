"""``shepherd machines``: what the fleet looks like, BMDB's records joined with each workflow's stage and recoveries."""

from __future__ import annotations

import argparse
import asyncio
import textwrap
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from temporalio.client import Client

from bmdb.migrate import open_bmdb
from bmdb.store import BMDB, MachineRecord
from foundation.settings import Settings, format_duration
from foundation.startup import connect_temporal
from lifecycle.contracts import MACHINE_STAGE, RUNNING_MACHINES, MachineStage, machine_workflow_id
from shepherd.commands.base import Subcommands, add_common, database, show

NO_WORKFLOW = "-"


@dataclass(frozen=True)
class MachineView:
    """One machine as ``shepherd machines`` lists it: BMDB's record, its workflow's stage, its recoveries."""

    record: MachineRecord
    stage: str  # the workflow's MachineStage, or NO_WORKFLOW
    recoveries: int


async def machine_stages(client: Client) -> dict[str, str]:
    """Workflow id -> MachineStage of every running machine workflow."""
    stages: dict[str, str] = {}
    async for execution in client.list_workflows(RUNNING_MACHINES):
        stages[execution.id] = execution.typed_search_attributes.get(MACHINE_STAGE) or NO_WORKFLOW
    return stages


async def stage_counts(client: Client) -> Counter[str]:
    return Counter((await machine_stages(client)).values())


async def fleet_view(client: Client, bmdb: BMDB) -> list[MachineView]:
    stages = await machine_stages(client)
    recoveries = await bmdb.recovery_counts()
    return [
        MachineView(
            record,
            MachineStage.DECOMMISSIONED.value
            if record.retired_at
            else stages.get(machine_workflow_id(record.provider, record.provider_id), NO_WORKFLOW),
            recoveries.get(record.machine_id, 0),
        )
        for record in await bmdb.list_machines()
    ]


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


def record_json(record: MachineRecord, recoveries: int) -> dict[str, Any]:
    """What BMDB knows of a machine, as the --json of the commands shows it."""

    def when(at: datetime | None) -> str | None:
        return at.isoformat() if at else None

    return {
        "provider": record.provider,
        "provider_id": record.provider_id,
        "machine_id": str(record.machine_id),
        "workflow_id": machine_workflow_id(record.provider, record.provider_id),
        "address": record.address,
        "ssh_port": record.ssh_port,
        "bmdb_status": record.status,
        "agent_started_at": when(record.agent_started_at),
        "last_heartbeat_at": when(record.agent_heartbeat_at),
        "missing_at_provider_since": when(record.missing_since),
        "stuck_since": when(record.stuck_since),
        "decommissioned_at": when(record.retired_at),
        "decommission_reason": record.retired_reason,
        "recoveries": recoveries,
    }


def machine_json(view: MachineView) -> dict[str, Any]:
    return record_json(view.record, view.recoveries) | {"stage": None if view.stage == NO_WORKFLOW else view.stage}


@dataclass(frozen=True)
class MachineFilter:
    """Which machines ``shepherd machines`` lists: of one stage, of one provider; None admits any but the
    decommissioned, which are history."""

    stage: str | None = None  # a MachineStage, or NO_WORKFLOW
    provider: str | None = None

    def admits(self, view: MachineView) -> bool:
        if self.stage is None and view.stage == MachineStage.DECOMMISSIONED:
            return False
        return (self.stage is None or view.stage == self.stage) and (
            self.provider is None or view.record.provider == self.provider
        )


async def print_machines(
    settings: Settings,
    database_url: str,
    out: TextIO | None = None,
    *,
    only: MachineFilter = MachineFilter(),
    as_json: bool = False,
) -> int:
    client = await connect_temporal(settings)
    bmdb = await open_bmdb(database_url)
    try:
        views = [view for view in await fleet_view(client, bmdb) if only.admits(view)]
    finally:
        await bmdb.close()
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
    parser = commands.add_parser("machines", help="each machine's stage, agent age, last heartbeat and recoveries")
    add_common(parser)
    parser.add_argument("--stage", type=stage_arg, help="only machines in this stage (or - for no workflow)")
    parser.add_argument("--provider", help="only machines of this provider")
    parser.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    only = MachineFilter(stage=args.stage, provider=args.provider)
    with database(settings) as url:
        return asyncio.run(print_machines(settings, url, only=only, as_json=args.json))
