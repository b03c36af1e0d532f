"""The ironic provider against a real Ironic, standalone: capacity, claims, deploys, reboots and undeploys.

Nodes are fake-hardware nodes, which Ironic takes through its real state machine (a deploy, a rebuild and an
undeploy each take a second or two); a direct deploy of one waits for an agent that never calls back, so it fails as
a real deploy does. What Shepherd did is read back from Ironic's API, and the config drive from its database.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from providers import (
    Availability,
    CapacityConflict,
    MachineNotFound,
    MaintenanceHold,
    NotDoneYet,
    ProviderMachine,
    ProviderUnavailable,
    Reimager,
    RetireAction,
    Retired,
)
from providers.ironic import INSTANCE_MARK, OWNER_MARK, IronicProvider, from_settings, instance_uuid_for
from providers.ironic_api import IronicCredentialsRejected
from tests.ironic_fixtures import Ironic, ironic_fixture, running_ironic  # noqa: F401 (ironic_fixture)
from tests.sshd_fixtures import free_port

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHx0cHpEaW9uU2hlcGhlcmRUZXN0S2V5Rm9yQ2Q shepherd@test"
# On loopback, where nothing listens: a direct deploy that fetches it fails at once, and nothing leaves the host.
IMAGE = {"image_source": "http://127.0.0.1:9/os.qcow2", "image_checksum": "0" * 32}


def provider(ironic: Ironic, name: str = "rack", **options: Any) -> IronicProvider:
    """An ironic provider instance through the entry point's factory, as the worker opens it."""
    given = {"endpoint": ironic.url, "address_field": "extra/ssh_address", **IMAGE, **options}
    return from_settings(ProviderInstance(name, "ironic", given), Settings())


def resource_class() -> str:
    """A resource class of its own for a test, so its capacity is its nodes alone in the shared Ironic."""
    return f"test-{uuid.uuid4().hex[:12]}"


async def until(attempt: Callable[[], Awaitable[T]], done: Callable[[T], bool], tries: int = 100) -> T:
    """Call attempt, as the step's back-off would, until done says so; NotDoneYet counts as not yet."""
    for _ in range(tries):
        try:
            result = await attempt()
            if done(result):
                return result
        except NotDoneYet:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError("never done")


async def deployed(rack: IronicProvider, node_id: str, key: str) -> ProviderMachine:
    """The node, created for key and asked again until it is active with an address."""
    return await until(lambda: rack.create_machine(node_id, key, PUBLIC_KEY), lambda m: m.address is not None)


async def test_available_nodes_are_capacity_deployed_with_shepherds_key_and_then_ours(ironic):
    kind = resource_class()
    ports = [free_port() for _ in range(3)]
    nodes = [
        ironic.enroll(name=f"n{i}-{kind}", resource_class=kind, extra={"ssh_address": f"127.0.0.1:{port}"})
        for i, port in enumerate(ports)
    ]
    user_data = ironic.state / f"user-data-{kind}"
    user_data.write_text("#cloud-config\nhostname: from-shepherd\n")
    rack = provider(ironic, resource_class=kind, user_data_file=str(user_data))

    listed = {m.provider_id: m for m in await rack.list_machines()}
    assert {listed[n].availability for n in nodes} == {Availability.KNOWN_UNUSED}
    assert all(listed[n].address is None and listed[n].status == "available" for n in nodes)

    first = await rack.create_machine(nodes[0], "machine-rack-0", PUBLIC_KEY)
    assert (first.address, first.status) == (None, "deploying"), "a create starts the deploy and says so"
    machines = [await deployed(rack, node, f"machine-rack-{i}") for i, node in enumerate(nodes)]

    for i, (node_id, machine) in enumerate(zip(nodes, machines, strict=True)):
        node = ironic.node(node_id)
        assert node["provision_state"] == "active"
        assert node["instance_uuid"] == instance_uuid_for(f"machine-rack-{i}")
        assert node["extra"][OWNER_MARK] == "rack" and node["extra"][INSTANCE_MARK] == node["instance_uuid"]
        assert node["instance_info"]["image_source"] == IMAGE["image_source"]
        assert (machine.address, machine.ssh_port) == ("127.0.0.1", ports[i]), "the port in the field wins"
        drive = ironic.config_drive(node_id)
        assert PUBLIC_KEY.encode() in drive and b"hostname: from-shepherd" in drive
    listed = {m.provider_id: m for m in await rack.list_machines()}
    assert {listed[n].availability for n in nodes} == {Availability.KNOWN_USED}

    deploys = ironic.requests_logged(f"PUT /v1/nodes/{nodes[0]}/states/provision")
    again = await rack.create_machine(nodes[0], "machine-rack-0", PUBLIC_KEY)
    assert again == machines[0], "the same key finds the same machine"
    assert ironic.requests_logged(f"PUT /v1/nodes/{nodes[0]}/states/provision") == deploys, "and deploys nothing"
    await rack.close()


