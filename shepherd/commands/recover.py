"""``shepherd recover``: ask one machine's workflow for a recovery reboot.

The same ``force_recover`` signal the Temporal CLI and UI send; this command
only finds the workflow from whatever name the operator has at hand.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

from temporalio.client import Client

from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import (
    FORCE_RECOVER_SIGNAL,
    STATUS_QUERY,
    MachineStatus,
    RecoveryRequest,
)
from shepherd.commands.base import (
    Subcommands,
    add_common,
    answer_with_lazy_bmdb,
    check_reason,
    operator,
)
from shepherd.commands.bulk import Target, add_machines, check_target, run_bulk
from shepherd.commands.machine_ref import running_machine_workflow

_QUERY_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class RecoverRequest:
    """What ``shepherd recover`` was asked: the machine, by any of its names, and the operator's reason."""

    machine: str  # a BMDB machine id, a provider id or a workflow id
    reason: str
    by: str = "unknown"


async def request_recovery(client: Client, open_bmdb: Callable[[], Awaitable[BMDB]], request: RecoverRequest) -> str:
    """Signal force_recover to the machine's workflow; returns what happened, for the operator."""
    reason = check_reason(request.reason)
    workflow_id = await running_machine_workflow(client, open_bmdb, request.machine, then="recover it again")
    handle = client.get_workflow_handle(workflow_id)
    before = await _stage_of(client, workflow_id)
    await handle.signal(FORCE_RECOVER_SIGNAL, RecoveryRequest(reason, request.by))
    if before == "QUARANTINED":
        return f"{workflow_id}: was QUARANTINED; the forced recovery releases it ({reason}) and reboots it"
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
    add_machines(parser, "why; shown in status and the event log")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    check_target(args)
    if args.where is not None:
        signal = RecoveryRequest(args.reason, args.by or operator())

        async def force(client: Client, target: Target) -> str:
            await client.get_workflow_handle(target.workflow_id).signal(FORCE_RECOVER_SIGNAL, signal)
            return f"{target.workflow_id}: recovery requested ({args.reason}); it was {target.stage}"

        return run_bulk(settings, args, "a reboot and a new takeover", force)

    async def recover(open_bmdb: Callable[[], Awaitable[BMDB]]) -> str:
        client = await connect_temporal(settings)
        request = RecoverRequest(args.machine, args.reason, args.by or operator())
        return await request_recovery(client, open_bmdb, request)

    return answer_with_lazy_bmdb(settings, recover)
