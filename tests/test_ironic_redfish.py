"""A redfish node through a real Ironic, its BMC sushy-emulator: deployed by Shepherd with Ironic's ramdisk deploy
over Redfish virtual media, taken over, and rebooted through Ironic when its agent falls silent, the reboot reaching
the emulator as Redfish power actions.

The ramdisk deploy writes no disk and waits for no agent in a ramdisk: Ironic has the BMC insert the ISO the node
boots (instance_info's boot_iso) and the config drive it built with Shepherd's key, sets the boot device and powers
the system on. Nothing boots here, so the machine behind the node is a bare machine (sshd chrooted into busybox and
glibc), found through the node's extra/ssh_address. A fake-hardware node of the same provider, with a bare machine of
its own, goes on heartbeating meanwhile, so that the watchdog sees one silent machine among healthy ones, not a quiet
heartbeat path.
"""

from __future__ import annotations

import asyncio
import shutil

import asyncssh
import pytest
import requests

from foundation.provider_instances import ProviderInstance
from lifecycle.contracts import MachineStage
from tests.bmc_fixtures import Bmc, fake_system, power_state, reset_requests, running_bmc
from tests.ironic_fixtures import Ironic, ironic_fixture  # noqa: F401 (ironic_fixture)
from tests.processes import kill_processes_mentioning
from tests.sshd_fixtures import BareMachine, running_bare_machine
from tests.test_ironic_provider import resource_class
from tests.test_recovery import WATCH
from tests.test_static_machines import lab_stack

RACK = "rack"
SYSTEM = "vmedia-01"


def enroll_redfish_node(ironic: Ironic, bmc: Bmc, machine: BareMachine, kind: str) -> str:
    """An available redfish node of the emulator's system, deployed with the ramdisk deploy over virtual media."""
    return ironic.enroll(
        driver="redfish",
        deploy_interface="ramdisk",
        boot_interface="redfish-virtual-media",
        resource_class=kind,
        name=f"{kind}-redfish",
        driver_info={
            "redfish_address": bmc.url,
            "redfish_system_id": bmc.systems[SYSTEM],
            "redfish_username": bmc.username,
            "redfish_password": bmc.password,
        },
        extra={"ssh_address": f"127.0.0.1:{machine.sshd.port}"},
    )


def virtual_media(bmc: Bmc, system: str, device: str) -> dict[str, object]:
    """The emulator's virtual media device of the system (Cd, Floppy), read past the code under test."""
    answer = requests.get(
        f"{bmc.url}{bmc.systems[system]}/VirtualMedia/{device}", auth=(bmc.username, bmc.password), timeout=10
    )
    answer.raise_for_status()
    return dict(answer.json())


async def test_a_silent_agent_on_a_redfish_node_is_rebooted_through_ironic_and_its_bmc_sees_the_power_cycle(
    tmp_path, temporal_client, bmdb_url, bmdb, ironic
):
    if shutil.which("genisoimage") is None:
        pytest.skip("Ironic builds a config drive for virtual media with genisoimage (Debian package genisoimage)")
    assert ironic.files is not None
    kind = resource_class()
    # The ISO a ramdisk deploy boots; no machine boots it here, so its bytes only travel to the emulator.
    iso = f"/{kind}.iso"
    (ironic.files.root / iso.lstrip("/")).write_bytes(b"\0" * 4096)
    key = asyncssh.generate_private_key("ssh-ed25519")
    for directory in ("bmc", "silent", "healthy"):
        (tmp_path / directory).mkdir()
    with (
        # Off, as hardware waiting for its deploy.
        running_bmc(tmp_path / "bmc", [fake_system(SYSTEM, "Off")]) as bmc,
        running_bare_machine(tmp_path / "silent", key) as silent,
        running_bare_machine(tmp_path / "healthy", key) as healthy,
    ):
        node, neighbour = await asyncio.gather(
            asyncio.to_thread(enroll_redfish_node, ironic, bmc, silent, kind),
            asyncio.to_thread(
                ironic.enroll, resource_class=kind, extra={"ssh_address": f"127.0.0.1:{healthy.sshd.port}"}
            ),
        )
        options = {
            "endpoint": ironic.url,
            "resource_class": kind,
            # "http": the BMC downloads the ISO from where it is, rather than from Ironic's copy of it.
            "instance_info": {"boot_iso": ironic.files.url + iso, "ramdisk_image_download_source": "http"},
            "address_field": "extra/ssh_address",
            "ssh_user": silent.sshd.username,
        }
        rack = ProviderInstance(RACK, "ironic", options)
        async with lab_stack(
            tmp_path, temporal_client, bmdb_url, silent.sshd, {}, "/root/agent", others=(rack,), **WATCH
        ) as stack:
            result = await stack.run_pass(RACK)
            assert sorted(result.admitted) == sorted([node, neighbour])
            for machine in (node, neighbour):
                await stack.wait_for(RACK, machine, lambda s: s.stage is MachineStage.WATCHING, "WATCHING")
                record = await stack.after_first_heartbeat(bmdb, machine)
                assert record.agent_heartbeat_at is not None, f"no heartbeat from the machine behind {machine}"

            # Ironic deployed the node over virtual media: the BMC fetched the ISO, and the config drive with
            # Shepherd's key that Ironic published on its HTTP server, and powered the system on.
            assert ironic.node(node)["provision_state"] == "active"
            cd = virtual_media(bmc, SYSTEM, "Cd")
            assert (cd["Image"], cd["Inserted"]) == (ironic.files.url + iso, True)
            assert ironic.files.downloads(iso) == 1
            assert ironic.files.downloads(f"/redfish/configdrive-{node}") == 1
            public_key = key.export_public_key("openssh").decode().split()[1].encode()
            assert public_key in (ironic.files.root / "redfish" / f"configdrive-{node}").read_bytes()
            assert power_state(bmc, SYSTEM) == "On"
            resets = reset_requests(bmc, SYSTEM)

            # The agent on the node's machine dies; its heartbeats stop, the neighbour's go on; the next pass finds
            # it silent.
            assert kill_processes_mentioning(f" 127.0.0.1 {silent.sshd.port}\0") >= 1
            await asyncio.sleep(WATCH["heartbeat_timeout"] + 1)
            result = await stack.run_pass(RACK)
            assert result.silent == [node]

            status = await stack.wait_for(
                RACK,
                node,
                lambda s: s.recovery_count == 1 and s.stage is MachineStage.WATCHING,
                "rebooted and WATCHING again",
            )
            assert (status.last_recovery_reason or "").startswith("heartbeat lost: last heartbeat at")
            # Shepherd asked Ironic for the reboot, and Ironic's redfish power interface sent the BMC a power-off
            # and a power-on; the neighbour was not rebooted.
            assert ironic.requests_logged(f"PUT /v1/nodes/{node}/states/power") == 1
            assert ironic.requests_logged(f"Successfully set node {node} power state to power on by rebooting") == 1
            assert reset_requests(bmc, SYSTEM) == resets + 2, "a power-off, then a power-on"
            assert power_state(bmc, SYSTEM) == "On"
            assert ironic.requests_logged(f"PUT /v1/nodes/{neighbour}/states/power") == 0
            assert (await stack.status(RACK, neighbour)).recovery_count == 0

            [record] = await bmdb.machines_with_provider_id(node)
            story = [event.kind for event in reversed(await bmdb.list_events(record.machine_id))]
            assert story[-3:] == ["heartbeat_lost", "rebooted", "agent_started"], story
