"""Bad input at the ironic provider's boundaries: its options, and answers that are not what Ironic's API promises.

The answers come from a stand-in HTTP server on loopback that answers as a broken Ironic, or a proxy in front of
one, would: a real Ironic never sends them, which is why they need a stand-in.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from providers import ProviderProtocolError, ProviderUnavailable
from providers.ironic import IronicProvider, from_settings
from providers.ironic_api import parse_node
from providers.ironic_inventory import inventory_address
from providers.ironic_options import parse_address, read_options
from tests.sshd_fixtures import free_port

NODE = "0b0a3c1e-8a7e-4a5b-9c7d-6e5f4a3b2c1d"
FROM_INSPECTION = {"address_field": None, "address_source": "inspection"}
BASE = {"endpoint": "http://127.0.0.1:6385", "image_source": "http://127.0.0.1:9/os.qcow2", "address_field": "extra/a"}


def options(**changes: Any) -> dict[str, Any]:
    given = {**BASE, **changes}
    return {key: value for key, value in given.items() if value is not None}


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"endpoint": None}, "name Ironic by endpoint (its URL) or by cloud"),
        ({"cloud": "prod"}, "name Ironic by endpoint (its URL) or by cloud"),
        ({"endpoint": "ironic:6385"}, "endpoint must be an http:// or https:// URL"),
        ({"auth": "keystone"}, "auth must be one of none, http_basic (Keystone: use cloud)"),
        ({"auth": "http_basic"}, "auth = http_basic needs username"),
        ({"auth": "http_basic", "username": "u"}, "needs password_file or password_env, one of the two"),
        ({"password": "hunter2"}, "has no option password"),
        ({"username": "u"}, "username, password_file and password_env go with auth = http_basic"),
        ({"endpoint": None, "cloud": "prod", "auth": "none"}, "auth goes with endpoint"),
        ({"clouds_file": "/etc/clouds.yaml"}, "clouds_file goes with cloud"),
        ({"verify_tls": "yes"}, "verify_tls must be true or false"),
        ({"verify_tls": False, "ca_file": "/ca.pem"}, "ca_file and verify_tls = false contradict each other"),
        ({"traits": "CUSTOM_A"}, "traits must be a list of trait names"),
        ({"traits": ["custom a"]}, "traits must be a list of trait names"),
        ({"image_source": None}, "image_source must name the image to deploy"),
        ({"instance_info": {"image_source": "http://x/y"}}, "image_source is given twice"),
        ({"instance_info": {"boot_iso": "http://x/boot.iso"}}, "image_source and instance_info's boot_iso exclude"),
        ({"image_source": None, "instance_info": {"boot_iso": ""}}, "instance_info's boot_iso must be the URL of"),
        ({"instance_info": "image"}, "instance_info must be a table"),
        ({"root_device": {}}, "root_device must be a table of Ironic root device hints"),
        ({"address_field": None}, "say where SSH reaches a deployed node"),
        ({"address_template": "{name}.example.com"}, "say where SSH reaches a deployed node"),
        ({"address_field": "driver_info/ip"}, "address_field must be TABLE/KEY with TABLE one of extra"),
        ({"address_field": "extra"}, "address_field must be TABLE/KEY"),
        ({"address_field": None, "address_template": "{bmc}.example.com"}, "address_template must use the node's"),
        ({"address_field": None, "address_template": "static.example.com"}, "address_template must use the node's"),
        ({"address_field": None, "address_template": "{name"}, "address_template '{name'"),
        ({"address_source": "inspection"}, "say where SSH reaches a deployed node"),
        ({**FROM_INSPECTION, "address_source": "dhcp"}, 'address_source must be "inspection"'),
        (
            {"address_interface": "eno1"},
            'address_interface and address_ip_version go with address_source = "inspection"',
        ),
        ({"address_ip_version": 6}, 'address_interface and address_ip_version go with address_source = "inspection"'),
        ({**FROM_INSPECTION, "address_interface": "eno1/2"}, "address_interface must be a network interface's name"),
        ({**FROM_INSPECTION, "address_interface": "a-name-too-long-for-linux"}, "address_interface must be a network"),
        ({**FROM_INSPECTION, "address_interface": 1}, "address_interface must be a network interface's name"),
        ({**FROM_INSPECTION, "address_ip_version": "6"}, "address_ip_version must be 4 or 6"),
        ({**FROM_INSPECTION, "address_ip_version": True}, "address_ip_version must be 4 or 6"),
        ({**FROM_INSPECTION, "address_ip_version": 5}, "address_ip_version must be 4 or 6"),
        ({"ssh_port": 0}, "ssh_port must be a port number"),
        ({"ssh_port": True}, "ssh_port must be a port number"),
        ({"ssh_user": "root; reboot"}, "ssh_user must be a user name"),
        ({"timeout": "soon"}, "timeout"),
        ({"resource_class": ""}, "resource_class must be a non-empty string"),
    ],
)
def test_each_wrong_option_is_named(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(SettingsError) as raised:
        read_options(ProviderInstance("rack", "ironic", options(**changes)), 10.0)
    assert problem in str(raised.value) and "instance 'rack'" in str(raised.value)


def test_options_that_are_right_are_kept() -> None:
    read = read_options(
        ProviderInstance(
            "rack",
            "ironic",
            options(
                address_field=None,
                address_template="{name}.rack1.example.com",
                image_checksum="sha256:" + "0" * 64,
                root_device={"size": ">= 100"},
                instance_info={"image_type": "whole-disk"},
                traits=["CUSTOM_SHEPHERD"],
                timeout="30s",
                ssh_port=2222,
            ),
        ),
        10.0,
    )
    assert read.instance_info == {
        "image_type": "whole-disk",
        "image_source": BASE["image_source"],
        "image_checksum": "sha256:" + "0" * 64,
        "root_device": {"size": ">= 100"},
    }
    assert (read.timeout, read.ssh_port, read.traits, read.auth) == (30.0, 2222, ("CUSTOM_SHEPHERD",), "none")
    inspection = read_options(
        ProviderInstance("rack", "ironic", options(**FROM_INSPECTION, address_interface="eno1", address_ip_version=6)),
        10.0,
    )
    assert (inspection.address_source, inspection.address_interface, inspection.address_ip_version) == (
        "inspection",
        "eno1",
        6,
    )
    assert read.address_source is None


BOOT = "52:54:00:12:34:56"


def interfaces(*entries: dict[str, Any], boot: Any = BOOT) -> dict[str, Any]:
    return {"interfaces": list(entries), "boot": {"pxe_interface": boot}}


@pytest.mark.parametrize(
    ("inventory", "interface", "ip_version", "found"),
    [
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "10.0.0.7"}), None, None, "10.0.0.7"),
        (interfaces({"name": "eno1", "mac_address": BOOT.upper(), "ipv4_address": "10.0.0.7"}), None, None, "10.0.0.7"),
        (
            interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "10.0.0.7"}, boot="01-52-54-00-12-34-56"),
            None,
            None,
            "10.0.0.7",
        ),
        (
            interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "10.0.0.7"}, boot="52-54-00-12-34-56"),
            None,
            None,
            "10.0.0.7",
        ),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv6_address": "fd00::7%eno1"}), None, None, "fd00::7"),
        (
            interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "10.0.0.7", "ipv6_address": "fd00::7"}),
            None,
            6,
            "fd00::7",
        ),
        (
            interfaces(
                {"name": "eno1", "mac_address": BOOT, "ipv4_address": "10.0.0.7"},
                {"name": "eno2", "mac_address": "52:54:00:12:34:57", "ipv4_address": "10.1.0.7"},
            ),
            "eno2",
            None,
            "10.1.0.7",
        ),
    ],
)
def test_an_address_in_an_inspection_inventory(
    inventory: dict[str, Any], interface: str | None, ip_version: int | None, found: str
) -> None:
    assert inventory_address(inventory, interface, ip_version) == found


@pytest.mark.parametrize(
    ("inventory", "ip_version", "problem"),
    [
        ({"interfaces": "eno1"}, None, "its inspection inventory has no list of interfaces: 'eno1'"),
        ({"interfaces": ["eno1"]}, None, "its inspection inventory has no list of interfaces"),
        (interfaces({"name": "eno1", "mac_address": BOOT}, boot=None), None, "names no boot interface"),
        ({"interfaces": [{"name": "eno1", "mac_address": BOOT}], "boot": "pxe"}, None, "names no boot interface"),
        (interfaces({"name": "eno1", "mac_address": BOOT}, boot="eno1"), None, "boot.pxe_interface is no MAC address"),
        (
            interfaces({"name": "eno1", "mac_address": "52:54:00:00:00:01"}),
            None,
            "no interface of the boot interface's",
        ),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": ""}), None, "has no IPv4 or IPv6 address"),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "10.0.0.7"}), 6, "has no IPv6 address"),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "fd00::7"}), None, "not an IPv4 address"),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": 167772167}), None, "not an IPv4 address"),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv6_address": "fe80::7%eno1"}), None, "not one SSH can"),
        (interfaces({"name": "eno1", "mac_address": BOOT, "ipv4_address": "0.0.0.0"}), None, "not one SSH can reach"),
    ],
)
def test_an_inspection_inventory_without_an_address_says_why(
    inventory: dict[str, Any], ip_version: int | None, problem: str
) -> None:
    with pytest.raises(ValueError) as raised:
        inventory_address(inventory, None, ip_version)
    assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_a_ramdisk_deploy_names_the_iso_it_boots_instead_of_an_image() -> None:
    info = {"boot_iso": "http://127.0.0.1:9/boot.iso", "ramdisk_image_download_source": "http"}
    read = read_options(ProviderInstance("rack", "ironic", options(image_source=None, instance_info=info)), 10.0)
    assert read.instance_info == info


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ("10.0.0.7", ("10.0.0.7", None)),
        ("10.0.0.7:2222", ("10.0.0.7", 2222)),
        ("node1.rack1.example.com", ("node1.rack1.example.com", None)),
        ("fd00::7", ("fd00::7", None)),
        ("[fd00::7]:2222", ("fd00::7", 2222)),
        (" 10.0.0.7 ", ("10.0.0.7", None)),
    ],
)
def test_an_address_read_from_a_node(value: str, found: tuple[str, int | None]) -> None:
    assert parse_address(value, "node x", "extra/a") == found


@pytest.mark.parametrize(
    "value", ["", 7, "10.0.0.7:ssh", "10.0.0.7:70000", "[fd00::7]x", "host name", "fd00::zz", "a;b", "[::1]:0"]
)
def test_an_address_that_is_none_is_refused_naming_the_node(value: Any) -> None:
    with pytest.raises(ValueError, match="node x: extra/a"):
        parse_address(value, "node x", "extra/a")


def node(**changes: Any) -> dict[str, Any]:
    data = {"uuid": NODE, "provision_state": "available", "power_state": "power off", "maintenance": False}
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (node(provision_state=None), f"node {NODE}: field 'provision_state' must be a string"),
        (node(provision_state="exploding"), "field 'provision_state' must be one of Ironic's provision states"),
        (node(power_state="half on"), "field 'power_state' must be null or one of Ironic's power states"),
        (node(target_provision_state="sideways"), "field 'target_provision_state' must be null or a state"),
        (node(instance_uuid="mine"), "field 'instance_uuid' must be null or a UUID"),
        (node(maintenance="no"), "field 'maintenance' must be true or false"),
        (node(traits="CUSTOM_A"), "field 'traits' must be a list of strings"),
        (node(extra=[]), "field 'extra' must be an object"),
        (node(name=7), "field 'name' must be a string or null"),
        (node(inspection_finished_at=7), "field 'inspection_finished_at' must be a string or null"),
        (node(uuid="node-1"), "a node's field 'uuid' must be a UUID, got 'node-1'"),
        ([], "a node must be an object, got list"),
    ],
)
def test_a_node_that_is_not_what_the_api_promises_is_named(data: Any, problem: str) -> None:
    with pytest.raises(ProviderProtocolError) as raised:
        parse_node(data, "list the nodes", "rack")
    assert problem in str(raised.value) and str(raised.value).startswith("provider rack: list the nodes: ")


Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def stand_in() -> AsyncIterator[Callable[[Answer], Any]]:
    """Starts a stand-in for a broken Ironic answering every request with the handler given; yields its starter."""
    runners: list[web.AppRunner] = []

    async def start(answer: Answer, **changes: Any) -> IronicProvider:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        given = options(endpoint=f"http://127.0.0.1:{port}", timeout=2, **changes)
        instance = ProviderInstance("rack", "ironic", given)
        return from_settings(instance, Settings())

    yield start
    for runner in runners:
        await runner.cleanup()


def discovery(request: web.Request) -> web.Response:
    """Ironic's answer to version discovery, so the client gets as far as the call under test."""
    link = {"href": f"http://{request.host}/v1/", "rel": "self"}
    version = {"id": "v1", "links": [link], "status": "CURRENT", "min_version": "1.1", "version": "1.90"}
    return web.json_response({"name": "OpenStack Ironic API", "default_version": version, "versions": [version]})


