"""Ironic's REST API as the Ironic provider calls it: nodes read, claimed, deployed, power-cycled and undeployed, and
the inventory Ironic's inspection recorded of a node.

openstacksdk holds the session: the endpoint, the auth (none, HTTP basic, or a clouds.yaml cloud through Keystone)
and TLS. The calls go through its baremetal adapter as plain REST at one microversion (a later one for the inventory,
which only that serves), and every answer is read here, field by field, so an answer that is not what Ironic's API
promises is a ProviderProtocolError naming the node and the field rather than a None deep in a pass. openstacksdk is
blocking: each call runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from foundation.foreign_text import foreign_text
from providers import MachineNotFound, ProviderError, ProviderProtocolError, ProviderUnavailable

# The microversion every other call asks for: config drives as JSON (1.56), and every node field read here.
MICROVERSION = "1.56"
# A node's inspection inventory is served from this microversion on (Ironic 2023.1).
INVENTORY_MICROVERSION = "1.81"
# Nodes a listing page asks for; Ironic's own maximum is 1,000 unless its operator changed it.
PAGE_SIZE = 1000
# The node fields Shepherd reads: a listing asks for these alone.
NODE_FIELDS = (
    "uuid",
    "name",
    "provision_state",
    "target_provision_state",
    "power_state",
    "target_power_state",
    "instance_uuid",
    "maintenance",
    "maintenance_reason",
    "last_error",
    "resource_class",
    "conductor_group",
    "owner",
    "traits",
    "extra",
    "instance_info",
    "properties",
    "inspection_finished_at",
)
# Ironic's provision states (ironic/common/states.py); any other is an answer Shepherd does not understand.
PROVISION_STATES = frozenset(
    {
        "enroll",
        "verifying",
        "manageable",
        "inspecting",
        "inspect wait",
        "inspect failed",
        "cleaning",
        "clean wait",
        "clean failed",
        "clean hold",
        "available",
        "deploying",
        "wait call-back",
        "deploy failed",
        "deploy hold",
        "active",
        "deleting",
        "error",
        "rebuild",
        "adopting",
        "adopt failed",
        "rescuing",
        "rescue wait",
        "rescue failed",
        "rescue",
        "unrescuing",
        "unrescue failed",
        "servicing",
        "service wait",
        "service failed",
        "service hold",
    }
)
POWER_STATES = frozenset({"power on", "power off", "rebooting", "soft power off", "soft rebooting", "error"})


class IronicCredentialsRejected(ProviderError):
    """Ironic (or Keystone) refused Shepherd's credentials; asking again with the same ones cannot help."""

    retryable = False


class NodeConflict(ProviderError):
    """Ironic refused a change because of the node's state or its claim; not retried as it is."""

    retryable = False


@dataclass(frozen=True)
class Node:
    """One Ironic node, as far as Shepherd reads it."""

    uuid: str
    name: str | None
    provision_state: str
    target_provision_state: str | None
    power_state: str | None
    target_power_state: str | None
    instance_uuid: str | None
    maintenance: bool
    maintenance_reason: str | None
    last_error: str | None
    resource_class: str | None
    conductor_group: str
    owner: str | None
    traits: tuple[str, ...]
    extra: Mapping[str, Any]
    instance_info: Mapping[str, Any]
    properties: Mapping[str, Any]
    # When Ironic's inspection of the node last finished; it moves when a new inventory was recorded.
    inspection_finished_at: str | None

    def label(self) -> str:
        """The node as a message names it: its UUID, and its name when it has one."""
        return f"node {self.uuid}" + (f" ({self.name})" if self.name else "")


