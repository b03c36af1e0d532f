"""Provider instances: the sources of machines a deployment manages, and the [[providers]] tables that name them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundation.setting_values import SettingsError, is_finite_number

# A provider instance's name is part of workflow ids, schedule ids and task queues.
INSTANCE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_INSTANCE_KEYS = ("name", "type", "activities_per_second")


@dataclass(frozen=True)
class ProviderInstance:
    """One source of machines a deployment manages: a name, a provider type and that type's options."""

    # Part of workflow ids, BMDB keys and the Provider search attribute.
    name: str
    # An entry point of the group shepherd.providers (sim and static are Shepherd's own).
    type: str
    # The type's own options (the static provider's inventory, the simulator's api_url); checked by the type.
    options: Mapping[str, Any] = field(default_factory=dict)
    # Temporal's server-side limit on this instance's provider activities, across all workers; 0: none.
    activities_per_second: float = 0.0


def provider_instances(value: Any, path: Path) -> tuple[ProviderInstance, ...]:
    """The [[providers]] tables of a settings file, checked for shape; the types check their own options."""
    if not isinstance(value, list) or not all(isinstance(table, dict) for table in value):
        raise SettingsError("providers", f"must be [[providers]] tables in {path}")
    instances = []
    for number, table in enumerate(value, 1):
        where = f"[[providers]] table {number} in {path}"
        name, kind = table.get("name"), table.get("type")
        if not isinstance(name, str) or not INSTANCE_NAME.match(name):
            raise SettingsError("providers", f"{where}: name must match {INSTANCE_NAME.pattern}, got {name!r}")
        if not isinstance(kind, str) or not kind:
            raise SettingsError("providers", f"{where} ({name}): type must name a provider type, got {kind!r}")
        rate = table.get("activities_per_second", 0.0)
        if not is_finite_number(rate) or rate < 0:
            raise SettingsError(
                "providers", f"{where} ({name}): activities_per_second must be a finite number >= 0, got {rate!r}"
            )
        options = {key: option for key, option in table.items() if key not in _INSTANCE_KEYS}
        instances.append(ProviderInstance(name, kind, options, float(rate)))
    names = [instance.name for instance in instances]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise SettingsError("providers", f"each name once in {path}; given more than once: {', '.join(twice)}")
    return tuple(instances)
