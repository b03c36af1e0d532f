"""The Ironic provider: OpenStack Ironic's nodes as Shepherd's machines, deployed, power-cycled and undeployed.

A node is Shepherd's when Shepherd claimed it: its instance_uuid is the one Shepherd derives from the machine's
idempotency key, and its extra says so (shepherd_provider, shepherd_instance_uuid), both set in one change. Ironic
refuses a second claim of a node and one instance_uuid on two nodes, so a create repeated with the same key finds
its own node again and never a second one. Available nodes in the operator's filter are free capacity. Every other
node (someone else's deployment, a node in maintenance, enroll or manageable) is never touched, and the listing
counts why each was left alone.

Nothing here waits minutes in an activity: a deploy, an undeploy and its disk cleaning are started, then asked about
again on the step's back-off, which shows what Ironic says in the machine's status meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from dataclasses import replace
from typing import Any

from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from providers import (
    Availability,
    CapacityConflict,
    MachineNotFound,
    MaintenanceHold,
    NotDoneYet,
    ProviderMachine,
    ProviderUnavailable,
    Rebooted,
    Reimaged,
    RetireAction,
    Retired,
)
from providers.ironic_api import IronicAPI, Node, NodeConflict, is_node_id
from providers.ironic_inventory import InventoryAddresses
from providers.ironic_options import SECRET_OPTIONS, IronicOptions, parse_address, read_options
from providers.registry import secret_options

log = logging.getLogger(__name__)

PROVIDER_TYPE = "ironic"
# The names in a node's extra that mark it as Shepherd's.
OWNER_MARK = "shepherd_provider"
INSTANCE_MARK = "shepherd_instance_uuid"
# instance_uuids are derived from this namespace and the machine's idempotency key.
INSTANCE_NAMESPACE = uuid.UUID("7c0a8d4e-5b8f-4c43-9d1e-2f3a6b7c8d90")
# A deploy under way: asked about again on the step's back-off.
DEPLOYING = frozenset({"deploying", "wait call-back", "deploy hold"})
# An undeploy under way: the node is Shepherd's until its disks are clean.
UNDEPLOYING = frozenset({"deleting", "cleaning", "clean wait", "clean hold"})
# How often a reboot reads the power state back while Ironic works on it.
POWER_POLL = 1.0


def instance_uuid_for(idempotency_key: str) -> str:
    """The instance_uuid Shepherd claims a node with for this idempotency key: the same key, the same UUID."""
    return str(uuid.uuid5(INSTANCE_NAMESPACE, idempotency_key))


class IronicProvider:
    """The Provider of an Ironic's nodes."""

    def __init__(self, options: IronicOptions, api: IronicAPI, *, sleep: Any = asyncio.sleep) -> None:
        self.options = options
        self.api = api
        self._sleep = sleep
        # Why the last listing left each node alone, by reason; shown by `shepherd provider check` and the log.
        self.left_alone: Counter[str] = Counter()
        self.inventories = InventoryAddresses.of(options, api)

    @property
    def name(self) -> str:
        """The provider instance's name."""
        return self.options.provider

    def is_valid_id(self, provider_id: str) -> bool:
        """Whether provider_id is a node UUID in its canonical form."""
        return is_node_id(provider_id)

    def is_ours(self, node: Node) -> bool:
        """Whether Shepherd claimed the node, deployed or not: its instance_uuid and its extra say so together."""
        return (
            node.instance_uuid is not None
            and node.extra.get(OWNER_MARK) == self.name
            and node.extra.get(INSTANCE_MARK) == node.instance_uuid
        )

    def _is_retiring(self, node: Node) -> bool:
        """Whether the node is Shepherd's undeploy still under way: Ironic cleared its instance_uuid, not our mark."""
        return (
            node.instance_uuid is None
            and node.extra.get(OWNER_MARK) == self.name
            and bool(node.extra.get(INSTANCE_MARK))
        )

    def why_not_capacity(self, node: Node) -> str | None:
        """Why the node is no free capacity for Shepherd; None when it is."""
        options = self.options
        if node.instance_uuid is not None:
            return "deployed or claimed by someone else"
        if node.maintenance:
            return "in maintenance"
        if node.provision_state != "available":
            return f"{node.provision_state}, not available"
        if options.resource_class is not None and node.resource_class != options.resource_class:
            return "another resource class"
        if options.conductor_group is not None and node.conductor_group != options.conductor_group:
            return "another conductor group"
        if options.owner is not None and node.owner != options.owner:
            return "another owner"
        if not set(options.traits) <= set(node.traits):
            return "without the traits asked for"
        return None

    def _machine(self, node: Node, availability: Availability) -> ProviderMachine:
        """The node as Shepherd's machine: its SSH address once it is deployed."""
        address, port, status = None, self.options.ssh_port, node.provision_state
        if availability is Availability.KNOWN_USED and node.provision_state == "active":
            try:
                address, found_port = self._address(node)
                port = found_port or port
            except ValueError as problem:
                status = f"active, but {problem}"
        return ProviderMachine(
            provider_id=node.uuid,
            availability=availability,
            address=address,
            ssh_port=port,
            location=node.conductor_group or None,
            status=status,
            ssh_user=self.options.ssh_user,
        )

    def _address(self, node: Node) -> tuple[str, int | None]:
        """Where SSH reaches the deployed node, as the options say to find it; ValueError saying what is missing."""
        if self.inventories is not None:
            return self.inventories.address(node), None
        if self.options.address_field is not None:
            table, key = self.options.address_field
            value = getattr(node, table).get(key)
            if value is None:
                raise ValueError(f"its {table}/{key} is not set")
            return parse_address(value, node.label(), f"{table}/{key}")
        assert self.options.address_template is not None
        if node.name is None and "{name}" in self.options.address_template:
            raise ValueError("it has no name for the address template")
        value = self.options.address_template.format(name=node.name, uuid=node.uuid)
        return parse_address(value, node.label(), "the address template")

    async def list_machines(self) -> list[ProviderMachine]:
        """Shepherd's nodes, and the available nodes in the filter as free capacity; the rest counted, not listed."""
        machines: list[ProviderMachine] = []
        left_alone: Counter[str] = Counter()
        nodes = await self.api.nodes()
        await self._read_inventories(nodes, listing=True)
        for node in nodes:
            seen = self._seen(node)
            if isinstance(seen, str):
                left_alone[seen] += 1
            else:
                machines.append(seen)
        if left_alone != self.left_alone and left_alone:
            log.info(
                "provider %s leaves %d Ironic nodes alone: %s",
                self.name,
                left_alone.total(),
                ", ".join(f"{count} {reason}" for reason, count in left_alone.most_common()),
            )
        self.left_alone = left_alone
        return machines

    async def get_machine(self, provider_id: str) -> ProviderMachine:
        """One node as Shepherd sees it; MachineNotFound when it is neither Shepherd's nor free capacity."""
        node = await self._node(provider_id)
        await self._read_inventories([node])
        seen = self._seen(node)
        if isinstance(seen, str):
            raise MachineNotFound(self.name, provider_id)
        return seen

    async def _read_inventories(self, nodes: list[Node], *, listing: bool = False) -> None:
        """Read what inspection recorded of the deployed nodes among these, when the address comes from there."""
        if self.inventories is not None:
            deployed = [n for n in nodes if n.provision_state == "active" and (self.is_ours(n) or self._is_retiring(n))]
            await self.inventories.read(deployed, listing=listing)

    def _seen(self, node: Node) -> ProviderMachine | str:
        """The node as Shepherd sees it: its machine (Shepherd's, or free capacity), or why it is left alone."""
        if self.is_ours(node) or self._is_retiring(node):
            return self._machine(node, Availability.KNOWN_USED)
        reason = self.why_not_capacity(node)
        return reason if reason is not None else self._machine(node, Availability.KNOWN_UNUSED)

    async def _node(self, provider_id: str) -> Node:
        """The node of that UUID; MachineNotFound for an id of the wrong form, without asking Ironic."""
        if not self.is_valid_id(provider_id):
            raise MachineNotFound(self.name, provider_id)
        return await self.api.node(provider_id)

    async def create_machine(self, provider_id: str, idempotency_key: str, ssh_public_key: str) -> ProviderMachine:
        """Claim the available node, deploy it with Shepherd's key in a config drive, and say how far it is.

        Called again on the step's back-off until the node is active: the machine it returns has an address only
        then. A failed deploy is started again and reported with Ironic's last_error.
        """
        instance_uuid = instance_uuid_for(idempotency_key)
        node = await self._claimed(await self._node(provider_id), instance_uuid)
        if node.maintenance:
            raise self._held(node, "Shepherd deploys it once an operator lifts it (`baremetal node maintenance unset`)")
        state = node.provision_state
        if state == "available":
            await self._deploy(node, instance_uuid, ssh_public_key)
            return replace(self._machine(node, Availability.KNOWN_USED), status="deploying")
        if state == "deploy failed":
            error = node.last_error or "Ironic recorded no error"
            await self._deploy(node, instance_uuid, ssh_public_key)
            raise NotDoneYet(self.name, f"{node.label()}: deploy failed: {error}; deploying it again")
        if state in DEPLOYING or state == "active":
            await self._read_inventories([node])
            return self._machine(node, Availability.KNOWN_USED)
        raise CapacityConflict(
            self.name, f"{node.label()} is {state} since Shepherd claimed it, not deployable: look at it in Ironic"
        )

    def _held(self, node: Node, then: str) -> MaintenanceHold:
        """The error of a node Ironic holds in its maintenance, saying why and what Shepherd does once it ends."""
        why = node.maintenance_reason or "no reason given"
        return MaintenanceHold(self.name, f"{node.label()} is in Ironic's maintenance ({why}): {then}")

    async def _claimed(self, node: Node, instance_uuid: str) -> Node:
        """The node, claimed for instance_uuid by this call or an earlier one; CapacityConflict when it is another's."""
        if self.is_ours(node) and node.instance_uuid == instance_uuid:
            return node
        if node.instance_uuid is not None:
            raise CapacityConflict(self.name, f"{node.label()} is claimed by instance {node.instance_uuid}")
        reason = self.why_not_capacity(node)
        if reason is not None:
            raise CapacityConflict(self.name, f"{node.label()} is no free capacity: {reason}")
        claim = [
            {"op": "add", "path": "/instance_uuid", "value": instance_uuid},
            {"op": "add", "path": f"/extra/{OWNER_MARK}", "value": self.name},
            {"op": "add", "path": f"/extra/{INSTANCE_MARK}", "value": instance_uuid},
        ]
        claim += [
            {"op": "add", "path": f"/instance_info/{key}", "value": value}
            for key, value in self.options.instance_info.items()
        ]
        try:
            return await self.api.patch(node.uuid, claim, "claim the node")
        except NodeConflict:
            # Ironic refused the claim: another one won the node, or an earlier try of ours did and its answer was
            # lost. Only a fresh read tells which.
            again = await self.api.node(node.uuid)
            if self.is_ours(again) and again.instance_uuid == instance_uuid:
                return again
            raise CapacityConflict(
                self.name, f"{node.label()} was claimed by instance {again.instance_uuid} meanwhile"
            ) from None

    async def _deploy(self, node: Node, instance_uuid: str, ssh_public_key: str) -> None:
        """Ask Ironic to deploy the node, with a config drive that gives the new OS Shepherd's SSH key."""
        await self.api.provision(
            node.uuid, "active", "deploy the node", configdrive=self._config_drive(node, instance_uuid, ssh_public_key)
        )
        log.info("provider %s: deploying %s as instance %s", self.name, node.label(), instance_uuid)

    def _config_drive(self, node: Node, instance_uuid: str, ssh_public_key: str) -> dict[str, Any]:
        """The config drive Ironic builds for the new OS: Shepherd's public key, a host name, the user data."""
        drive: dict[str, Any] = {
            "meta_data": {
                "uuid": instance_uuid,
                "hostname": node.name or node.uuid,
                "public_keys": {"shepherd": ssh_public_key},
            }
        }
        user_data = self.options.user_data()
        if user_data is not None:
            drive["user_data"] = user_data
        return drive

    async def reboot_machine(self, provider_id: str) -> Rebooted:
        """Power-cycle Shepherd's node through Ironic and confirm it by the power state read back."""
        node = await self._node(provider_id)
        if not self.is_ours(node):
            raise CapacityConflict(self.name, f"{node.label()} is not Shepherd's: not rebooted")
        await self.api.power(node.uuid, "rebooting", "reboot the node")
        node = await self._power_settled(node.uuid)
        if node.power_state != "power on":
            raise ProviderUnavailable(
                self.name,
                f"{node.label()}: after the reboot Ironic reads its power {node.power_state}"
                + (f": {node.last_error}" if node.last_error else ""),
            )
        # Ironic answers a reboot once it has turned the power off and on again through the BMC.
        return Rebooted(went_down=True, detail=f"Ironic power-cycled {node.label()}; power on")

    async def _power_settled(self, node_id: str) -> Node:
        """The node once Ironic has no power change pending; ProviderUnavailable when that takes too long."""
        deadline = time.monotonic() + self.options.power_timeout
        while True:
            node = await self.api.node(node_id)
            if node.target_power_state is None:
                return node
            if time.monotonic() >= deadline:
                raise ProviderUnavailable(
                    self.name,
                    f"{node.label()}: Ironic still turns its power to {node.target_power_state} after "
                    f"{self.options.power_timeout:g}s (power_timeout)",
                )
            await self._sleep(POWER_POLL)

    async def reimage_machine(self, provider_id: str, ssh_public_key: str) -> Reimaged:
        """Rebuild Shepherd's node through Ironic: its image written again, Shepherd's key in a new config drive.

        Ironic works on after the call; the node has an SSH address again once it is active.
        """
        node = await self._node(provider_id)
        if not self.is_ours(node):
            raise CapacityConflict(self.name, f"{node.label()} is not Shepherd's: not rebuilt")
        if node.maintenance:
            raise self._held(node, "Shepherd rebuilds it once an operator lifts it")
        if node.provision_state == "rebuild" or node.provision_state in DEPLOYING:
            return Reimaged(f"Ironic is at it already: {node.label()} is {node.provision_state}")
        if node.provision_state not in ("active", "deploy failed"):
            raise CapacityConflict(self.name, f"{node.label()} is {node.provision_state}: Ironic cannot rebuild it")
        assert node.instance_uuid is not None  # is_ours
        drive = self._config_drive(node, node.instance_uuid, ssh_public_key)
        await self.api.provision(node.uuid, "rebuild", "rebuild the node", configdrive=drive)
        log.info("provider %s: rebuilding %s", self.name, node.label())
        return Reimaged(f"Ironic rebuilds {node.label()}: its image again, with Shepherd's key")

    async def retire_machine(self, provider_id: str) -> Retired:
        """Undeploy Shepherd's node, so that Ironic cleans its disks and makes it available again.

        Called again on the step's back-off until the cleaning is over; RELEASED then, with its outcome.
        """
        try:
            node = await self._node(provider_id)
        except MachineNotFound:
            return Retired(RetireAction.UNTOUCHED, f"Ironic has no node {provider_id} any more")
        if self.is_ours(node):
            if node.provision_state in UNDEPLOYING:
                raise NotDoneYet(self.name, f"{node.label()} is {node.provision_state}")
            await self.api.provision(node.uuid, "deleted", "undeploy the node")
            raise NotDoneYet(self.name, f"{node.label()}: undeploying; Ironic cleans its disks next")
        if not self._is_retiring(node):
            return Retired(RetireAction.UNTOUCHED, f"{node.label()} is not Shepherd's (any more): left as it is")
        if node.provision_state in UNDEPLOYING:
            raise NotDoneYet(self.name, f"{node.label()} is {node.provision_state}")
        outcome = (
            "cleaned and available again"
            if node.provision_state == "available"
            else f"{node.provision_state} after the undeploy: {node.last_error or 'Ironic recorded no error'}"
        )
        await self.api.patch(
            node.uuid,
            [{"op": "remove", "path": f"/extra/{mark}"} for mark in (OWNER_MARK, INSTANCE_MARK)],
            "forget Shepherd's mark on the node",
        )
        return Retired(RetireAction.RELEASED, f"Ironic undeployed {node.label()}: {outcome}")

    async def close(self) -> None:
        """Close the session to Ironic."""
        await asyncio.to_thread(self.api.connection.close)


