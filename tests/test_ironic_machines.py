"""Real machines through a real Ironic: the embedded stack deploys an available node and takes the machine behind
it over, through OpenSSH's sshd, to WATCHING.

fake-hardware nodes go through Ironic's real state machine without hardware; the machine behind a node is sshd on
loopback, which Shepherd finds through the node's extra/ssh_address, as an operator would configure it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import asyncssh

from foundation.provider_instances import ProviderInstance
from lifecycle.contracts import Decommissioned, MachineStage
from tests.ironic_fixtures import running_ironic
from tests.sshd_fixtures import running_sshd, sshd_fixture, write_private_key  # noqa: F401 (sshd_fixture)
from tests.test_static_machines import lab_stack


def test_dev_deploys_an_ironic_node_and_takes_its_machine_over(tmp_path, sshd):
    key = tmp_path / "state" / "ssh_key"
    key.parent.mkdir()
    write_private_key(key, sshd.client_key)
    (tmp_path / "machine").mkdir()
    env = {**os.environ, "SHEPHERD_AGENT_TARGET_PATH": str(tmp_path / "machine" / "agent")}
    with running_ironic(tmp_path / "ironic") as ironic:
        node = ironic.enroll(resource_class="gold", name="web-1", extra={"ssh_address": f"127.0.0.1:{sshd.port}"})
        ironic.enroll(resource_class="silver", name="not-ours")
        providers = tmp_path / "providers.toml"
        providers.write_text(
            f"""