def parse_node(data: Any, where: str, provider: str) -> Node:
    """A Node from one JSON node object; ProviderProtocolError naming the node and the field that is wrong."""
    if not isinstance(data, dict):
        raise ProviderProtocolError(provider, f"{where}: a node must be an object, got {type(data).__name__}")
    node_id = data.get("uuid")
    if not isinstance(node_id, str) or not is_node_id(node_id):
        raise ProviderProtocolError(provider, f"{where}: a node's field 'uuid' must be a UUID, got {node_id!r}")

    def bad(field: str, wanted: str) -> ProviderProtocolError:
        return ProviderProtocolError(
            provider, f"{where}: node {node_id}: field {field!r} must be {wanted}, got {data.get(field)!r}"
        )

    def text(field: str, *, required: bool = False) -> str | None:
        value = data.get(field)
        if value is None and not required:
            return None
        if not isinstance(value, str):
            raise bad(field, "a string" if required else "a string or null")
        return value

    def table(field: str) -> Mapping[str, Any]:
        value = data.get(field)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad(field, "an object")
        return value

    provision_state = text("provision_state", required=True)
    if provision_state not in PROVISION_STATES:
        raise bad("provision_state", "one of Ironic's provision states")
    for field, known in (("target_provision_state", PROVISION_STATES), ("target_power_state", POWER_STATES)):
        target = text(field)
        if target is not None and target not in known:
            raise bad(field, "null or a state Ironic knows")
    power_state = text("power_state")
    if power_state is not None and power_state not in POWER_STATES:
        raise bad("power_state", "null or one of Ironic's power states")
    instance_uuid = text("instance_uuid")
    if instance_uuid is not None and not is_node_id(instance_uuid):
        raise bad("instance_uuid", "null or a UUID")
    maintenance = data.get("maintenance", False)
    if not isinstance(maintenance, bool):
        raise bad("maintenance", "true or false")
    traits = data.get("traits") or []
    if not isinstance(traits, list) or not all(isinstance(trait, str) for trait in traits):
        raise bad("traits", "a list of strings")
    return Node(
        uuid=node_id,
        name=text("name"),
        provision_state=provision_state,
        target_provision_state=text("target_provision_state"),
        power_state=power_state,
        target_power_state=text("target_power_state"),
        instance_uuid=instance_uuid,
        maintenance=maintenance,
        maintenance_reason=text("maintenance_reason"),
        last_error=text("last_error"),
        resource_class=text("resource_class"),
        conductor_group=text("conductor_group") or "",
        owner=text("owner"),
        traits=tuple(traits),
        extra=table("extra"),
        instance_info=table("instance_info"),
        properties=table("properties"),
        inspection_finished_at=text("inspection_finished_at"),
    )


def is_node_id(value: str) -> bool:
    """Whether value is a UUID in its canonical form, as Ironic writes node and instance UUIDs."""
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


