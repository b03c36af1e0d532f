"""Decommission end to end: through `shepherd decommission` and the Temporal CLI on the embedded stack, and the
simulator's release of a machine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.contracts import Decommissioned, MachineStage, machine_workflow_id
from providers import RetireAction
from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig
from tests.fleet_stack import FleetStack, fleet_stack
from tests.test_fleet import sim_admin
from tests.test_recovery import WATCH, _heartbeating, heartbeat_of, wait_for


async def test_the_simulator_releases_a_machine_once_and_its_slot_is_capacity_again(tmp_path):
    simulator = Simulator(SimulatorConfig(machines=2, state_dir=tmp_path / "sim", api_port=0))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    try:
        await provider.create_machine("node-0001", "key-1", simulator_key())
        released = await provider.retire_machine("node-0001")
        assert released.action is RetireAction.RELEASED
        assert not (tmp_path / "sim" / "machines" / "node-0001").exists(), "its disk is wiped"
        again = await provider.retire_machine("node-0001")
        assert again.action is RetireAction.UNTOUCHED and "released already" in again.detail
        listed = {m.provider_id: m for m in await provider.list_machines()}
        assert listed["node-0001"].status == "capacity" and listed["node-0001"].address is None
        state = await sim_admin(simulator.api_url, "/admin/state")
        assert state["machines"] == [] and state["creations"] == {"node-0001": 1}
    finally:
        await provider.close()
        await simulator.stop()


async def decommissioned(stack: FleetStack, provider_id: str) -> Decommissioned:
    """The result of the machine's workflow, once its decommission completed it."""
    handle = stack.client.get_workflow_handle(machine_workflow_id("sim", provider_id), result_type=Decommissioned)
    return await handle.result()


def simulator_key() -> str:
    import asyncssh

    return asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode()


async def test_decommission_through_the_cli_retires_the_machine_for_good(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli
):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, heartbeats=True, **WATCH) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002", "node-0003"], MachineStage.WATCHING)
        await wait_for(lambda: _heartbeating(bmdb, "node-0001"), what="heartbeats of node-0001")

        async def shepherd(*args: str) -> tuple[int, str, str]:
            return await shepherd_cli(stack.environment(bmdb_url), *args)

        with pytest.raises(SystemExit) as usage:
            await shepherd("decommission", "node-0001", "--reason", "  ")
        assert usage.value.code == 2
        code, out, err = await shepherd("decommission", "node-9999", "--reason", "gone")
        assert code == 1 and "no machine 'node-9999'" in err

        code, out, err = await shepherd("decommission", "node-0001", "--reason", "end of lease", "--by", "alice")
        assert code == 0, err
        assert out.startswith("machine-sim-node-0001: decommissioning (end of lease): its agent is stopped")
        result = await decommissioned(stack, "node-0001")
        assert (result.by, result.reason, result.provider_action) == ("alice (unverified)", "end of lease", "released")
        assert result.agent.startswith("stopped over SSH: stopped: removed the agent key")

        record = await heartbeat_of(stack, bmdb, "node-0001")
        assert record.retired_at is not None and record.agent_public_key is None
        assert record.retired_reason.startswith("asked by alice (unverified): end of lease; agent: stopped over SSH")
        kinds = [e.kind for e in await bmdb.list_events(record.machine_id)]
        assert kinds[:2] == ["decommissioned", "decommissioning"]
        assert "node-0001" not in stack.simulator.state.machines

        # Its slot is free capacity now, yet no pass adopts it or starts its workflow again.
        result_of_pass = await stack.run_pass()
        assert (result_of_pass.admitted, result_of_pass.workflows_started, result_of_pass.error) == ([], 0, None)
        assert (await sim_admin(stack, "/admin/state"))["creations"]["node-0001"] == 1
        description = await stack.machine("node-0001").describe()
        assert description.status is not None and description.status.name == "COMPLETED"

        code, out, err = await shepherd("decommission", "node-0001", "--reason", "again")
        assert code == 1 and "machine-sim-node-0001 was decommissioned at" in err and "retired for good" in err
        code, out, err = await shepherd("machines")
        assert code == 0 and "node-0001" not in out and "node-0002" in out
        code, out, err = await shepherd("machines", "--stage", "decommissioned")
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["node-0001"]
        code, out, err = await shepherd("status", "node-0001")
        assert code == 0, err
        assert "decommissioned" in out and "asked by alice (unverif" in out

        # The Temporal CLI sends the same update, and hears the same refusal for a request without a reason.
        temporal = [
            str(Path(sys.executable).parent / "temporal"),
            "workflow",
            "update",
            "execute",
            "--address",
            str(stack.settings.temporal_address),
            "--namespace",
            str(stack.settings.temporal_namespace),
            "--workflow-id",
            "machine-sim-node-0002",
            "--name",
            "decommission",
        ]
        refused = await asyncio.to_thread(
            subprocess.run, [*temporal, "--input", "{}"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0 and "say why the machine is decommissioned" in refused.stderr
        taken = await asyncio.to_thread(
            subprocess.run,
            [*temporal, "--input", '{"reason": "rack emptied", "by": "bob"}'],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode == 0, taken.stderr
        assert "decommissioning (rack emptied)" in taken.stdout
        result = await decommissioned(stack, "node-0002")
        assert result.by == "bob (unverified)"
        await stack.wait_for_stage(["node-0003"], MachineStage.WATCHING)

        # Another operator's maintenance is shown, who, since when and why, and overridden only with --force.
        code, out, err = await shepherd("maintenance", "node-0003", "--on", "--reason", "disk swap", "--by", "carol")
        assert code == 0, err
        code, out, err = await shepherd("decommission", "node-0003", "--reason", "end of lease", "--by", "dave")
        assert code == 1 and "machine-sim-node-0003: it is in maintenance, asked by carol (unverified) at 20" in err
        assert ": disk swap; decommission it anyway with --force" in err
        status = await stack.status("node-0003")
        assert status.decommission is None and status.maintenance is not None
        code, out, err = await shepherd("decommission", "node-0003", "--reason", "end of lease", "--force")
        assert code == 0 and out.startswith("machine-sim-node-0003: decommissioning (end of lease)"), err
        assert (await decommissioned(stack, "node-0003")).reason == "end of lease"
