"""``shepherd provider check NAME``: what Shepherd sees of a provider instance, changing nothing.

One listing, as a fleet pass makes it: the machines the provider says are Shepherd's (with the address SSH
reaches them at, or why there is none yet), the free capacity a pass would create machines from, and what the
provider leaves alone and why, where it can tell (Ironic: nodes of others, in maintenance, outside the filter).
For every provider type; `shepherd inventory check` goes further for a static inventory (SSH and BMC logins).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

from foundation.setting_values import SettingsError
from foundation.settings import Settings
from providers import Availability, CountsLeftAlone, ProviderError, ProviderMachine
from providers.registry import open_provider
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common, show

# Free capacity is named up to this many machines; past it, counted.
CAPACITY_SHOWN = 20


@dataclass(frozen=True)
class ProviderView:
    """One listing of a provider instance, sorted by what it means to Shepherd."""

    name: str
    type: str
    ours: list[ProviderMachine]
    capacity: list[ProviderMachine]
    left_alone: Mapping[str, int] = field(default_factory=dict)


async def look_at(settings: Settings, name: str) -> ProviderView:
    """List the instance NAME once; CommandError naming what went wrong (no such instance, a bad option, an error)."""
    instances = {instance.name: instance for instance in settings.provider_instances}
    instance = instances.get(name)
    if instance is None:
        raise CommandError(f"no provider instance {name!r}; configured: {', '.join(sorted(instances)) or 'none'}")
    try:
        provider = open_provider(instance, settings)
    except SettingsError as error:
        raise CommandError(str(error)) from None
    try:
        listed = await provider.list_machines()
    except ProviderError as error:
        raise CommandError(str(error)) from None
    finally:
        await provider.close()
    ours = sorted((m for m in listed if m.availability is Availability.KNOWN_USED), key=lambda m: m.provider_id)
    free = sorted((m for m in listed if m.availability is not Availability.KNOWN_USED), key=lambda m: m.provider_id)
    left_alone = dict(provider.left_alone) if isinstance(provider, CountsLeftAlone) else {}
    return ProviderView(name, instance.type, ours, free, left_alone)


def format_view(view: ProviderView) -> list[str]:
    """The listing in lines: the machines that are Shepherd's, the capacity, what is left alone."""
    lines = [f"provider {view.name} (type {view.type}): nothing was changed"]
    lines.append(f"Shepherd's machines: {len(view.ours)}")
    for machine in view.ours:
        where = f"{machine.address}:{machine.ssh_port}" if machine.address else "no address yet"
        lines.append(f"  {machine.provider_id}  {machine.status or '-'}  {where}")
    shown = ", ".join(m.provider_id for m in view.capacity[:CAPACITY_SHOWN])
    more = f" and {len(view.capacity) - CAPACITY_SHOWN} more" if len(view.capacity) > CAPACITY_SHOWN else ""
    lines.append(f"free capacity: {len(view.capacity)}" + (f": {shown}{more}" if view.capacity else ""))
    if view.left_alone:
        reasons = sorted(view.left_alone.items(), key=lambda item: (-item[1], item[0]))
        lines.append(f"left alone: {sum(view.left_alone.values())}")
        lines += [f"  {count}  {why}" for why, count in reasons]
    return lines


def document(view: ProviderView) -> dict[str, object]:
    """The listing as JSON."""

    def machine(m: ProviderMachine) -> dict[str, object]:
        return {"provider_id": m.provider_id, "status": m.status, "address": m.address, "ssh_port": m.ssh_port}

    return {
        "provider": view.name,
        "type": view.type,
        "ours": [machine(m) for m in view.ours],
        "capacity": [m.provider_id for m in view.capacity],
        "left_alone": dict(view.left_alone),
    }


async def check_provider(settings: Settings, name: str, *, as_json: bool = False, out: TextIO | None = None) -> int:
    """Show what the instance NAME lists; 0 when it answered."""
    view = await look_at(settings, name)
    show(out, as_json, lambda: document(view), lambda: format_view(view))
    return EXIT_OK


def register(commands: Subcommands) -> None:
    """Add ``shepherd provider check`` to the commands."""
    parser = commands.add_parser("provider", help="look at a provider instance as a fleet pass does")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check", help="list its machines, free capacity and what it leaves alone and why; change nothing"
    )
    add_common(check)
    check.add_argument("name", metavar="NAME", help="the provider instance's name ([[providers]] name)")
    check.add_argument("--json", action="store_true", help="a JSON document instead of the lines")
    check.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Show what the provider instance NAME lists."""
    return asyncio.run(check_provider(settings, args.name, as_json=args.json))
