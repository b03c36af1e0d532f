"""restart_agent: a new agent on a healthy machine without a reboot, through the CLI on the embedded stack, and on a
static machine behind OpenSSH's sshd with a Redfish BMC.

Real parts: the simulator's SSH servers and processes, sshd, sushy-emulator, BMDB, Temporal, the reference agent and
its heartbeats.
"""

from __future__ import annotations

import json

import pytest
from temporalio.client import WorkflowUpdateFailedError

from agent.reference import LOG_FILE
from bmdb.store import MachineRecord
from foundation.metrics import meter_of, metrics_runtime
from foundation.procfs import processes_mentioning, processes_with_variable
from lifecycle.contracts import RESTART_AGENT_UPDATE, MachineStage
from lifecycle.takeover import key_fingerprint
from simulator import Faults
from tests.bmc_fixtures import power_state, reset_requests
from tests.fleet_stack import FleetStack, fleet_stack, shepherd_environment
from tests.ports import free_port
from tests.processes import kill_processes_mentioning
from tests.sshd_fixtures import sshd_fixture  # noqa: F401 (a pytest fixture, used as `sshd`)
from tests.test_fleet import sim_admin
from tests.test_observability import scrape, total
from tests.test_recovery import WATCH, _stage_is, wait_for
from tests.test_static_machines import (
    LAB,
    bmc_lines,
    inventory_entry,
    lab_bmc_fixture,  # noqa: F401 (a pytest fixture, used as `lab_bmc`)
    lab_stack,
    secret_file,
)

RESTARTED = "agent restart asked (agent 2.1): a new agent takes over without a reboot, the old one stops"


def agent_processes(stack: FleetStack, provider_id: str) -> set[int]:
    """The processes running on the simulated machine: its agent, once the takeover's SSH session is over."""
    return set(processes_with_variable(stack.simulator.machines[provider_id].process_marker))


async def heartbeating(bmdb, provider_id: str, other_than: bytes | None = None) -> MachineRecord | None:
    """The machine's record once BMDB accepted a heartbeat of an agent whose key is not other_than."""
    [record] = await bmdb.machines_with_provider_id(provider_id)
    if record.agent_heartbeat_at and record.agent_public_key and record.agent_public_key != other_than:
        return record
    return None


async def agent_key(bmdb, provider_id: str) -> bytes | None:
    [record] = await bmdb.machines_with_provider_id(provider_id)
    return record.agent_public_key