async def test_two_requests_for_one_node_get_it_once(ironic):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind, extra={"ssh_address": "127.0.0.1"})
    rack = provider(ironic, resource_class=kind)

    async def create(key: str) -> ProviderMachine:
        # As the activity's retry policy does: a node locked by the other claims is asked again.
        for _ in range(50):
            try:
                return await rack.create_machine(node_id, key, PUBLIC_KEY)
            except ProviderUnavailable as busy:
                assert "the node is busy" in str(busy)
                await asyncio.sleep(0.1)
        raise AssertionError("the node stayed locked")

    outcomes = await asyncio.gather(*(create(f"machine-rack-{i}") for i in range(4)), return_exceptions=True)
    won = [o for o in outcomes if isinstance(o, ProviderMachine)]
    assert len(won) == 1 and all(isinstance(o, CapacityConflict) for o in outcomes if o not in won), outcomes
    winner = outcomes.index(won[0])
    assert ironic.node(node_id)["instance_uuid"] == instance_uuid_for(f"machine-rack-{winner}")
    with pytest.raises(CapacityConflict, match="claimed by instance"):
        await rack.create_machine(node_id, "machine-rack-late", PUBLIC_KEY)
    await rack.close()


async def test_what_is_not_shepherds_or_free_is_left_alone_and_counted(tmp_path):
    with running_ironic(tmp_path) as ironic:
        gold = {"resource_class": "gold", "owner": "ops"}
        theirs = ironic.enroll(**gold, extra={"ssh_address": "127.0.0.1"})
        instance = ironic.deploy_as_someone_else(theirs)
        held = ironic.enroll(**gold)
        ironic.api("PUT", f"/nodes/{held}/maintenance", {"reason": "fan"})
        ironic.enroll(**gold, state="manageable")
        ironic.enroll(**gold, state="enroll")
        ironic.enroll(resource_class="silver", owner="ops")
        ironic.enroll(resource_class="gold", owner="tenant-b")
        untraited = ironic.enroll(**gold)
        free = ironic.enroll(**gold)
        ironic.api("PUT", f"/nodes/{free}/traits", {"traits": ["CUSTOM_SHEPHERD"]})
        rack = provider(ironic, resource_class="gold", owner="ops", traits=["CUSTOM_SHEPHERD"])

        machines = await rack.list_machines()
        assert [(m.provider_id, m.availability) for m in machines] == [(free, Availability.KNOWN_UNUSED)]
        assert rack.left_alone == {
            "deployed or claimed by someone else": 1,
            "in maintenance": 1,
            "manageable, not available": 1,
            "enroll, not available": 1,
            "another resource class": 1,
            "another owner": 1,
            "without the traits asked for": 1,
        }
        assert untraited not in {m.provider_id for m in machines}

        with pytest.raises(CapacityConflict, match=f"claimed by instance {instance}"):
            await rack.create_machine(theirs, "machine-rack-x", PUBLIC_KEY)
        with pytest.raises(CapacityConflict, match="not Shepherd's"):
            await rack.reboot_machine(theirs)
        with pytest.raises(MachineNotFound):
            await rack.get_machine(theirs)
        assert await rack.retire_machine(theirs) == Retired(
            RetireAction.UNTOUCHED, f"node {theirs} is not Shepherd's (any more): left as it is"
        )
        node = ironic.node(theirs)
        assert (node["provision_state"], node["instance_uuid"]) == ("active", instance), "never touched"
        assert ironic.requests_logged(f"PUT /v1/nodes/{theirs}/states/power") == 0
        await rack.close()


