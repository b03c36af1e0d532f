"""The static provider: machines listed in an inventory file the operator owns.

Nothing is created or destroyed here: the operator racks the machines, installs
Shepherd's key in authorized_keys and lists them in a TOML inventory. Shepherd
reads the file on every call, so edits take effect on the next pass, and reboots
a machine through its BMC (Redfish or IPMI) when the inventory names one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from providers import MachineNotFound, ProviderError, ProviderMachine, Rebooted, RetireAction, Retired
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import INVENTORY_ID, InventoryMachine, load_inventory, password_file_refusal
from providers.inventory_bmc import BmcEndpoint
from providers.ipmi import IpmiEndpoint, IpmiPowerControl
from providers.power import PowerReport, PowerTimeouts
from providers.redfish import RedfishPowerControl
from providers.registry import duration_option, unknown_options

log = logging.getLogger(__name__)


class NoBMC(ProviderError):
    """The machine has no BMC in the inventory, so only a person can reboot it; retrying cannot help."""

    retryable = False


class PowerControl(Protocol):
    """Power control of one machine's BMC."""

    async def reboot(self) -> PowerReport:
        """Reboot the machine and confirm it went down and came back on."""
        ...

    async def probe(self) -> PowerReport:
        """Read the machine's power state, changing nothing."""
        ...

    async def power_off(self) -> PowerReport:
        """Turn the machine off for good."""
        ...


def power_control(provider: str, endpoint: BmcEndpoint, timeouts: PowerTimeouts = PowerTimeouts()) -> PowerControl:
    """The power control of the BMC's type: IPMI for an IPMI endpoint, Redfish for a Redfish one."""
    if isinstance(endpoint, IpmiEndpoint):
        return IpmiPowerControl(provider, endpoint, timeouts)
    return RedfishPowerControl(provider, endpoint, timeouts)