def connect(options: IronicOptions) -> Any:
    """An openstacksdk connection to the Ironic the options name; SettingsError when openstacksdk is missing."""
    try:
        import openstack.config
        import openstack.connection
    except ImportError as missing:
        raise options.error(f"needs openstacksdk: pip install 'shepherd[ironic]' ({missing})") from None
    common: dict[str, Any] = {
        "api_timeout": options.timeout,
        "baremetal_status_code_retries": 0,
        "baremetal_connect_retries": 0,
    }
    if options.cloud is not None:
        files = [str(options.clouds_file)] if options.clouds_file is not None else None
        try:
            region = openstack.config.OpenStackConfig(config_files=files).get_one(cloud=options.cloud, **common)
        except Exception as error:  # openstacksdk raises its own config errors and plain ones alike
            raise options.error(f"cloud {options.cloud!r}: {error}") from None
        return openstack.connection.Connection(config=region)
    auth: dict[str, Any] = {"endpoint": options.endpoint}
    if options.auth == "http_basic":
        auth.update(username=options.username, password=options.password())
    return openstack.connection.Connection(
        auth_type=options.auth,
        auth=auth,
        baremetal_endpoint_override=options.endpoint,
        verify=options.verify,
        **common,
    )


@secret_options(*SECRET_OPTIONS)
def from_settings(instance: ProviderInstance, settings: Settings) -> IronicProvider:
    """The shepherd.providers entry point: the options are docs/providers.md's Ironic section."""
    options = read_options(instance, settings.provider_timeout)
    connection = connect(options)
    endpoint = options.endpoint or f"cloud {options.cloud}"
    return IronicProvider(options, IronicAPI(instance.name, connection, endpoint))