async def test_a_watching_machine_gets_a_new_agent_without_a_reboot(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli, monkeypatch
):
    sim_port = free_port()
    sim_runtime = metrics_runtime(f"127.0.0.1:{sim_port}", "simulator")
    async with fleet_stack(
        tmp_path, temporal_client, bmdb_url, machines=3, heartbeats=True, sim_meter=meter_of(sim_runtime), **WATCH
    ) as stack:
        machines = ["node-0001", "node-0002", "node-0003"]
        await stack.run_pass()
        await stack.wait_for_stage(machines, MachineStage.WATCHING)
        before = {m: await wait_for(lambda m=m: heartbeating(bmdb, m), what=f"heartbeats of {m}") for m in machines}
        first = before["node-0001"]
        old_agents = agent_processes(stack, "node-0001")
        assert old_agents, "the first agent runs on the machine"
        old_run = (await stack.machine("node-0001").describe()).run_id

        async def shepherd(*args: str) -> tuple[int, str, str]:
            return await shepherd_cli(stack.environment(bmdb_url), *args)

        code, out, err = await shepherd("restart-agent", "node-0001", "--reason", "agent 2.1", "--by", "alice")
        assert (code, err) == (0, "")
        assert out == f"machine-sim-node-0001: {RESTARTED}\n"

        # A new takeover: a new key in BMDB that heartbeats, and the workflow watches the new agent.
        after = await wait_for(
            lambda: heartbeating(bmdb, "node-0001", other_than=first.agent_public_key), what="the new agent's beat"
        )
        status = await stack.status("node-0001")
        assert status.stage is MachineStage.WATCHING and status.agent is not None
        assert (await stack.machine("node-0001").describe()).run_id != old_run
        # The old agent saw the new one's key and stopped; nothing killed it.
        await wait_for(lambda: _gone(stack, "node-0001", old_agents), what="the old agent's exit")
        assert agent_processes(stack, "node-0001"), "the new agent runs"
        agent_log = (stack.simulator.machines["node-0001"].root_fs / "root" / LOG_FILE).read_text()
        assert "a newer agent has taken over this machine" in agent_log
        # Not rebooted: no recovery counted, no reboot asked of the provider, none in BMDB.
        assert (status.recovery_count, status.last_recovery_reason, status.recent_recoveries) == (0, None, [])
        story = [e.kind for e in reversed(await bmdb.list_events(first.machine_id))]
        assert story == [
            "admitted",
            "provided",
            "host_key_pinned",
            "agent_started",
            "agent_restart_asked",
            "agent_started",
        ]
        assert total(await scrape(sim_port), "shepherd_sim_reboots_total") == 0
        assert stack.simulator.machines["node-0001"].status == "active"
        # Who asked and why: the status, and the event log of operator actions.
        assert [(a.action, a.by, a.reason) for a in status.actions] == [
            ("restart_agent", "alice (unverified)", "agent 2.1")
        ]
        code, out, err = await shepherd("events", "node-0001", "--actions", "--json")
        assert code == 0, err
        assert [(e["kind"], e["detail"]) for e in json.loads(out)["events"]] == [
            ("agent_restart_asked", "by alice (unverified): agent 2.1")
        ]
        # The other machines were left alone.
        for other in ("node-0002", "node-0003"):
            assert await agent_key(bmdb, other) == before[other].agent_public_key

        # Many at once: each a new agent, one after the other at the rate given, none rebooted.
        async def listed() -> bool:
            code, out, _ = await shepherd(
                "restart-agent", "--where", 'MachineStage = "WATCHING"', "--reason", "x", "--dry-run"
            )
            return code == 0 and out.startswith("3 machine(s)")

        await wait_for(listed, what="three WATCHING in visibility")
        where = 'ProviderId IN ("node-0002", "node-0003")'
        code, out, err = await shepherd(
            "restart-agent", "--where", where, "--reason", "CA rotation", "--by", "bob", "--rate", "2", "--yes"
        )
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == f"2 machine(s) match --where {where!r}:"
        assert sorted(line.split(" ", 1)[1] for line in lines[3:5]) == [
            f"machine-sim-{m}: {RESTARTED.replace('agent 2.1', 'CA rotation')}" for m in ("node-0002", "node-0003")
        ]
        assert lines[-1] == "done: 2 of 2 succeeded"
        for other in ("node-0002", "node-0003"):
            renewed = await wait_for(
                lambda m=other: heartbeating(bmdb, m, other_than=before[m].agent_public_key),
                what=f"the new agent of {other}",
            )
            kinds = [e.kind for e in await bmdb.list_events(renewed.machine_id)]
            assert kinds[:2] == ["agent_started", "agent_restart_asked"] and "rebooted" not in kinds
            assert (await stack.status(other)).recovery_count == 0
        assert total(await scrape(sim_port), "shepherd_sim_reboots_total") == 0
        assert await agent_key(bmdb, "node-0001") == after.agent_public_key


async def _gone(stack: FleetStack, provider_id: str, pids: set[int]) -> bool:
    return not pids & agent_processes(stack, provider_id)


