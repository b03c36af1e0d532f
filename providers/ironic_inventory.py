"""Where SSH reaches a deployed Ironic node, as Ironic's inspection recorded it.

Ironic's in-band inspection (the `agent` inspect interface: a ramdisk's agent posts what it found to
/v1/continue_inspection) keeps each node's inventory: its network interfaces, each with a name, a MAC and the IPv4 and
IPv6 address the ramdisk got, and the MAC of the interface the ramdisk booted from (boot.pxe_interface). The address
Shepherd takes is the one of the interface the operator names, or by default of the one the node booted from.

An inventory changes only when the node is inspected again, and that moves the node's inspection_finished_at, which
the node listing carries. So each node's inventory is read once and what it says kept under that time: a fleet pass
lists every node but reads only the inventories of the nodes deployed or inspected again since, and at most
READS_PER_LISTING of those, so that a worker's first pass over a large fleet stays short.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from providers.ironic_api import IronicAPI, Node
from providers.ironic_options import INSPECTION, IronicOptions

# New inventories one listing reads at most; the others are read by the passes after it.
READS_PER_LISTING = 200
# Inventory reads in flight at once.
READS_IN_FLIGHT = 8
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


def inventory_address(inventory: Mapping[str, Any], interface: str | None, ip_version: int | None) -> str:
    """The IP address of the named interface, or of the one the node booted from, in its inspection inventory: the
    IPv4 one, else the IPv6 one, unless ip_version says which; ValueError saying what the inventory lacks."""
    interfaces = inventory.get("interfaces")
    if not isinstance(interfaces, list) or not all(isinstance(entry, dict) for entry in interfaces):
        raise ValueError(f"its inspection inventory has no list of interfaces: {_shown(interfaces)}")
    if interface is not None:
        found = [entry for entry in interfaces if entry.get("name") == interface]
        if not found:
            names = ", ".join(_shown(entry.get("name")) for entry in interfaces)
            raise ValueError(
                f"its inspection inventory has no interface {interface} (address_interface); it has {names}"
            )
        where = f"interface {interface}"
    else:
        mac = _boot_mac(inventory)
        found = [entry for entry in interfaces if str(entry.get("mac_address")).lower() == mac]
        if not found:
            raise ValueError(f"its inspection inventory has no interface of the boot interface's MAC {mac}")
        where = f"boot interface {_shown(found[0].get('name'))}"
    return _ip_address(found[0], where, ip_version)


def _boot_mac(inventory: Mapping[str, Any]) -> str:
    """The MAC of the interface the ramdisk booted from, lower case; ValueError when the inventory names none."""
    boot = inventory.get("boot")
    value = boot.get("pxe_interface") if isinstance(boot, dict) else None
    if not value:
        raise ValueError(
            "its inspection inventory names no boot interface (boot.pxe_interface), as after a boot from virtual "
            "media: name the interface with address_interface"
        )
    parts = str(value).lower().replace("-", ":").split(":")
    # pxelinux's form, 01-aa-bb-cc-dd-ee-ff, as the agent may pass on its BOOTIF: the hardware type, then the MAC.
    mac = ":".join(parts[1:] if len(parts) == 7 else parts)
    if not _MAC.fullmatch(mac):
        raise ValueError(f"its inspection inventory's boot.pxe_interface is no MAC address: {_shown(value)}")
    return mac


def _ip_address(entry: Mapping[str, Any], where: str, ip_version: int | None) -> str:
    """The interface's address of ip_version, or its IPv4 one else its IPv6 one; ValueError when it has none that
    SSH can reach."""
    versions = (ip_version,) if ip_version is not None else (4, 6)
    for version in versions:
        field = f"ipv{version}_address"
        value = entry.get(field)
        if value is None or value == "":
            continue
        try:
            # The agent may give an IPv6 address its scope, fe80::1%eno1; Ironic's own reading drops it too.
            address = ipaddress.ip_address(value.partition("%")[0] if isinstance(value, str) else "")
        except ValueError:
            address = None
        if address is None or address.version != version:
            raise ValueError(
                f"{where}'s {field} in its inspection inventory is not an IPv{version} address: {_shown(value)}"
            )
        if address.is_unspecified or address.is_multicast or (version == 6 and address.is_link_local):
            raise ValueError(f"{where}'s {field} in its inspection inventory, {address}, is not one SSH can reach")
        return str(address)
    wanted = " or ".join(f"IPv{version}" for version in versions)
    raise ValueError(f"{where} has no {wanted} address in its inspection inventory")


def _shown(value: Any) -> str:
    """A value of the inventory as a message shows it: short, on one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class _Reading:
    """What one reading of a node's inventory found, as of the inspection that recorded it: the address, or why
    there is none."""

    inspection_finished_at: str | None
    address: str | None
    problem: str | None


class InventoryAddresses:
    """The SSH addresses of deployed nodes, read from their inspection inventories, each once per inspection."""

    def __init__(
        self, api: IronicAPI, interface: str | None, ip_version: int | None, *, per_listing: int = READS_PER_LISTING
    ) -> None:
        self.api = api
        self.interface = interface
        self.ip_version = ip_version
        self.per_listing = per_listing
        self._readings: dict[str, _Reading] = {}

    @classmethod
    def of(cls, options: IronicOptions, api: IronicAPI) -> InventoryAddresses | None:
        """The addresses of an instance whose options take them from inspection; None for one that does not."""
        if options.address_source != INSPECTION:
            return None
        return cls(api, options.address_interface, options.address_ip_version)

    def address(self, node: Node) -> str:
        """The node's address as its inventory gives it; ValueError saying why there is none (or none read yet)."""
        if not self._read_already(node):
            raise ValueError("its inspection inventory is not read yet: a later pass reads it")
        reading = self._readings[node.uuid]
        if reading.address is None:
            raise ValueError(reading.problem)
        return reading.address

    async def read(self, nodes: Sequence[Node], *, listing: bool = False) -> None:
        """Read the inventories of these deployed nodes that were not read since their last inspection. A listing
        reads at most per_listing of them, and forgets the readings of every node it does not name."""
        unread = [node for node in nodes if not self._read_already(node)]
        if listing:
            named = {node.uuid for node in nodes}
            self._readings = {uuid: reading for uuid, reading in self._readings.items() if uuid in named}
            unread = unread[: self.per_listing]
        in_flight = asyncio.Semaphore(READS_IN_FLIGHT)

        async def read_one(node: Node) -> None:
            async with in_flight:
                self._readings[node.uuid] = await self._reading(node)

        outcomes = await asyncio.gather(*(read_one(node) for node in unread), return_exceptions=True)
        # An error of Ironic's (unavailable, credentials refused, an answer not its API's) is the caller's, as it is
        # for any other call; the readings done meanwhile are kept.
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _read_already(self, node: Node) -> bool:
        """Whether the node's inventory was read since its last inspection."""
        reading = self._readings.get(node.uuid)
        return reading is not None and reading.inspection_finished_at == node.inspection_finished_at

    async def _reading(self, node: Node) -> _Reading:
        """What the node's inventory says now: its address, or why it gives none."""
        inventory = await self.api.inventory(node.uuid)
        if inventory is None:
            problem = "Ironic keeps no inspection inventory of it: inspect it before it is deployed"
            return _Reading(node.inspection_finished_at, None, problem)
        try:
            address = inventory_address(inventory, self.interface, self.ip_version)
        except ValueError as problem:
            return _Reading(node.inspection_finished_at, None, str(problem))
        return _Reading(node.inspection_finished_at, address, None)