def listing(nodes: Any) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path in ("/", "/v1", "/v1/"):
            return discovery(request)
        return web.Response(text=json.dumps(nodes), content_type="application/json")

    return answer


async def test_a_listing_with_a_bad_node_is_a_protocol_error_not_a_crash(stand_in) -> None:
    rack = await stand_in(
        listing({"nodes": [node(), node(uuid="1b0a3c1e-8a7e-4a5b-9c7d-6e5f4a3b2c1d", maintenance=1)]})
    )
    with pytest.raises(ProviderProtocolError, match="node 1b0a3c1e-8a7e-4a5b-9c7d-6e5f4a3b2c1d: field 'maintenance'"):
        await rack.list_machines()


async def test_a_listing_without_nodes_is_a_protocol_error(stand_in) -> None:
    rack = await stand_in(listing({"items": []}))
    with pytest.raises(ProviderProtocolError, match="the answer has no list 'nodes'"):
        await rack.list_machines()


@pytest.mark.parametrize(("status", "retryable"), [(500, True), (502, True), (503, True), (429, True), (418, False)])
async def test_an_error_status_is_retried_when_retrying_can_help(stand_in, status: int, retryable: bool) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path in ("/", "/v1", "/v1/"):
            return discovery(request)
        fault = json.dumps({"faultstring": "the conductor is away", "faultcode": "Server"})
        return web.json_response({"error_message": fault}, status=status)

    rack = await stand_in(answer)
    with pytest.raises(ProviderUnavailable if retryable else ProviderProtocolError) as raised:
        await rack.list_machines()
    assert f"HTTP {status}: the conductor is away" in str(raised.value)
    assert raised.value.retryable is retryable