class StaticProvider:
    """The Provider of machines listed in an inventory file, rebooted through their BMCs."""

    def __init__(
        self,
        name: str,
        inventory: Path,
        *,
        secrets: BmcSecretRules,
        timeouts: PowerTimeouts = PowerTimeouts(),
        power: Callable[[str, BmcEndpoint], PowerControl] | None = None,
    ) -> None:
        self._name = name
        self.inventory = inventory
        self._secrets = secrets
        # power stands in for the BMC's own power control, chosen by its type, in the tests.
        self._power: Callable[[str, BmcEndpoint], PowerControl] = power or (
            lambda provider, endpoint: power_control(provider, endpoint, timeouts)
        )
        self._parsed: tuple[tuple[int, int, int, int], dict[str, InventoryMachine]] | None = None

    @property
    def name(self) -> str:
        """The provider instance's name."""
        return self._name

    def is_valid_id(self, provider_id: str) -> bool:
        """Whether provider_id could be an inventory id at all."""
        return INVENTORY_ID.fullmatch(provider_id) is not None

    def _current(self) -> dict[str, InventoryMachine]:
        """The inventory's machines by id, parsed again only when the file changed: the operator edits it between
        passes, and at 100,000 machines a parse takes over a second."""
        try:
            status = self.inventory.stat()
        except OSError:
            # A file that cannot be read: load_inventory says what is wrong with it, as the operator's problem.
            return self._load()
        version = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
        cached = self._parsed
        if cached is not None and cached[0] == version:
            return cached[1]
        machines = self._load()
        self._parsed = (version, machines)
        return machines

    def _load(self) -> dict[str, InventoryMachine]:
        """The inventory's machines by id, parsed now."""
        return {machine.id: machine for machine in load_inventory(self.inventory, self._name, secrets=self._secrets)}

    async def _machines(self) -> dict[str, InventoryMachine]:
        """The inventory's machines by id, read in a thread."""
        # Off the event loop: a parse of a large inventory would stall every activity of the worker meanwhile.
        return await asyncio.to_thread(self._current)

    async def _listed(self, provider_id: str) -> InventoryMachine:
        """The inventory's machine of that id; MachineNotFound when it is not listed."""
        machine = (await self._machines()).get(provider_id)
        if machine is None:
            raise MachineNotFound(self._name, provider_id)
        return machine

    async def list_machines(self) -> list[ProviderMachine]:
        """Every machine of the inventory, its BMC password files checked."""
        machines = await self._machines()
        # Every pass checks the password files, whether the inventory changed or not: a file made readable by
        # others stops the pass at once, not only the next reboot.
        await asyncio.to_thread(self._check_password_files, machines.values())
        return [machine.provider_machine() for machine in machines.values()]

    def _check_password_files(self, machines: Iterable[InventoryMachine]) -> None:
        """InventoryError for the first machine whose BMC password file cannot serve."""
        check = self._secrets.file_check()
        for machine in machines:
            refusal = password_file_refusal(self.inventory, self._name, machine, check)
            if refusal is not None:
                raise refusal

    async def get_machine(self, provider_id: str) -> ProviderMachine:
        """The inventory's machine of that id."""
        return (await self._listed(provider_id)).provider_machine()

    async def create_machine(self, provider_id: str, idempotency_key: str, ssh_public_key: str) -> ProviderMachine:
        """The listed machine as it is: an inventory machine exists before Shepherd manages it."""
        # Nothing to create: the operator owns the machine and has put Shepherd's key in authorized_keys.
        return (await self._listed(provider_id)).provider_machine()

    async def reboot_machine(self, provider_id: str) -> Rebooted:
        """Reboot the machine through its BMC; NoBMC when the inventory names none."""
        machine = await self._listed(provider_id)
        if machine.bmc is None:
            raise NoBMC(
                self._name, f"machine {provider_id!r} has no BMC in the inventory {self.inventory}; reboot it by hand"
            )
        report = await self._power(self._name, machine.bmc.endpoint(provider_id, self._name)).reboot()
        log.info(
            "rebooted %s machine %s through its BMC (%s, now %s): %s",
            self._name,
            provider_id,
            report.system,
            report.power_state,
            report.detail,
        )
        # Every way the BMC client reboots is confirmed by reading the power state back off, then on.
        return Rebooted(went_down=True, detail=f"{report.detail}; power {report.power_state}")

    async def retire_machine(self, provider_id: str) -> Retired:
        """Power a decommissioned machine off through its BMC, or say what the operator must do by hand."""
        try:
            machine = await self._listed(provider_id)
        except MachineNotFound:
            return Retired(RetireAction.UNTOUCHED, f"{provider_id} is not in the inventory {self.inventory} any more")
        keep_out = f"take {provider_id} out of the inventory {self.inventory}"
        if machine.bmc is None:
            return Retired(RetireAction.UNTOUCHED, f"no BMC in the inventory: power it off by hand, and {keep_out}")
        report = await self._power(self._name, machine.bmc.endpoint(provider_id, self._name)).power_off()
        return Retired(RetireAction.POWERED_OFF, f"through its BMC ({report.system}): {report.detail}; {keep_out}")

    async def close(self) -> None:
        """Nothing to release: the provider holds no connection between calls."""


def from_settings(instance: ProviderInstance, settings: Settings) -> StaticProvider:
    """The shepherd.providers entry point. Options: inventory (the file; required), graceful_timeout (how long the
    OS may take to shut down before the power is forced off) and power_back_timeout (how long a forced off or an on
    may take to show), as seconds or durations."""
    unknown_options(instance, ("inventory", "graceful_timeout", "power_back_timeout"))
    inventory = instance.options.get("inventory")
    if not isinstance(inventory, str) or not inventory:
        raise SettingsError("providers", f"instance {instance.name!r}: inventory must name the inventory file")
    defaults = PowerTimeouts()
    timeouts = PowerTimeouts(
        connect=settings.provider_timeout,
        read=max(settings.provider_timeout, defaults.read),
        graceful=duration_option(instance, "graceful_timeout", defaults.graceful),
        power_back=duration_option(instance, "power_back_timeout", defaults.power_back),
    )
    # The longest reboot: the graceful shutdown ignored, then the forced off and the on each taking their longest.
    longest = timeouts.graceful + 2 * timeouts.power_back
    if longest >= settings.reboot_timeout:
        raise SettingsError(
            "reboot_timeout",
            f"must exceed instance {instance.name!r}'s graceful_timeout + 2 x power_back_timeout "
            f"({longest:g}s), got {settings.reboot_timeout:g}s",
        )
    return StaticProvider(
        instance.name, Path(inventory), secrets=BmcSecretRules.from_settings(settings), timeouts=timeouts
    )
