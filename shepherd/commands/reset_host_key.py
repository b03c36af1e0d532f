"""``shepherd reset-host-key``: forget a machine's pinned SSH host key after a reinstall.

Shepherd pins the host key it sees at first contact and refuses a different
one, because a changed key may be an impostor. When the operator knows the
machine was reinstalled, this command forgets the pin (logging who said why)
and asks the machine's workflow to retry its takeover now; that takeover pins
the key it sees.
"""

from __future__ import annotations

import argparse

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import RETRY_NOW_SIGNAL, OperatorRequest, machine_workflow_id
from lifecycle.takeover import host_key_fingerprint
from shepherd.commands.base import (
    EXIT_OK,
    MACHINE_HELP,
    Subcommands,
    add_by,
    add_common,
    operator,
    reason_arg,
    with_bmdb,
)
from shepherd.commands.machine_ref import describe_workflow, resolve_machine


class HostKeyError(Exception):
    """The pin could not be reset, or the workflow not told; the message says what happened and what to do."""


async def reset_host_key(client: Client, bmdb: BMDB, machine: str, reason: str, by: str = "unknown") -> str:
    """Forget the machine's pin and ask its workflow to retry; returns what happened, for the operator."""
    record = await resolve_machine(bmdb, machine)
    name = record.provider_id
    if record.ssh_host_key is None:
        return f"{name} has no pinned host key; its next takeover pins the key it sees"
    fingerprint = host_key_fingerprint(record.ssh_host_key)
    if not await bmdb.reset_host_key(record.machine_id, record.ssh_host_key, f"by {by}: {reason}; was {fingerprint}"):
        raise HostKeyError(
            f"the host key pin of {name} changed while it was being reset; nothing was reset, "
            f"see `shepherd events {name}` and try again"
        )
    done = f"{name}: host key pin {fingerprint} reset ({reason})"
    workflow_id = machine_workflow_id(record.provider, record.provider_id)
    try:
        description = await describe_workflow(client, workflow_id)
        if description is None:
            return f"{done}; {workflow_id} has not started yet, its takeover pins the key it sees"
        if description.status != WorkflowExecutionStatus.RUNNING:
            return f"{done}; {workflow_id} is not running, its next run pins the key it sees"
        retry = OperatorRequest(f"host key pin reset: {reason}", by)
        await client.get_workflow_handle(workflow_id).signal(RETRY_NOW_SIGNAL, retry)
    except RPCError as error:
        raise HostKeyError(
            f"{done}, but {workflow_id} could not be asked to retry now ({error.message}); "
            "it retries at the end of its back-off, or send it the retry_now signal"
        ) from None
    return f"{done}; {workflow_id} was asked to retry now, and its takeover pins the key it sees"


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "reset-host-key", help="forget a reinstalled machine's pinned SSH host key and retry its takeover now"
    )
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help="why; kept in the event log")
    add_by(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    # Temporal first: a pin is not reset when the workflow cannot be told.
    message = with_bmdb(
        settings,
        lambda: connect_temporal(settings),
        lambda client, bmdb: reset_host_key(client, bmdb, args.machine, args.reason, args.by or operator()),
        HostKeyError,
    )
    print(message)
    return EXIT_OK
