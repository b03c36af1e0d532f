"""What an operator reads of machines: the fleet's table, one machine whole, the event log."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio.client import Client
from temporalio.service import RPCError

from bmdb.store import Event, MachineRecord
from lifecycle.contracts import (
    MACHINE_STAGE,
    MACHINE_WORKFLOW_TYPE,
    RUNNING_MACHINES,
    STATUS_QUERY,
    MachineStage,
    MachineStatus,
    machine_workflow_id,
)
from operations.connections import Connections
from operations.machine_names import describe_workflow, resolve_machine

# The stage of a machine without a running workflow.
NO_WORKFLOW = "-"
# The status query needs a worker; without one the operator learns so in seconds.
QUERY_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class MachineView:
    """One machine in the fleet's table: BMDB's record, its workflow's stage, its recoveries."""

    record: MachineRecord
    stage: str  # the workflow's MachineStage, or NO_WORKFLOW
    recoveries: int


@dataclass(frozen=True)
class MachineDetail:
    """One machine whole: BMDB's record beside its workflow's state and status."""

    record: MachineRecord
    recoveries: int  # reboots in the event log, across every workflow run
    workflow_id: str
    workflow_state: str  # RUNNING, COMPLETED, ..., or NOT STARTED
    status: MachineStatus | None
    status_missing: str | None  # why there is no status, when there is none


async def machine_stages(client: Client) -> dict[str, str]:
    """Workflow id -> MachineStage of every running machine workflow."""
    stages: dict[str, str] = {}
    async for execution in client.list_workflows(RUNNING_MACHINES):
        stages[execution.id] = execution.typed_search_attributes.get(MACHINE_STAGE) or NO_WORKFLOW
    return stages


async def machine_status(client: Client, workflow_id: str) -> MachineStatus:
    """The machine workflow's answer to its status query; RPCError when no worker answers in time."""
    return await client.get_workflow_handle(workflow_id).query(
        STATUS_QUERY, result_type=MachineStatus, rpc_timeout=QUERY_TIMEOUT
    )


class MachineReads(Connections):
    """The reads of machines, each from Temporal and BMDB together."""

    async def fleet_view(self) -> list[MachineView]:
        """Every machine BMDB records, with its workflow's stage (decommissioned ones as such) and recoveries."""
        stages = await machine_stages(await self.temporal())
        bmdb = await self.bmdb()
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

    async def machine_detail(self, name: str) -> MachineDetail:
        """The machine of that name whole; where its workflow cannot answer, why not."""
        client = await self.temporal()
        bmdb = await self.bmdb()
        record = await resolve_machine(bmdb, name)
        recoveries = (await bmdb.recovery_counts(record.machine_id)).get(record.machine_id, 0)
        workflow_id = machine_workflow_id(record.provider, record.provider_id)

        def without_status(state: str, missing: str) -> MachineDetail:
            return MachineDetail(record, recoveries, workflow_id, state, None, missing)

        description = await describe_workflow(client, workflow_id)
        if description is None:
            return without_status("NOT STARTED", "the workflow has not been started; the next fleet pass starts it")
        state = description.status.name if description.status else "UNKNOWN"
        if description.workflow_type != MACHINE_WORKFLOW_TYPE:
            return without_status(state, f"{workflow_id} is a {description.workflow_type} workflow, not a machine's")
        if state == "COMPLETED":
            return without_status(state, "the machine was decommissioned, which completed its workflow")
        if state != "RUNNING":
            return without_status(state, "the workflow is not running; the next fleet pass starts it again")
        try:
            status = await machine_status(client, workflow_id)
        except RPCError as error:
            return without_status(state, f"no worker answered the status query ({error.message or error.status.name})")
        return MachineDetail(record, recoveries, workflow_id, state, status, None)

    async def events(
        self, name: str | None, limit: int, *, actions: bool = False
    ) -> tuple[MachineRecord | None, list[Event]]:
        """The event log, newest first: of the machine of that name, or the fleet's own without one. actions:
        only what operators asked and the reboots, of every machine when no name is given."""
        bmdb = await self.bmdb()
        record = None if name is None else await resolve_machine(bmdb, name)
        machine_id = None if record is None else record.machine_id
        return record, await (bmdb.list_actions if actions else bmdb.list_events)(machine_id, limit=limit)