async def test_an_answer_that_is_not_json_is_named(stand_in) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path in ("/", "/v1", "/v1/"):
            return discovery(request)
        return web.Response(text="<html>proxy login</html>", content_type="text/html")

    rack = await stand_in(answer)
    with pytest.raises(ProviderProtocolError, match="Ironic answered HTTP 200 with no JSON: '<html>proxy login"):
        await rack.list_machines()


async def test_an_endpoint_that_is_not_ironic_is_named(stand_in) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>welcome</html>", content_type="text/html")

    rack = await stand_in(answer)
    with pytest.raises(ProviderProtocolError, match="does not answer as Ironic's API does") as raised:
        await rack.list_machines()
    assert not raised.value.retryable


@pytest.mark.parametrize("status", [503, 502, 429])
async def test_an_ironic_failing_its_version_discovery_is_retried(stand_in, status: int) -> None:
    # A worker's first call asks the endpoint for its versions: an Ironic restarting behind its load balancer then
    # fails that, and is asked again, as it is for any call.
    async def answer(request: web.Request) -> web.StreamResponse:
        fault = json.dumps({"faultstring": "the API is restarting", "faultcode": "Server"})
        return web.json_response({"error_message": fault}, status=status)

    rack = await stand_in(answer)
    with pytest.raises(ProviderUnavailable) as raised:
        await rack.list_machines()
    assert f"answered HTTP {status}: the API is restarting" in str(raised.value) and raised.value.retryable


