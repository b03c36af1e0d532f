"""``shepherd inventory check FILE``: is every machine of a static inventory ready to be taken over?

Every machine is probed at once: an SSH login as Shepherd (the host key's
fingerprint is shown, nothing is run) and, where the inventory names a BMC, a
login to it (Redfish: one that finds the system; IPMI) that reads the power
state. One line a machine; the exit code is 0 only when every probe passed.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import asyncssh

from foundation.settings import Settings
from foundation.ssh_identity import SSHIdentityError, load_or_create_ssh_key
from foundation.ssh_sessions import host_key_fingerprint
from lifecycle.takeover import probe_ssh
from lifecycle.takeover_failures import TakeoverError, TakeoverTarget
from providers import ProviderError
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import InventoryMachine, load_inventory
from providers.power import PowerTimeouts
from providers.static import power_control
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common, show


@dataclass(frozen=True)
class MachineCheck:
    """What the probes of one inventory machine found: each part's finding, and whether it failed."""

    machine: str
    ssh: str
    ssh_ok: bool
    bmc: str
    bmc_ok: bool

    @property
    def ok(self) -> bool:
        """Whether both the SSH and the BMC probe passed."""
        return self.ssh_ok and self.bmc_ok


async def check_machine(
    machine: InventoryMachine, key: asyncssh.SSHKey, settings: Settings, provider: str
) -> MachineCheck:
    """Probe one machine's SSH and BMC at once."""
    ssh, bmc = await asyncio.gather(_check_ssh(machine, key, settings), _check_bmc(machine, settings, provider))
    return MachineCheck(machine.id, ssh[0], ssh[1], bmc[0], bmc[1])


async def _check_ssh(machine: InventoryMachine, key: asyncssh.SSHKey, settings: Settings) -> tuple[str, bool]:
    user = machine.ssh_user or settings.ssh_user
    target = TakeoverTarget(machine_id="", address=machine.host, port=machine.port, username=user)
    try:
        host_key = await probe_ssh(target, key, settings.ssh_connect_timeout)
    except TakeoverError as error:
        return f"ssh {error.problem}", False
    return f"ssh as {user} ok, host key {host_key_fingerprint(host_key)}", True


async def _check_bmc(machine: InventoryMachine, settings: Settings, provider: str) -> tuple[str, bool]:
    if machine.bmc is None:
        return "no BMC: Shepherd cannot reboot it", True
    try:
        endpoint = machine.bmc.endpoint(machine.id, provider)
        timeouts = PowerTimeouts(connect=settings.provider_timeout, read=settings.provider_timeout)
        report = await power_control(provider, endpoint, timeouts).probe()
    except ProviderError as error:
        return f"bmc {error}", False
    return f"bmc ok, {report.system} {report.power_state}", True


def format_checks(checks: list[MachineCheck]) -> list[str]:
    """One line a machine: its id, ok or FAIL, what SSH and the BMC said."""
    return [f"{check.machine}  {'ok' if check.ok else 'FAIL'}  {check.ssh}; {check.bmc}" for check in checks]


async def check_inventory(path: Path, settings: Settings, *, as_json: bool = False, out: TextIO | None = None) -> int:
    """Probe every machine of the inventory; 0 when all passed, 1 naming the ones that did not. The inventory is
    held to the worker's rules for BMC passwords and URLs first: no secret goes to a BMC a worker would refuse."""
    provider = "static"
    try:
        machines = load_inventory(path, provider, secrets=BmcSecretRules.from_settings(settings))
        key = load_or_create_ssh_key(settings.effective_ssh_key_path)
    except (ProviderError, SSHIdentityError) as error:
        raise CommandError(str(error)) from None
    if not machines:
        raise CommandError(f"inventory {path} lists no machines")
    checks = await asyncio.gather(*(check_machine(machine, key, settings, provider) for machine in machines))
    show(out, as_json, lambda: [vars(check) | {"ok": check.ok} for check in checks], lambda: format_checks(checks))
    failed = [check.machine for check in checks if not check.ok]
    if failed:
        raise CommandError(f"{len(failed)} of {len(checks)} machines failed: {', '.join(failed)}")
    return EXIT_OK


def register(commands: Subcommands) -> None:
    """Add ``shepherd inventory check`` to the commands."""
    parser = commands.add_parser("inventory", help="check a static inventory: SSH and BMC of every machine")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser("check", help="probe every machine's SSH login and BMC; exit 0 only if all pass")
    add_common(check)
    check.add_argument("file", metavar="FILE", type=Path, help="the inventory (TOML, [[machines]] tables)")
    check.add_argument("--json", action="store_true", help="a JSON list instead of the lines")
    check.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Probe every machine of the inventory FILE; 0 only when all passed."""
    return asyncio.run(check_inventory(args.file, settings, as_json=args.json))
