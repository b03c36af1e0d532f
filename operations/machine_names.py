"""One machine from whatever name an operator has at hand.

A workflow id (``machine-sim-node-0007``), a provider id (``node-0007``), a
BMDB machine id, or a prefix of one long enough to be unique.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from bmdb.store import BMDB, MachineRecord
from lifecycle.contracts import MACHINE_WORKFLOW_TYPE, machine_workflow_id
from operations.connections import OperatorError

# Short enough to type, long enough that a typo rarely hits another machine.
MIN_ID_PREFIX = 4
_ID_PREFIX = re.compile(r"^[0-9a-fA-F-]+$")
_SHOWN_CANDIDATES = 5


class MachineNotFound(OperatorError):
    """No machine, or more than one, goes by that name, or its workflow does not run; the message says which."""


async def resolve_machine(bmdb: BMDB, name: str) -> MachineRecord:
    """The one machine BMDB knows by that name; MachineNotFound naming the candidates when none or several."""
    candidates: dict[str, MachineRecord] = {}
    for record in await _matches(bmdb, name.strip()):
        candidates[str(record.machine_id)] = record
    if not candidates:
        raise MachineNotFound(
            f"no machine {name!r}: it is neither a BMDB machine id (or a unique prefix of one), "
            "a provider id nor a workflow id"
        )
    if len(candidates) > 1:
        shown = sorted(candidates.values(), key=lambda r: (r.provider, r.provider_id))[:_SHOWN_CANDIDATES]
        listed = ", ".join(f"{r.machine_id} ({machine_workflow_id(r.provider, r.provider_id)})" for r in shown)
        more = " and more" if len(candidates) > len(shown) else ""
        raise MachineNotFound(f"{name!r} is ambiguous: it names {listed}{more}; give more of it")
    return next(iter(candidates.values()))


async def _matches(bmdb: BMDB, name: str) -> list[MachineRecord]:
    if not name:
        return []
    found = await bmdb.machines_with_provider_id(name)
    if name.startswith("machine-"):
        # The provider may contain dashes too: try every split of the rest.
        rest = name.removeprefix("machine-")
        for at in (i for i, char in enumerate(rest) if char == "-"):
            provider, provider_id = rest[:at], rest[at + 1 :]
            found += [r for r in await bmdb.machines_with_provider_id(provider_id) if r.provider == provider]
    if len(name) >= MIN_ID_PREFIX and _ID_PREFIX.match(name):
        found += await bmdb.machines_with_id_prefix(name.lower(), limit=_SHOWN_CANDIDATES + 1)
    return found


async def describe_workflow(client: Client, workflow_id: str) -> WorkflowExecutionDescription | None:
    """The latest run of the workflow, or None when none ever ran under that id."""
    try:
        return await client.get_workflow_handle(workflow_id).describe()
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


async def find_machine_workflow(client: Client, open_bmdb: Callable[[], Awaitable[BMDB]], machine: str) -> str:
    """The workflow id of the machine named by a workflow id, a provider id or a BMDB machine id (or prefix).

    BMDB is opened (by open_bmdb, whose caller closes it) only when the name is not a machine workflow's id.
    """
    if machine.startswith("machine-"):
        description = await describe_workflow(client, machine)
        if description is not None:
            if description.workflow_type != MACHINE_WORKFLOW_TYPE:
                raise MachineNotFound(f"{machine} is a {description.workflow_type} workflow, not a machine's")
            return machine
    record = await resolve_machine(await open_bmdb(), machine)
    return machine_workflow_id(record.provider, record.provider_id)


async def running_machine_workflow(
    client: Client, open_bmdb: Callable[[], Awaitable[BMDB]], machine: str, *, then: str
) -> str:
    """find_machine_workflow, refusing a workflow that does not run; then: what to do once it runs again."""
    workflow_id = await find_machine_workflow(client, open_bmdb, machine)
    description = await describe_workflow(client, workflow_id)
    if description is None:
        raise MachineNotFound(f"{workflow_id} has never run; the next fleet pass starts it, then {then}")
    if description.status == WorkflowExecutionStatus.COMPLETED:
        # Only a decommission completes a machine's workflow; nothing starts it again.
        when = f" at {description.close_time.isoformat(timespec='seconds')}" if description.close_time else ""
        raise MachineNotFound(f"{workflow_id} was decommissioned{when}: it is retired for good")
    if description.status != WorkflowExecutionStatus.RUNNING:
        state = description.status.name if description.status else "not running"
        raise MachineNotFound(
            f"{workflow_id} is {state}, not running; the next fleet pass starts it again, then {then}"
        )
    return workflow_id
