"""``shepherd release``: let a quarantined machine be recovered again (the ``release`` update).

The machine's workflow answers: released, or refused and why (it is not quarantined). The same update the
Temporal CLI sends with ``temporal workflow update execute --name release``.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

from temporalio.client import WorkflowUpdateFailedError

from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import RELEASE_UPDATE
from shepherd.commands.base import (
    MACHINE_HELP,
    CommandError,
    Subcommands,
    add_by,
    add_common,
    answer_with_lazy_bmdb,
    operator,
    reason_arg,
)
from shepherd.commands.machine_ref import running_machine_workflow


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("release", help="let a QUARANTINED machine be recovered again (the release update)")
    add_common(parser)
    parser.add_argument("machine", metavar="MACHINE", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help="why; kept in the event log and the history")
    add_by(parser)
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    async def release(open_bmdb: Callable[[], Awaitable[BMDB]]) -> str:
        client = await connect_temporal(settings)
        workflow_id = await running_machine_workflow(
            client, open_bmdb, args.machine, then="release it if it is quarantined again"
        )
        try:
            answer = await client.get_workflow_handle(workflow_id).execute_update(
                RELEASE_UPDATE, {"reason": args.reason, "by": args.by or operator()}, result_type=str
            )
        except WorkflowUpdateFailedError as error:
            raise CommandError(f"{workflow_id}: {getattr(error.cause, 'message', None) or error}") from None
        return f"{workflow_id}: {answer}"

    return answer_with_lazy_bmdb(settings, release)
