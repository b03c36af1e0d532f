"""``shepherd restart-agent``: take a machine over again without a reboot (the ``restart_agent`` update).

A new agent, from the executable and CA bundle the workers have now, replaces the running one, which stops once
it sees the new one's key: an agent upgrade or a CA rotation without rebooting anything. The machine's workflow
answers what happens, or refuses and says why (quarantined, in maintenance, being decommissioned). The same
update the Temporal CLI sends with ``temporal workflow update execute --name restart_agent``.
"""

from __future__ import annotations

import argparse

from foundation.settings import Settings
from lifecycle.contracts import RESTART_AGENT_UPDATE
from operations.policy_file import RESTART_AGENT
from shepherd.commands.base import Subcommands, add_common
from shepherd.commands.bulk import add_machines, run_update


def register(commands: Subcommands) -> None:
    """Add ``shepherd restart-agent`` to the commands."""
    parser = commands.add_parser(
        "restart-agent", help="take a machine over again with a new agent, without a reboot (restart_agent)"
    )
    add_common(parser)
    add_machines(parser, "why; shown in status and the event log")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Ask MACHINE, or each machine --where selects, for a new takeover without a reboot."""
    return run_update(
        settings,
        args,
        RESTART_AGENT_UPDATE,
        RESTART_AGENT,
        doing="a new takeover without a reboot",
        then="restart its agent",
    )