async def test_a_static_machine_behind_sshd_gets_a_new_agent_without_a_reboot(
    tmp_path, temporal_client, bmdb_url, bmdb, sshd, lab_bmc, shepherd_cli
):
    password = secret_file(tmp_path / "bmc-password", lab_bmc.password)
    inventory = inventory_entry("lab-01", sshd, bmc_lines(lab_bmc, lab_bmc.systems["lab-01"], password))
    # The machine is this host, seen through sshd: its agents are the processes running the uploaded executable.
    agent_path = str(tmp_path / "machine" / "agent")
    async with lab_stack(tmp_path, temporal_client, bmdb_url, sshd, {LAB: inventory}) as stack:
        try:
            await stack.run_pass(LAB)
            await stack.wait_for(LAB, "lab-01", lambda s: s.stage is MachineStage.WATCHING, "WATCHING")
            first = await wait_for(lambda: heartbeating(bmdb, "lab-01"), what="the first agent's heartbeats")
            first_agents = set(processes_mentioning(agent_path))
            assert first_agents, "the first agent runs on the machine"
            resets_before = reset_requests(lab_bmc, "lab-01")

            code, out, err = await shepherd_cli(
                shepherd_environment(stack.settings, bmdb_url),
                "restart-agent",
                "lab-01",
                "--reason",
                "agent 2.1",
                "--by",
                "alice",
            )
            assert (code, err) == (0, "")
            assert out == f"machine-{LAB}-lab-01: {RESTARTED}\n"

            # The new agent's key is in BMDB and its heartbeats are accepted; the workflow watches it.
            second = await wait_for(
                lambda: heartbeating(bmdb, "lab-01", other_than=first.agent_public_key), what="the new agent's beat"
            )
            status = await stack.wait_for(LAB, "lab-01", lambda s: s.stage is MachineStage.WATCHING, "WATCHING")
            assert status.agent is not None and second.agent_public_key is not None
            assert status.agent.key_fingerprint == key_fingerprint(second.agent_public_key)
            # The first agent saw the new key beside the executable and stopped; nothing killed it.
            await wait_for(lambda: _none_left(first_agents, agent_path), what="the first agent's exit", limit=30)
            assert set(processes_mentioning(agent_path)) - first_agents, "the new agent runs"
            agent_log = (tmp_path / "machine" / LOG_FILE).read_text()
            assert "stopped: a newer agent has taken over this machine" in agent_log
            # Not rebooted: the BMC was sent no power action, no recovery was counted, none is in BMDB.
            assert reset_requests(lab_bmc, "lab-01") == resets_before == 0
            assert power_state(lab_bmc, "lab-01") == "On"
            assert (status.recovery_count, status.last_recovery_reason, status.recent_recoveries) == (0, None, [])
            assert [(a.action, a.by, a.reason) for a in status.actions] == [
                ("restart_agent", "alice (unverified)", "agent 2.1")
            ]
            story = [e.kind for e in reversed(await bmdb.list_events(first.machine_id))]
            assert story[-3:] == ["agent_started", "agent_restart_asked", "agent_started"], story
            assert "rebooted" not in story
        finally:
            # The new agent detached from its SSH session and would go on calling a heartbeat server now gone.
            kill_processes_mentioning(agent_path)


async def _none_left(pids: set[int], agent_path: str) -> bool:
    return not pids & set(processes_mentioning(agent_path))


