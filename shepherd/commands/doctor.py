"""``shepherd doctor``: what an operator runs first when something is wrong, one line a check.

Temporal (the connection in effect, the namespace, the search attributes, the workers polling each task queue,
each fleet schedule, the server's clock), BMDB (reachable, schema, clock; the heartbeat server's own credential),
the heartbeat endpoint as the agents see it (TLS with their CA, the certificate's expiry), the SSH key, the agent
executable and every provider instance. Each check has a time limit, so doctor never hangs; a check that needs
another is skipped, naming it, when that one failed. Exit 1 when any check failed; warnings do not fail.

The checks of each part are in shepherd.commands.doctor_checks; this module runs them and prints the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from shepherd.commands.base import EXIT_FAILURE, EXIT_OK, Subcommands, add_common, duration_arg
from shepherd.commands.dev_stack.stack_settings import DevOptions, dev_settings, embedded_environment
from shepherd.commands.doctor_checks.database import DatabaseChecks
from shepherd.commands.doctor_checks.endpoint import EndpointChecks
from shepherd.commands.doctor_checks.host_files import HostFileChecks
from shepherd.commands.doctor_checks.providers import ProviderChecks
from shepherd.commands.doctor_checks.temporal import TemporalChecks, worker_task_queues
from shepherd.commands.doctor_checks.verdicts import Check, Status

# Each check's time limit unless --timeout says otherwise: longer than any healthy answer, short enough to wait.
DEFAULT_TIMEOUT = 10.0

# What the embedded stack keeps in its state dir, by which doctor recognizes it (shepherd dev writes both).
EMBEDDED_TEMPORAL_STATE = "temporal.db"
EMBEDDED_PROVIDERS_FILE = "dev-providers.toml"


class Doctor(TemporalChecks, DatabaseChecks, EndpointChecks, HostFileChecks, ProviderChecks):
    """Runs every check, each part's as its module says, and reports them in one order."""

    def order(self) -> list[str]:
        """Every check's name, in the order of the report: one part after the other, each as it depends."""
        instances = [instance.name for instance in self.settings.provider_instances]
        return [
            "temporal",
            "temporal namespace",
            "search attributes",
            *(name for name, _, _ in worker_task_queues(self.settings)),
            *(f"fleet {name}" for name in instances),
            "temporal clock",
            "bmdb",
            "bmdb schema",
            "bmdb clock",
            "bmdb tls",
            *(["bmdb heartbeat credential"] if self.settings.heartbeat_database_url else []),
            "heartbeat endpoint",
            "heartbeat endpoint certificate",
            "ssh key",
            "agent executable",
            *(f"provider {name}" for name in instances),
        ]

    async def run(self) -> list[Check]:
        """Every check; the parts that do not depend on each other at once."""
        async with self.stack:
            await asyncio.gather(
                self.temporal_checks(),
                self.bmdb_checks(),
                self.endpoint_checks(),
                self.local_checks(),
                self.providers(),
            )
        return [self.checks[name] for name in self.order()]


def embedded_stack(settings: Settings) -> Settings | None:
    """The settings of the embedded stack (`shepherd dev`) whose state is in the state dir, when BMDB is its
    local PostgreSQL; None otherwise. The stack's settings are its own (dev_settings), not the environment's."""
    state = settings.state_dir.resolve()
    if settings.database_url is not None or not (state / EMBEDDED_TEMPORAL_STATE).exists():
        return None
    providers: tuple[ProviderInstance, ...] = ()
    if (state / EMBEDDED_PROVIDERS_FILE).is_file():
        providers = Settings.resolve({}, config_path=state / EMBEDDED_PROVIDERS_FILE)[0].providers
    inventories = [
        Path(str(i.options["inventory"])) for i in providers if i.type == "static" and "inventory" in i.options
    ]
    # `shepherd dev --inventory` takes --agent-endpoint; doctor takes it as SHEPHERD_AGENT_ENDPOINT.
    options = DevOptions(
        inventory=inventories[0] if inventories else None,
        agent_endpoint=(settings.agent_endpoint or None) if inventories else None,
    )
    return dev_settings(settings, state, options)


def report(checks: Sequence[Check], *, as_json: bool, embedded: Path | None, out: TextIO) -> int:
    """Print the checks, a line each (or as JSON); 1 when any failed."""
    counts = Counter(check.status for check in checks)
    code = EXIT_FAILURE if counts[Status.FAIL] else EXIT_OK
    if as_json:
        document = {
            "ok": code == EXIT_OK,
            "embedded_stack": str(embedded) if embedded is not None else None,
            "summary": {status.value: counts[status] for status in Status},
            "checks": [check.document() for check in checks],
        }
        json.dump(document, out, indent=2)
        out.write("\n")
        return code
    for check in checks:
        print(check.line(), file=out)
    summary = ", ".join(f"{counts[status]} {status.value}" for status in Status if counts[status])
    print(f"{len(checks)} checks: {summary}", file=out)
    return code


def register(commands: Subcommands) -> None:
    """Add `shepherd doctor` and its options to the command line."""
    parser = commands.add_parser(
        "doctor", help="check Temporal, BMDB, the heartbeat endpoint, keys and providers: run first when in doubt"
    )
    add_common(parser)
    parser.add_argument(
        "--timeout",
        type=duration_arg,
        default=DEFAULT_TIMEOUT,
        help="time limit of each check (default %(default)gs); a check that takes longer fails",
    )
    parser.add_argument("--json", action="store_true", help="a JSON document instead of lines")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run every check, on the embedded stack when its state is here, and print the report."""
    environ: Mapping[str, str] = os.environ
    embedded = embedded_stack(settings)
    if embedded is not None:
        # The stack's processes reach its own dev server in plain text, whatever the shell sets.
        settings, environ = embedded, embedded_environment(os.environ)
    where = embedded.state_dir if embedded is not None else None
    doctor = Doctor(settings, timeout=args.timeout, environ=environ, embedded=where)
    checks = asyncio.run(doctor.run())
    return report(checks, as_json=args.json, embedded=where, out=out or sys.stdout)
