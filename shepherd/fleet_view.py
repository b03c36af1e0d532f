"""What the fleet looks like: BMDB's records joined with each workflow's stage."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
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
    return [
        MachineView(record, stages.get(machine_workflow_id(record.provider, record.provider_id), "-"))
        for record in await bmdb.list_machines()
    ]


def format_machines(views: list[MachineView]) -> list[str]:
    """Lines of a table that fits 80 columns."""
    lines = [f"{'PROVIDER ID':<20} {'ADDRESS':<21} {'STAGE':<15} AGENT STARTED"]
    for view in views:
        record = view.record
        address = f"{record.address}:{record.ssh_port}" if record.address else "-"
        started = record.agent_started_at.strftime("%Y-%m-%d %H:%M:%S") if record.agent_started_at else "-"
        lines.append(f"{record.provider_id:<20} {address:<21} {view.stage:<15} {started}")
    return lines


async def print_machines(settings: Settings, database_url: str, out: TextIO = sys.stdout) -> int:
    from worker import connect_temporal, open_bmdb

    client = await connect_temporal(settings)
    bmdb = await open_bmdb(database_url)
    try:
        views = await fleet_view(client, bmdb)
    finally:
        await bmdb.close()
    for line in format_machines(views):
        print(line, file=out)
    return 0