async def test_a_reboot_goes_through_ironic_and_is_read_back(ironic):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind, extra={"ssh_address": "127.0.0.1"})
    rack = provider(ironic, resource_class=kind)
    await deployed(rack, node_id, "machine-rack-reboot")
    rebooted = await rack.reboot_machine(node_id)
    assert rebooted.went_down and "power on" in rebooted.detail
    assert ironic.requests_logged(f"PUT /v1/nodes/{node_id}/states/power") == 1
    await rack.close()


async def test_a_reimage_rebuilds_the_node_with_shepherds_key_again(ironic):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind, extra={"ssh_address": "127.0.0.1"})
    rack = provider(ironic, resource_class=kind)
    assert isinstance(rack, Reimager)
    await deployed(rack, node_id, "machine-rack-reimage")
    asked = ironic.requests_logged(f"PUT /v1/nodes/{node_id}/states/provision")
    new_key = PUBLIC_KEY.replace("shepherd@test", "shepherd@rotated")

    reimaged = await rack.reimage_machine(node_id, new_key)
    assert "Ironic rebuilds" in reimaged.detail
    assert ironic.requests_logged(f"PUT /v1/nodes/{node_id}/states/provision") == asked + 1
    node = ironic.wait_for(node_id, "active")
    assert node["instance_uuid"] == instance_uuid_for("machine-rack-reimage"), "the same instance, rebuilt"
    assert new_key.encode() in ironic.config_drive(node_id)

    ironic.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "deleted"})
    ironic.wait_for(node_id, "available")
    with pytest.raises(CapacityConflict, match="not Shepherd's: not rebuilt"):
        await rack.reimage_machine(node_id, new_key)
    await rack.close()


async def test_a_decommission_undeploys_and_the_node_is_available_again(ironic):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind, extra={"ssh_address": "127.0.0.1"})
    rack = provider(ironic, resource_class=kind)
    await deployed(rack, node_id, "machine-rack-retire")

    with pytest.raises(NotDoneYet, match="undeploying"):
        await rack.retire_machine(node_id)
    assert [m.availability for m in await rack.list_machines() if m.provider_id == node_id] == [
        Availability.KNOWN_USED
    ], "Shepherd's until its disks are clean"
    retired = await until(lambda: rack.retire_machine(node_id), lambda r: True)
    assert retired.action is RetireAction.RELEASED and "cleaned and available again" in retired.detail
    node = ironic.node(node_id)
    assert node["provision_state"] == "available" and node["instance_uuid"] is None
    assert OWNER_MARK not in node["extra"] and INSTANCE_MARK not in node["extra"]
    again = await rack.retire_machine(node_id)
    assert again.action is RetireAction.UNTOUCHED, "a second retire finds nothing of Shepherd's to undo"
    await rack.close()


