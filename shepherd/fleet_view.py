"""What the fleet looks like: BMDB's records joined with each workflow's stage and recovery count."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TextIO

from temporalio.client import Client

from bmdb.store import BMDB, MachineRecord
from shepherd.settings import Settings
from workflows.types import MACHINE_STAGE, MACHINE_WORKFLOW_TYPE, machine_workflow_id

RUNNING_MACHINES = f'WorkflowType = "{MACHINE_WORKFLOW_TYPE}" AND ExecutionStatus = "Running"'


@dataclass(frozen=True)
class MachineView:
    record: MachineRecord
    stage: str  # the workflow's MachineStage; "-" when no workflow runs
    recoveries: int


async def machine_stages(client: Client) -> dict[str, str]:
    """Workflow id -> MachineStage of every running machine workflow."""
    stages: dict[str, str] = {}
    async for execution in client.list_workflows(RUNNING_MACHINES):
        stages[execution.id] = execution.typed_search_attributes.get(MACHINE_STAGE) or "-"
    return stages


async def stage_counts(client: Client) -> Counter[str]:
    return Counter((await machine_stages(client)).values())


async def fleet_view(client: Client, bmdb: BMDB) -> list[MachineView]:
    stages = await machine_stages(client)
    recoveries = await bmdb.recovery_counts()
    return [
        MachineView(
            record,
            stages.get(machine_workflow_id(record.provider, record.provider_id), "-"),
            recoveries.get(record.machine_id, 0),
        )
        for record in await bmdb.list_machines()
    ]


def age(then: datetime | None, now: datetime) -> str:
    """How long ago, in at most six characters: 42s, 3m07s, 5h12m, 12d04h."""
    if then is None:
        return "-"
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def format_machines(views: list[MachineView], now: datetime) -> list[str]:
    """Lines of a table that fits 80 columns; agent start and last heartbeat as ages."""
    row = "{:<14} {:<21} {:<14} {:>6} {:>9} {:>10}"
    lines = [row.format("PROVIDER ID", "ADDRESS", "STAGE", "AGENT", "HEARTBEAT", "RECOVERIES")]
    for view in views:
        record = view.record
        address = f"{record.address}:{record.ssh_port}" if record.address else "-"
        lines.append(
            row.format(
                record.provider_id,
                address,
                view.stage,
                age(record.agent_started_at, now),
                age(record.agent_heartbeat_at, now),
                view.recoveries,
            )
        )
    return lines


async def print_machines(settings: Settings, database_url: str, out: TextIO | None = None) -> int:
    from worker import connect_temporal, open_bmdb

    client = await connect_temporal(settings)
    bmdb = await open_bmdb(database_url)
    try:
        views = await fleet_view(client, bmdb)
    finally:
        await bmdb.close()
    for line in format_machines(views, datetime.now(UTC)):
        print(line, file=out or sys.stdout)
    return 0