[[providers]]
name = "rack1"
type = "ironic"
endpoint = "{ironic.url}"
resource_class = "gold"
image_source = "http://127.0.0.1:9/os.qcow2"
address_field = "extra/ssh_address"
ssh_user = "{sshd.username}"
"""
        )
        dev = [sys.executable, "-m", "shepherd", "dev", "--state-dir", str(tmp_path / "state")]
        flags = ["--providers", str(providers), "--machines", "1", "--until-ready", "--timeout", "3m"]
        result = subprocess.run([*dev, *flags], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "all 1 machines are WATCHING" in result.stdout and "simulator" not in result.stdout
        deployed = ironic.node(node)
        assert deployed["provision_state"] == "active" and deployed["extra"]["shepherd_provider"] == "rack1"
        assert sshd.client_key.export_public_key("openssh").decode().split()[1].encode() in ironic.config_drive(node)

        providers.write_text(providers.read_text().replace('address_field = "extra/ssh_address"\n', ""))
        broken = subprocess.run([*dev, *flags], capture_output=True, text=True, env=env, timeout=120)
        assert broken.returncode == 1 and "say where SSH reaches a deployed node" in broken.stderr
        refused = subprocess.run([*dev, *flags, "--chaos"], capture_output=True, text=True, env=env, timeout=60)
        assert refused.returncode == 2 and "does not go with real machines" in refused.stderr


async def test_a_node_is_deployed_taken_over_rebooted_and_decommissioned_through_ironic(
    tmp_path, temporal_client, bmdb_url, bmdb, sshd
):
    with running_ironic(tmp_path / "ironic") as ironic:
        node = ironic.enroll(resource_class="gold", name="web-1", extra={"ssh_address": f"127.0.0.1:{sshd.port}"})
        theirs = ironic.enroll(resource_class="gold", name="theirs", extra={"ssh_address": "127.0.0.1"})
        instance = ironic.deploy_as_someone_else(theirs)
        options = {
            "endpoint": ironic.url,
            "resource_class": "gold",
            "image_source": "http://127.0.0.1:9/os.qcow2",
            "address_field": "extra/ssh_address",
            "ssh_user": sshd.username,
        }
        rack = ProviderInstance("rack", "ironic", options)
        async with lab_stack(tmp_path, temporal_client, bmdb_url, sshd, {}, others=(rack,)) as stack:
            result = await stack.run_pass("rack")
            assert result.admitted == [node] and result.plan is not None
            assert result.plan.left_alone == {"deployed or claimed by someone else": 1}
            status = await stack.wait_for("rack", node, lambda s: s.stage is MachineStage.WATCHING, "WATCHING")
            assert status.address == "127.0.0.1" and ironic.node(node)["provision_state"] == "active"

            # A reboot goes through Ironic's power interface and is read back; the machine is taken over again.
            powered = ironic.requests_logged(f"PUT /v1/nodes/{node}/states/power")
            status = await stack.recovered("rack", node, "disk errors")
            assert ironic.requests_logged(f"PUT /v1/nodes/{node}/states/power") == powered + 1

            # A decommission undeploys the node, and Ironic has it available again, without Shepherd's mark.
            handle = stack.machine("rack", node)
            await handle.execute_update("decommission", {"reason": "end of lease", "by": "alice"})
            done = await stack.client.get_workflow_handle(handle.id, result_type=Decommissioned).result()
            assert done.provider_action == "released" and "cleaned and available again" in done.provider_detail
            released = ironic.node(node)
            assert released["provision_state"] == "available" and released["instance_uuid"] is None
            assert "shepherd_provider" not in released["extra"]
            untouched = ironic.node(theirs)
            assert (untouched["provision_state"], untouched["instance_uuid"]) == ("active", instance)
            [record] = await bmdb.machines_with_provider_id(node)
            kinds = [e.kind for e in await bmdb.list_events(record.machine_id)]
            assert "rebooted" in kinds and "decommissioned" in kinds


async def test_a_reimage_rebuilds_the_node_and_the_new_host_key_is_pinned_by_shepherd(
    tmp_path, temporal_client, bmdb_url, bmdb
):
    machine = tmp_path / "machine-sshd"
    machine.mkdir()
    with running_sshd(machine) as sshd, running_ironic(tmp_path / "ironic") as ironic:
        node = ironic.enroll(resource_class="gold", name="web-1", extra={"ssh_address": f"127.0.0.1:{sshd.port}"})
        options = {
            "endpoint": ironic.url,
            "resource_class": "gold",
            "image_source": "http://127.0.0.1:9/os.qcow2",
            "address_field": "extra/ssh_address",
            "ssh_user": sshd.username,
        }
        rack = ProviderInstance("rack", "ironic", options)
        async with lab_stack(tmp_path, temporal_client, bmdb_url, sshd, {}, others=(rack,)) as stack:
            await stack.run_pass("rack")
            await stack.wait_for("rack", node, lambda s: s.stage is MachineStage.WATCHING, "WATCHING")
            [record] = await bmdb.machines_with_provider_id(node)
            assert record.ssh_host_key == sshd.host_key

            # The hardware's part, played by the test: once Ironic rebuilds the node, the machine behind it comes
            # up with a new OS, and so with a new host key.
            new_key = asyncssh.generate_private_key("ssh-ed25519")

            asked = ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision")

            def new_os() -> None:
                # Told by Ironic's log rather than the node's state: a rebuild of fake hardware may be over before
                # a poll of the state sees it under way.
                deadline = time.monotonic() + 90
                while ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision") == asked:
                    if time.monotonic() > deadline:
                        raise AssertionError("Ironic was never asked to rebuild the node")
                    time.sleep(0.05)
                # The machine goes down for its new OS: sshd stopped answers no SSH version line, longer than the
                # boot wait's 2 s between tries, and comes back reading a new host key, as a new boot would.
                sshd_pid = int((machine / "sshd.pid").read_text())
                os.kill(sshd_pid, signal.SIGSTOP)
                (machine / "host_key").unlink()
                write_private_key(machine / "host_key", new_key)
                time.sleep(5)
                os.kill(sshd_pid, signal.SIGCONT)
                os.kill(sshd_pid, signal.SIGHUP)

            rebuilt = asyncio.create_task(asyncio.to_thread(new_os))
            handle = stack.machine("rack", node)
            await handle.signal("force_recover", {"reason": "corrupt root fs", "by": "alice", "reimage": True})
            status = await stack.wait_for(
                "rack", node, lambda s: s.recovery_count == 1 and s.stage is MachineStage.WATCHING, "reimaged"
            )
            await rebuilt
            assert status.last_recovery_reason == "forced reimage: corrupt root fs (by alice)"
            assert ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision") == 4, "provide, deploy, rebuild"
            [record] = await bmdb.machines_with_provider_id(node)
            assert record.ssh_host_key == new_key.export_public_key("openssh").decode().strip()
            kinds = [e.kind for e in await bmdb.list_events(record.machine_id)]
            assert "reimaged" in kinds and "reimage_forced" in kinds


async def test_a_failed_deploy_shows_ironics_error_in_the_machines_status_and_is_tried_again(
    tmp_path, temporal_client, bmdb_url, sshd
):
    with running_ironic(tmp_path / "ironic") as ironic:
        # A direct deploy waits for the ramdisk's agent, which fake hardware never runs: Ironic fails it after its
        # callback timeout, with its own words in last_error.
        node = ironic.enroll(resource_class="gold", deploy_interface="direct", extra={"ssh_address": "127.0.0.1"})
        options = {
            "endpoint": ironic.url,
            "resource_class": "gold",
            "image_source": "http://127.0.0.1:9/os.qcow2",
            "image_checksum": "0" * 32,
            "address_field": "extra/ssh_address",
        }
        rack = ProviderInstance("rack", "ironic", options)
        async with lab_stack(tmp_path, temporal_client, bmdb_url, sshd, {}, others=(rack,)) as stack:
            assert (await stack.run_pass("rack")).admitted == [node]
            status = await stack.wait_for(
                "rack", node, lambda s: "deploy failed" in (s.last_error or ""), "showing the failed deploy"
            )
            assert status.stage is MachineStage.PROVISIONING
            # Ironic's own words: the image's address refused the connection. Not read back from the node, whose
            # last_error is gone once Shepherd has asked for the next deploy.
            assert f"node {node}: deploy failed: Failed to prepare to deploy" in (status.last_error or "")
            assert "deploying it again" in (status.last_error or "")
            # Tried again on the provisioning back-off: Ironic is asked for a second deploy, and it fails again.
            await stack.wait_for("rack", node, lambda s: s.attempts >= 2, "a second attempt")
            assert ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision") >= 4, "manage, provide, 2 deploys"