async def test_restart_agent_is_refused_where_no_takeover_may_run_and_needs_none_while_one_is_under_way(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli
):
    machines = ["node-0001", "node-0002", "node-0003", "node-0004"]
    async with fleet_stack(
        tmp_path,
        temporal_client,
        bmdb_url,
        machines=4,
        heartbeats=True,
        recovery_budget=1,
        # The quarantine at the budget's end, as with a provider that cannot reimage.
        reimage_before_quarantine=False,
        sim_faults=Faults(ssh_refuse=["node-0003"]),
        **WATCH,
    ) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002", "node-0004"], MachineStage.WATCHING)

        async def shepherd(*args: str) -> tuple[int, str, str]:
            return await shepherd_cli(stack.environment(bmdb_url), *args)

        async def refused(provider_id: str) -> str:
            code, out, err = await shepherd("restart-agent", provider_id, "--reason", "agent 2.1", "--by", "alice")
            assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
            assert err.startswith(f"shepherd restart-agent: machine-sim-{provider_id}: ")
            return err

        # A takeover under way (its SSH refused, so it keeps trying) starts a new agent anyway: nothing to add.
        await stack.wait_for_error("node-0003")
        code, out, err = await shepherd("restart-agent", "node-0003", "--reason", "agent 2.1", "--by", "alice")
        assert (code, err) == (0, "")
        assert out == (
            "machine-sim-node-0003: it is AGENT_STARTING: the agent its takeover starts is new already; "
            "nothing more to do\n"
        )
        await sim_admin(stack, "/admin/faults", {"ssh_refuse": []})
        await stack.wait_for_stage(["node-0003"], MachineStage.WATCHING, limit=30)
        [third] = await bmdb.machines_with_provider_id("node-0003")
        kinds = [e.kind for e in await bmdb.list_events(third.machine_id)]
        assert kinds.count("agent_started") == 1 and "agent_restart_asked" in kinds

        # In maintenance: nothing takes it over until it ends.
        code, out, err = await shepherd("maintenance", "node-0002", "--on", "--reason", "DIMM", "--by", "bob")
        assert code == 0, err
        err = await refused("node-0002")
        assert "it is in maintenance, asked by bob (unverified) at " in err and ": DIMM; " in err
        assert "shepherd maintenance --off" in err

        # Quarantined: held for an operator, whose release reboots it.
        for count, stage in ((1, MachineStage.WATCHING), (2, MachineStage.QUARANTINED)):
            await wait_for(lambda: heartbeating(bmdb, "node-0001"), what=f"heartbeats of node-0001 ({count})")
            assert (await sim_admin(stack, "/admin/machines/node-0001/kill-agent", {}))["killed"] >= 1
            await wait_for(lambda: _found_silent(stack), what=f"node-0001 found silent ({count})")
            await wait_for(lambda s=stage: _stage_is(stack, "node-0001", s, 1), what=f"node-0001 {stage}")
        err = await refused("node-0001")
        assert "it is QUARANTINED, held for an operator: `shepherd release` it once mended" in err

        # Being decommissioned: the provider does not retire it yet, so it stays DECOMMISSIONING.
        await sim_admin(stack, "/admin/faults", {"api_error_rate": 1.0})
        code, out, err = await shepherd("decommission", "node-0004", "--reason", "end of lease", "--by", "carol")
        assert code == 0, err
        await stack.wait_for_stage(["node-0004"], MachineStage.DECOMMISSIONING)
        err = await refused("node-0004")
        assert "it is being decommissioned, asked by carol (unverified) at " in err and err.rstrip().endswith(
            "end of lease"
        )

        # Without a reason, from the Temporal CLI or a script: refused, naming what to give.
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await stack.machine("node-0003").execute_update(RESTART_AGENT_UPDATE, {"by": "dave"})
        assert 'say why the agent is restarted: {"reason": "...", "by": "..."}' in str(caught.value.cause)

        # Nothing refused was recorded, and nothing was taken over because of it.
        for provider_id in ("node-0001", "node-0002", "node-0004"):
            status = await stack.status(provider_id)
            assert all(a.action != "restart_agent" for a in status.actions), provider_id
        [first] = await bmdb.machines_with_provider_id("node-0001")
        assert "agent_restart_asked" not in [e.kind for e in await bmdb.list_events(first.machine_id)]
        for provider_id in machines:
            await stack.machine(provider_id).terminate("test over")


async def _found_silent(stack: FleetStack) -> bool:
    # The heartbeat timeout is short; a pass before it ends finds nothing yet.
    return (await stack.run_pass()).silent == ["node-0001"]