async def test_an_ironic_down_at_its_version_discovery_is_retried() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    rack = from_settings(ProviderInstance("rack", "ironic", options(endpoint=endpoint, timeout=2)), Settings())
    with pytest.raises(ProviderUnavailable, match=f"no answer from Ironic at {endpoint}") as raised:
        await rack.list_machines()
    assert raised.value.retryable


@pytest.mark.parametrize(
    ("status", "body", "problem"),
    [
        (
            200,
            {"plugin_data": {}},
            f"read the inspection inventory of node {NODE}: the answer has no object 'inventory'",
        ),
        (200, {"inventory": ["eno1"]}, "the answer has no object 'inventory'"),
        (406, {"error_message": "version not supported"}, "does not serve microversion 1.81"),
    ],
)
async def test_an_inventory_that_is_not_what_the_api_promises_is_named(
    stand_in, status: int, body: Any, problem: str
) -> None:
    ours = node(
        provision_state="active",
        instance_uuid=NODE,
        extra={"shepherd_provider": "rack", "shepherd_instance_uuid": NODE},
        inspection_finished_at="2025-01-01T00:00:00+00:00",
    )

    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path in ("/", "/v1", "/v1/"):
            return discovery(request)
        if request.path == f"/v1/nodes/{NODE}/inventory":
            return web.json_response(body, status=status)
        return web.json_response({"nodes": [ours]})

    rack = await stand_in(answer, **FROM_INSPECTION)
    with pytest.raises(ProviderProtocolError) as raised:
        await rack.list_machines()
    assert problem in str(raised.value) and not raised.value.retryable