class IronicAPI:
    """Calls to one Ironic, each in a thread; every failure a ProviderError naming the call and the problem."""

    def __init__(self, provider: str, connection: Any, endpoint: str) -> None:
        self.provider = provider
        # An openstack.connection.Connection; typed loosely, since openstacksdk is an optional extra.
        self.connection = connection
        self.endpoint = endpoint

    async def nodes(self) -> list[Node]:
        """Every node Ironic holds, read page by page."""
        nodes: list[Node] = []
        marker: str | None = None
        while True:
            params = {"fields": ",".join(NODE_FIELDS), "limit": str(PAGE_SIZE), "sort_key": "uuid"}
            if marker is not None:
                params["marker"] = marker
            page = await self._call("list the nodes", "GET", "/nodes", params=params)
            listed = page.get("nodes") if isinstance(page, dict) else None
            if not isinstance(listed, list):
                raise ProviderProtocolError(self.provider, "list the nodes: the answer has no list 'nodes'")
            nodes.extend(parse_node(data, "list the nodes", self.provider) for data in listed)
            if len(listed) < PAGE_SIZE or not page.get("next"):
                return nodes
            marker = nodes[-1].uuid

    async def node(self, node_id: str) -> Node:
        """One node; MachineNotFound when Ironic has none with that UUID."""
        where = f"read node {node_id}"
        data = await self._call(where, "GET", f"/nodes/{node_id}", missing=node_id)
        return parse_node(data, where, self.provider)

    async def inventory(self, node_id: str) -> Mapping[str, Any] | None:
        """The inventory Ironic's inspection recorded of the node; None when Ironic keeps none."""
        where = f"read the inspection inventory of node {node_id}"
        try:
            data = await self._call(
                where, "GET", f"/nodes/{node_id}/inventory", missing=node_id, microversion=INVENTORY_MICROVERSION
            )
        except MachineNotFound:
            return None
        inventory = data.get("inventory") if isinstance(data, dict) else None
        if not isinstance(inventory, dict):
            raise ProviderProtocolError(self.provider, f"{where}: the answer has no object 'inventory'")
        return inventory

    async def patch(self, node_id: str, changes: list[dict[str, Any]], doing: str) -> Node:
        """Apply a JSON patch to the node; the node as Ironic holds it afterwards."""
        where = f"{doing} ({node_id})"
        data = await self._call(where, "PATCH", f"/nodes/{node_id}", body=changes, missing=node_id)
        return parse_node(data, where, self.provider)

    async def provision(self, node_id: str, target: str, doing: str, **more: Any) -> None:
        """Ask for a provision state change (active, rebuild, deleted); Ironic answers 202 and works on."""
        body = {"target": target, **more}
        await self._call(
            f"{doing} ({node_id})", "PUT", f"/nodes/{node_id}/states/provision", body=body, missing=node_id
        )

    async def power(self, node_id: str, target: str, doing: str) -> None:
        """Ask for a power state change (rebooting, power off); Ironic answers 202 and works on."""
        body = {"target": target}
        await self._call(f"{doing} ({node_id})", "PUT", f"/nodes/{node_id}/states/power", body=body, missing=node_id)

    async def _call(
        self,
        where: str,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        missing: str | None = None,
        microversion: str = MICROVERSION,
    ) -> Any:
        """One request; its JSON answer, or a ProviderError that says what went wrong."""
        return await asyncio.to_thread(self._request, where, method, path, params, body, missing, microversion)

    def _request(
        self,
        where: str,
        method: str,
        path: str,
        params: dict[str, str] | None,
        body: Any,
        missing: str | None,
        microversion: str,
    ) -> Any:
        from keystoneauth1 import exceptions as ksa

        try:
            response = self.connection.baremetal.request(
                path,
                method,
                params=params,
                json=body,
                microversion=microversion,
                raise_exc=False,
                connect_retries=0,
                status_code_retries=0,
            )
        except ksa.Unauthorized as error:
            raise IronicCredentialsRejected(
                self.provider, f"{where}: Keystone refused the credentials: {error}"
            ) from None
        except (ksa.ConnectFailure, ksa.ConnectTimeout, ksa.RequestTimeout, ksa.SSLError) as error:
            raise ProviderUnavailable(
                self.provider, f"{where}: no answer from Ironic at {self.endpoint}: {error}"
            ) from None
        except ksa.DiscoveryFailure as error:
            # keystoneauth words an endpoint that is down as one that is not Ironic's: a second look tells them apart,
            # so an outage at a worker's first call (its version discovery) is retried as any other outage is.
            outage = self._outage()
            if outage is not None:
                raise ProviderUnavailable(self.provider, f"{where}: {outage}") from None
            raise ProviderProtocolError(
                self.provider, f"{where}: {self.endpoint} does not answer as Ironic's API does: {error}"
            ) from None
        except ksa.ClientException as error:
            raise ProviderUnavailable(self.provider, f"{where}: {type(error).__name__}: {error}") from None
        status = response.status_code
        if status in (200, 201, 202, 204):
            if status in (202, 204) or not response.content:
                return None
            try:
                return response.json()
            except ValueError:
                raise ProviderProtocolError(
                    self.provider, f"{where}: Ironic answered HTTP {status} with no JSON: {response.text[:100]!r}"
                ) from None
        fault = _fault(response)
        if status in (401, 403):
            raise IronicCredentialsRejected(
                self.provider, f"{where}: Ironic at {self.endpoint} refused the credentials (HTTP {status}): {fault}"
            )
        if status == 404 and missing is not None:
            raise MachineNotFound(self.provider, missing)
        if status == 406:
            raise ProviderProtocolError(
                self.provider, f"{where}: Ironic at {self.endpoint} does not serve microversion {microversion}: {fault}"
            )
        if status == 409:
            if "locked" in fault.lower():
                # Another operation holds the node's lock for a moment: the next try usually gets it.
                raise ProviderUnavailable(self.provider, f"{where}: the node is busy: {fault}")
            raise NodeConflict(self.provider, f"{where}: Ironic refused: {fault}")
        if status == 429 or status >= 500:
            raise ProviderUnavailable(self.provider, f"{where}: Ironic answered HTTP {status}: {fault}")
        raise ProviderProtocolError(self.provider, f"{where}: Ironic answered HTTP {status}: {fault}")

    def _outage(self) -> str | None:
        """What keeps Ironic from answering where its version discovery asked (no answer, HTTP 429 or 5xx), in a
        line; None when something answers there otherwise."""
        from keystoneauth1 import exceptions as ksa

        config = self.connection.config
        try:
            # Where discovery asked: the endpoint given, else the catalog's, read without discovering again.
            url = config.get_endpoint("baremetal") or self.connection.session.get_endpoint(
                service_type="baremetal",
                interface=config.get_interface("baremetal"),
                region_name=config.get_region_name("baremetal"),
                skip_discovery=True,
            )
            answer = self.connection.session.get(url, authenticated=False, raise_exc=False, connect_retries=0)
        except ksa.ConnectionError as error:
            return f"no answer from Ironic at {self.endpoint}: {error}"
        except ksa.ClientException:
            return None
        if answer.status_code == 429 or answer.status_code >= 500:
            return f"Ironic at {self.endpoint} answered HTTP {answer.status_code}: {_fault(answer)}"
        return None


def _fault(response: Any) -> str:
    """Ironic's own words for a refusal: the faultstring inside its error_message, else the start of the body."""
    try:
        outer = response.json()
        message = outer.get("error_message", outer) if isinstance(outer, dict) else outer
        inner = json.loads(message) if isinstance(message, str) else message
        if isinstance(inner, dict):
            text = inner.get("faultstring") or inner.get("description") or inner.get("title")
            if isinstance(text, str) and text:
                return foreign_text(" ".join(text.split()), 500)
        if isinstance(message, str):
            return foreign_text(" ".join(message.split()), 500)
    except ValueError:
        pass
    return foreign_text(" ".join(str(response.text).split()), 200) or "(no body)"
