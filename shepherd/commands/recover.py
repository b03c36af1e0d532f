"""``shepherd recover``: ask one machine's workflow for a recovery reboot.

The same ``force_recover`` signal the Temporal CLI and UI send; this command
only finds the workflow from whatever name the operator has at hand.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta

from temporalio.client import Client, WorkflowExecutionStatus

from bmdb.migrate import open_bmdb
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import (
    FORCE_RECOVER_SIGNAL,
    MACHINE_WORKFLOW_TYPE,
    STATUS_QUERY,
    MachineStatus,
    machine_workflow_id,
)
from shepherd.commands.base import (
    EXIT_OK,
    MACHINE_HELP,
    CommandError,
    Subcommands,
    add_common,
    check_reason,
    database,
    reason_arg,
)
from shepherd.commands.machine_ref import MachineNotFound, describe_workflow, resolve_machine

_QUERY_TIMEOUT = timedelta(seconds=5)


class RecoverError(Exception):
    """The machine could not be found or asked; the message says which and why."""


@dataclass(frozen=True)
class RecoverRequest:
    """What ``shepherd recover`` was asked: the machine, by any of its names, and the operator's reason."""

    machine: str  # a BMDB machine id, a provider id or a workflow id
    reason: str


async def _machine_workflow_exists(client: Client, workflow_id: str) -> bool:
    description = await describe_workflow(client, workflow_id)
    if description is None:
        return False
    if description.workflow_type != MACHINE_WORKFLOW_TYPE:
        raise RecoverError(f"{workflow_id} is a {description.workflow_type} workflow, not a machine's")
    return True


async def find_machine_workflow(client: Client, open_bmdb: Callable[[], Awaitable[BMDB]], machine: str) -> str:
    """The workflow id of the machine named by a workflow id, a provider id or a BMDB machine id (or prefix)."""
    if machine.startswith("machine-") and await _machine_workflow_exists(client, machine):
        return machine
    bmdb = await open_bmdb()
    try:
        record = await resolve_machine(bmdb, machine)
    except MachineNotFound as error:
        raise RecoverError(str(error)) from None
    finally:
        await bmdb.close()
    return machine_workflow_id(record.provider, record.provider_id)


async def request_recovery(client: Client, open_bmdb: Callable[[], Awaitable[BMDB]], request: RecoverRequest) -> str:
    """Signal force_recover to the machine's workflow; returns what happened, for the operator."""
    reason = check_reason(request.reason)
    workflow_id = await find_machine_workflow(client, open_bmdb, request.machine)
    handle = client.get_workflow_handle(workflow_id)
    description = await describe_workflow(client, workflow_id)
    if description is None:
        raise RecoverError(f"{workflow_id} has never run; the next fleet pass starts it, then recover it again")
    if description.status != WorkflowExecutionStatus.RUNNING:
        state = description.status.name if description.status else "not running"
        raise RecoverError(
            f"{workflow_id} is {state}, not running; the next fleet pass starts it again, then recover it again"
        )
    before = await _stage_of(client, workflow_id)
    await handle.signal(FORCE_RECOVER_SIGNAL, {"reason": reason})
    if before == "RECOVERING":
        return f"{workflow_id} is already RECOVERING; the request is recorded with the one under way"
    if before in ("PROVISIONING", "AGENT_STARTING"):
        return f"{workflow_id}: recovery requested ({reason}); it is {before}, the reboot follows the takeover"
    return f"{workflow_id}: recovery requested ({reason}); it was {before}"


async def _stage_of(client: Client, workflow_id: str) -> str:
    # The status query needs a worker; without one the signal still waits in the history.
    try:
        status = await client.get_workflow_handle(workflow_id).query(
            STATUS_QUERY, result_type=MachineStatus, rpc_timeout=_QUERY_TIMEOUT
        )
    except Exception:
        return "in an unknown stage (no worker answered the status query)"
    return str(status.stage)


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("recover", help="reboot a machine and take it over again (force_recover)")
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help="why; shown in status and the event log")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    async def recover(url_of_bmdb: Callable[[], str]) -> str:
        client = await connect_temporal(settings)
        return await request_recovery(
            client, lambda: open_bmdb(url_of_bmdb()), RecoverRequest(args.machine, args.reason)
        )

    # BMDB (and a local PostgreSQL) only when the workflow id alone does not do.
    with ExitStack() as stack:
        try:
            print(asyncio.run(recover(lambda: stack.enter_context(database(settings)))))
        except RecoverError as error:
            raise CommandError(str(error)) from None
    return EXIT_OK
