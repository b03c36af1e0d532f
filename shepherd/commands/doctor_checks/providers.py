"""Each provider instance: opened from its settings, and answering a listing as a fleet pass asks it."""

from __future__ import annotations

from collections import Counter
from functools import partial

from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError
from providers import Availability, ProviderError
from providers.registry import open_provider
from shepherd.commands.doctor_checks.checkup import Checkup
from shepherd.commands.doctor_checks.verdicts import Verdict, fail, ok, plural


class ProviderChecks(Checkup):
    """The checks of the provider instances, one each."""

    async def providers(self) -> None:
        """Check every provider instance."""
        for instance in self.settings.provider_instances:
            await self.check(f"provider {instance.name}", partial(self.provider, instance))

    async def provider(self, instance: ProviderInstance) -> Verdict:
        """Whether the instance opens from its settings and lists its machines."""
        try:
            provider = open_provider(instance, self.settings)
        except SettingsError as error:
            fail(str(error), type=instance.type)
        try:
            # Listing is every provider's cheapest call, and the one each fleet pass makes.
            machines = await provider.list_machines()
        except ProviderError as error:
            fail(str(error).removeprefix(f"provider {instance.name}: "), type=instance.type)
        finally:
            await provider.close()
        counts = Counter(machine.availability for machine in machines)
        kinds = {"in_use": Availability.KNOWN_USED, "possibly_in_use": Availability.POSSIBLY_USED}
        kinds["free"] = Availability.KNOWN_UNUSED
        parts = [f"{counts[kind]} {name.replace('_', ' ')}" for name, kind in kinds.items() if counts[kind]]
        return ok(
            f"type {instance.type}, answered: {plural(len(machines), 'machine')} listed"
            + (f" ({', '.join(parts)})" if parts else ""),
            type=instance.type,
            listed=len(machines),
            **{name: counts[kind] for name, kind in kinds.items()},
        )
