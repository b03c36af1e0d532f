"""A deployed Ironic node's SSH address as Ironic's inspection recorded it, against a real Ironic, standalone.

Nodes are fake-hardware nodes with the agent inspect interface: Ironic's own inspection starts, waits for the
ramdisk's agent, and runs its hooks on what the agent posts to /v1/continue_inspection; the test posts that inventory,
standing in for the machine. Shepherd then deploys the node and reads the inventory back through Ironic's API. What
Shepherd asked of Ironic is counted in Ironic's log.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from providers import ProviderMachine
from providers.ironic import IronicProvider, from_settings
from tests.ironic_fixtures import Ironic, ironic_fixture  # noqa: F401 (ironic_fixture)
from tests.test_ironic_provider import IMAGE, PUBLIC_KEY, deployed, resource_class, until

pytestmark = pytest.mark.timeout(120)


def provider(ironic: Ironic, kind: str, **options: Any) -> IronicProvider:
    """An instance that takes a deployed node's address from its inspection, through the entry point's factory; named
    after its resource class, since an instance's nodes are its own whatever their class."""
    given = {"endpoint": ironic.url, "address_source": "inspection", "resource_class": kind, **IMAGE, **options}
    return from_settings(ProviderInstance(kind, "ironic", given), Settings())


def mac() -> str:
    """A MAC address of its own (locally administered): Ironic's inspection makes a port of the boot interface's, and
    refuses one MAC on two nodes."""
    return "02:" + ":".join(f"{byte:02x}" for byte in uuid.uuid4().bytes[:5])


def inventory(*interfaces: dict[str, Any], boot: str | None = None) -> dict[str, Any]:
    """An inventory as the ramdisk's agent reports it, with these interfaces and the MAC it booted from."""
    found: dict[str, Any] = {"interfaces": list(interfaces), "cpu": {"architecture": "x86_64", "count": 4}}
    if boot is not None:
        found["boot"] = {"pxe_interface": boot, "current_boot_mode": "uefi"}
    return found


def inspected(ironic: Ironic, kind: str, found: dict[str, Any] | None) -> str:
    """A node of that resource class, inspected through Ironic's inspection with that inventory (None: never
    inspected), and made available; its UUID."""
    if found is None:
        return ironic.enroll(resource_class=kind)
    node_id = ironic.enroll(resource_class=kind, inspect_interface="agent", state="manageable")
    ironic.inspect(node_id, found)
    ironic.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "provide"})
    ironic.wait_for(node_id, "available")
    return node_id


def inventory_reads(ironic: Ironic, node_id: str) -> int:
    return ironic.requests_logged(f"GET /v1/nodes/{node_id}/inventory")


async def test_the_address_is_the_boot_interfaces_or_the_named_ones_read_once_per_inspection(ironic):
    kind = resource_class()
    boot = mac()
    # As the agent reports it: the boot interface in pxelinux's form, an IPv6 address with its scope.
    found = inventory(
        {"name": "eno1", "mac_address": mac(), "ipv4_address": "192.0.2.11", "ipv6_address": None},
        {"name": "eno2", "mac_address": boot, "ipv4_address": "192.0.2.12", "ipv6_address": "fd00::7%eno2"},
        boot="01-" + boot.replace(":", "-"),
    )
    node_id = await asyncio.to_thread(inspected, ironic, kind, found)
    rack = provider(ironic, kind, ssh_port=2222)
    machine = await deployed(rack, node_id, f"machine-{kind}")
    assert (machine.address, machine.ssh_port, machine.status) == ("192.0.2.12", 2222, "active")
    named = provider(ironic, kind, address_interface="eno1")
    assert (await named.get_machine(node_id)).address == "192.0.2.11"
    over_ipv6 = provider(ironic, kind, address_ip_version=6)
    assert (await over_ipv6.get_machine(node_id)).address == "fd00::7"
    assert inventory_reads(ironic, node_id) == 3, "once by each instance"

    for _ in range(2):
        [listed] = await rack.list_machines()
        assert (listed.provider_id, listed.address) == (node_id, "192.0.2.12")
    assert (await rack.get_machine(node_id)).address == "192.0.2.12"
    assert inventory_reads(ironic, node_id) == 3, "a listing and a read of the node read no inventory again"

    # Undeployed, inspected again with a new address and deployed again, with no listing in between to forget it:
    # the inspection's time tells the inventory is new.
    ironic.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "deleted"})
    await asyncio.to_thread(ironic.wait_for, node_id, "available")
    ironic.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "manage"})
    await asyncio.to_thread(ironic.wait_for, node_id, "manageable")
    found["interfaces"][1]["ipv4_address"] = "192.0.2.13"
    await asyncio.to_thread(ironic.inspect, node_id, found)
    ironic.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "provide"})
    await asyncio.to_thread(ironic.wait_for, node_id, "available")
    again = await deployed(rack, node_id, f"machine-{kind}")
    assert again.address == "192.0.2.13" and inventory_reads(ironic, node_id) == 4
    for instance in (rack, named, over_ipv6):
        await instance.close()