async def test_a_failed_deploy_carries_ironics_error_and_is_deployed_again(ironic):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind, deploy_interface="direct", extra={"ssh_address": "127.0.0.1"})
    rack = provider(ironic, resource_class=kind)
    asked = ironic.requests_logged(f"PUT /v1/nodes/{node_id}/states/provision")
    await rack.create_machine(node_id, "machine-rack-fails", PUBLIC_KEY)
    failed = ironic.wait_for(node_id, "deploy failed")
    assert failed["last_error"]

    with pytest.raises(NotDoneYet) as raised:
        await rack.create_machine(node_id, "machine-rack-fails", PUBLIC_KEY)
    assert f"node {node_id}: deploy failed: " in str(raised.value) and "deploying it again" in str(raised.value)
    assert failed["last_error"][:40] in str(raised.value)
    assert ironic.node(node_id)["provision_state"] in ("deploying", "wait call-back", "deploy failed")
    assert ironic.requests_logged(f"PUT /v1/nodes/{node_id}/states/provision") == asked + 2
    await rack.close()


async def test_a_node_in_ironics_maintenance_waits_for_an_operator(ironic):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind, extra={"ssh_address": "127.0.0.1"})
    rack = provider(ironic, resource_class=kind)
    await deployed(rack, node_id, "machine-rack-held")
    ironic.api("PUT", f"/nodes/{node_id}/maintenance", {"reason": "disk replacement"})
    with pytest.raises(MaintenanceHold, match="disk replacement") as raised:
        await rack.create_machine(node_id, "machine-rack-held", PUBLIC_KEY)
    assert not raised.value.retryable
    await rack.close()


async def test_ironic_down_is_retried_and_the_create_resumes_on_the_same_node(tmp_path):
    port = free_port()
    with running_ironic(tmp_path, port=port) as ironic:
        node_id = ironic.enroll(resource_class="gold", extra={"ssh_address": "127.0.0.1"})
        other = ironic.enroll(resource_class="gold", extra={"ssh_address": "127.0.0.1"})
        rack = provider(ironic, resource_class="gold", timeout=2)
        await rack.create_machine(node_id, "machine-rack-resumed", PUBLIC_KEY)
    with pytest.raises(ProviderUnavailable, match="no answer from Ironic") as raised:
        await rack.create_machine(node_id, "machine-rack-resumed", PUBLIC_KEY)
    assert raised.value.retryable
    with running_ironic(tmp_path, port=port) as ironic:
        machine = await deployed(rack, node_id, "machine-rack-resumed")
        assert machine.address == "127.0.0.1"
        nodes = ironic.api("GET", "/nodes?fields=uuid,instance_uuid")["nodes"]
        claimed = [(n["uuid"], n["instance_uuid"]) for n in nodes if n["instance_uuid"]]
        assert claimed == [(node_id, instance_uuid_for("machine-rack-resumed"))], "one node claimed, once"
        assert ironic.node(other)["provision_state"] == "available"
        await rack.close()


async def test_http_basic_auth_and_wrong_credentials_in_one_line(tmp_path):
    password = uuid.uuid4().hex
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    for path, text in ((right, password), (wrong, "not-" + password)):
        path.write_text(text + "\n")
        path.chmod(0o600)
    with running_ironic(tmp_path / "ironic", basic_auth=("shepherd", password)) as ironic:
        ironic.enroll(resource_class="gold")
        good = provider(ironic, auth="http_basic", username="shepherd", password_file=str(right))
        assert len(await good.list_machines()) == 1
        bad = provider(ironic, auth="http_basic", username="shepherd", password_file=str(wrong))
        with pytest.raises(IronicCredentialsRejected) as raised:
            await bad.list_machines()
        message = str(raised.value)
        assert "\n" not in message and "refused the credentials (HTTP 401)" in message and password not in message
        assert not raised.value.retryable
        anonymous = provider(ironic)
        with pytest.raises(IronicCredentialsRejected):
            await anonymous.list_machines()
        for rack in (good, bad, anonymous):
            await rack.close()


async def test_an_id_of_the_wrong_form_is_refused_without_asking_ironic(ironic):
    rack = provider(ironic)
    assert not rack.is_valid_id("node-0001") and not rack.is_valid_id(str(uuid.uuid4()).upper())
    before = ironic.requests_logged("GET /v1/nodes/")
    for call in (rack.get_machine, rack.reboot_machine):
        with pytest.raises(MachineNotFound):
            await call("../../v1/drivers")
    with pytest.raises(MachineNotFound):
        await rack.create_machine("../../v1/drivers", "machine-rack-bad", PUBLIC_KEY)
    assert ironic.requests_logged("GET /v1/nodes/") == before
    await rack.close()


def test_a_password_file_others_can_read_is_refused(tmp_path, ironic):
    loose = tmp_path / "password"
    loose.write_text("secret\n")
    loose.chmod(0o644)
    with pytest.raises(SettingsError, match="readable by others"):
        provider(ironic, auth="http_basic", username="shepherd", password_file=str(loose))


async def test_provider_check_shows_what_shepherd_sees_and_changes_nothing(tmp_path, shepherd_cli):
    with running_ironic(tmp_path / "ironic") as ironic:
        ours = ironic.enroll(resource_class="gold", name="web-1", extra={"ssh_address": "127.0.0.1:2201"})
        free = ironic.enroll(resource_class="gold", name="web-2")
        ironic.enroll(resource_class="gold", state="manageable")
        held = ironic.enroll(resource_class="gold")
        ironic.api("PUT", f"/nodes/{held}/maintenance", {"reason": "fan"})
        rack = provider(ironic, resource_class="gold")
        await deployed(rack, ours, "machine-rack-web-1")
        await rack.close()
        config = tmp_path / "shepherd.toml"
        config.write_text(
            f"""
[[providers]]
name = "rack"
type = "ironic"
endpoint = "{ironic.url}"
resource_class = "gold"
image_source = "{IMAGE["image_source"]}"
address_field = "extra/ssh_address"
"""
        )
        before = ironic.api("GET", "/nodes?fields=uuid,provision_state,instance_uuid,maintenance")["nodes"]

        code, out, err = await shepherd_cli({}, "provider", "check", "rack", "--config", str(config))
        assert code == 0 and "ERROR" not in err and "WARNING" not in err, err
        assert out.splitlines() == [
            "provider rack (type ironic): nothing was changed",
            "Shepherd's machines: 1",
            f"  {ours}  active  127.0.0.1:2201",
            f"free capacity: 1: {free}",
            "left alone: 2",
            "  1  in maintenance",
            "  1  manageable, not available",
        ]
        code, out, err = await shepherd_cli({}, "provider", "check", "rack", "--config", str(config), "--json")
        assert code == 0 and json.loads(out)["left_alone"] == {"manageable, not available": 1, "in maintenance": 1}
        assert ironic.api("GET", "/nodes?fields=uuid,provision_state,instance_uuid,maintenance")["nodes"] == before

        code, out, err = await shepherd_cli({}, "provider", "check", "rack9", "--config", str(config))
        assert code == 1 and err == "shepherd provider: no provider instance 'rack9'; configured: rack\n"


async def test_a_clouds_yaml_cloud_names_ironic_and_its_auth(ironic, tmp_path):
    kind = resource_class()
    node_id = ironic.enroll(resource_class=kind)
    clouds = tmp_path / "clouds.yaml"
    clouds.write_text(
        f"clouds:\n  lab:\n    auth_type: none\n    auth:\n      endpoint: {ironic.url}\n"
        f"    baremetal_endpoint_override: {ironic.url}\n"
    )
    options = {**IMAGE, "cloud": "lab", "clouds_file": str(clouds), "address_field": "extra/ssh_address"}
    # An instance name of its own: the shared Ironic holds nodes other tests' "rack" claimed, whatever their class.
    rack = from_settings(ProviderInstance("lab", "ironic", {**options, "resource_class": kind}), Settings())
    assert [m.provider_id for m in await rack.list_machines()] == [node_id]
    await rack.close()
    with pytest.raises(SettingsError, match="cloud 'elsewhere'"):
        from_settings(ProviderInstance("rack", "ironic", {**options, "cloud": "elsewhere"}), Settings())