async def test_a_deployed_node_whose_inventory_gives_no_address_says_why(ironic):
    kind = resource_class()
    boot = mac()
    inventories: dict[str, dict[str, Any] | None] = {
        "never inspected": None,
        "no eno1": inventory({"name": "enp1s0", "mac_address": boot, "ipv4_address": "192.0.2.1"}, boot=boot),
        "not an IP": inventory({"name": "eno1", "mac_address": mac(), "ipv4_address": "not-an-ip"}),
        "a list": inventory({"name": "eno1", "mac_address": mac(), "ipv4_address": ["192.0.2.3"]}),
        "no boot": inventory({"name": "eno1", "mac_address": mac(), "ipv4_address": "192.0.2.5"}),
    }
    names = list(inventories)
    made = await asyncio.gather(*(asyncio.to_thread(inspected, ironic, kind, inventories[n]) for n in names))
    nodes = dict(zip(names, made, strict=True))
    by_name = provider(ironic, kind, address_interface="eno1")

    async def active(node_id: str) -> ProviderMachine:
        return await until(
            lambda: by_name.create_machine(node_id, f"machine-rack-{node_id}", PUBLIC_KEY),
            lambda m: m.status is not None and m.status.startswith("active"),
        )

    await asyncio.gather(*(active(node_id) for node_id in made))
    listed = {m.provider_id: m for m in await by_name.list_machines()}
    said = {name: (listed[node_id].address, listed[node_id].status) for name, node_id in nodes.items()}
    assert said == {
        "never inspected": (
            None,
            "active, but Ironic keeps no inspection inventory of it: inspect it before it is deployed",
        ),
        "no eno1": (
            None,
            "active, but its inspection inventory has no interface eno1 (address_interface); it has 'enp1s0'",
        ),
        "not an IP": (
            None,
            "active, but interface eno1's ipv4_address in its inspection inventory is not an IPv4 address: 'not-an-ip'",
        ),
        "a list": (
            None,
            "active, but interface eno1's ipv4_address in its inspection inventory is not an IPv4 address: "
            "['192.0.2.3']",
        ),
        "no boot": ("192.0.2.5", "active"),
    }
    reads = sum(inventory_reads(ironic, node_id) for node_id in made)
    await by_name.list_machines()
    assert sum(inventory_reads(ironic, node_id) for node_id in made) == reads, "what is missing is not asked again"

    # By the boot interface, with three new inventories a listing: the other two are read by the next listing.
    by_boot = provider(ironic, kind)
    assert by_boot.inventories is not None
    by_boot.inventories.per_listing = 3
    first = {m.provider_id: m for m in await by_boot.list_machines()}
    not_yet = "active, but its inspection inventory is not read yet: a later pass reads it"
    unread = [n for n, m in first.items() if m.status == not_yet]
    assert len(unread) == 2, {n: (m.status, m.address) for n, m in first.items()}
    second = {m.provider_id: m for m in await by_boot.list_machines()}
    assert [n for n in unread if second[n].status == not_yet] == []
    assert second[nodes["no boot"]].status == (
        "active, but its inspection inventory names no boot interface (boot.pxe_interface), as after a boot from "
        "virtual media: name the interface with address_interface"
    )
    assert (second[nodes["no eno1"]].address, second[nodes["no eno1"]].status) == ("192.0.2.1", "active")
    assert sum(inventory_reads(ironic, node_id) for node_id in made) == reads + 5
    await by_boot.list_machines()
    assert sum(inventory_reads(ironic, node_id) for node_id in made) == reads + 5
    for instance in (by_name, by_boot):
        await instance.close()
