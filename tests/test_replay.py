"""Recorded workflow histories replay against today's workflow code.

tests/histories/ holds histories of real runs: a machine whose first agent
start failed and was retried at an operator's retry_now, then forced into a
recovery; the same machine's run after it; a machine recovered for a lost
heartbeat, whose agent an operator then restarted without a reboot, and its run
after that; the same lost heartbeat recorded since BMDB confirms a silence as
the recovery begins, and again since that confirmation and the reboot's record
are local activities and the takeover after the reboot runs in the recovery's
own run, and again since one patch marker stands for all of a recovery's
changes; a fleet pass that admitted machines and one that signalled
a silent one; a machine an operator forced into a recovery, naming who asked,
and its next run, taken into maintenance and then decommissioned; the same for a machine
whose operators sent the typed requests (RecoveryRequest, MaintenanceRequest,
OperatorRequest) rather than the JSON typed by hand. A workflow change
that would break the workflows running in a fleet fails here, before it is
deployed.

`RECORD_HISTORIES=1 pytest tests/test_replay.py` records the ones
missing from a fresh run. Once a version is released its histories are kept as
they are: a change goes behind `workflow.patched`, and new histories are added
beside the old ones.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import (
    DECOMMISSION_UPDATE,
    FORCE_RECOVER_SIGNAL,
    RESTART_AGENT_UPDATE,
    RETRY_NOW_SIGNAL,
    SET_MAINTENANCE_UPDATE,
    FleetInput,
    MachineStage,
    MaintenanceRequest,
    OperatorRequest,
    RecoveryRequest,
)
from lifecycle.inputs import fleet_input
from tests.fleet_stack import FleetStack, fleet_stack
from tests.test_fleet import sim_admin
from tests.test_recovery import WATCH, wait_for
from workflows.fleet import FleetWorkflow
from workflows.machine import MachineWorkflow

HISTORIES = Path(__file__).parent / "histories"
RECORDED = [
    "machine-first-run",
    "machine-after-forced-recovery",
    "machine-heartbeat-lost",
    "fleet-pass-admits",
    "fleet-pass-signals-silent",
    "machine-forced-by-an-operator",
    "machine-decommissioned-in-maintenance",
    "machine-agent-restarted",
    "machine-after-agent-restart",
    # The same operator actions, sent as the typed requests of lifecycle.contracts.
    "machine-forced-by-a-typed-request",
    "machine-typed-maintenance-then-decommissioned",
    # A lost heartbeat whose silence BMDB confirmed at the recovery's start.
    "machine-heartbeat-lost-confirmed",
    # The same, its confirmation and the reboot's record local activities, the takeover after it in its own run.
    "machine-heartbeat-lost-taken-over-in-its-run",
    # The same, with one patch marker for all of the recovery's changes.
    "machine-heartbeat-lost-one-patch-marker",
]
# Not SHEPHERD_*: the settings read every such variable, and the shepherd commands other tests run would refuse it.
RECORDING = os.environ.get("RECORD_HISTORIES") == "1"


def replayer() -> Replayer:
    return Replayer(workflows=[MachineWorkflow, FleetWorkflow], data_converter=DATA_CONVERTER)


@pytest.mark.parametrize("name", RECORDED)
async def test_recorded_history_replays(name):
    path = HISTORIES / f"{name}.json"
    history = WorkflowHistory.from_json(name, path.read_text())
    await replayer().replay_workflow(history)


async def test_the_recorded_scenario_replays_fresh(tmp_path, temporal_client, bmdb_url, bmdb):
    """Runs what the recorded histories show, replays the new histories, and records them when asked."""
    # An hour's back-off, so the failed agent start is retried only at retry_now.
    settings: dict[str, Any] = {**WATCH, "agent_start_backoff_initial": 3600.0, "agent_start_backoff_maximum": 3600.0}
    async with fleet_stack(
        tmp_path, temporal_client, bmdb_url, machines=4, heartbeats=True, sim_boot_seconds=0.0, **settings
    ) as stack:
        await sim_admin(stack, "/admin/faults", {"ssh_refuse": ["node-0001"]})
        admitting = await stack.client.start_workflow(
            FleetWorkflow.run, stack_fleet_input(stack), id="fleet-admits", task_queue=stack.settings.task_queue
        )
        assert (await admitting.result()).admitted == ["node-0001", "node-0002", "node-0003", "node-0004"]
        await stack.wait_for_stage(["node-0002", "node-0003", "node-0004"], MachineStage.WATCHING)

        # node-0001: the first agent start is refused, the operator fixes SSH and says retry_now.
        await stack.wait_for_error("node-0001")
        await sim_admin(stack, "/admin/faults", {"ssh_refuse": []})
        first = stack.machine("node-0001")
        await first.signal(RETRY_NOW_SIGNAL, "SSH fixed")
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING, limit=30)
        first_run = (await first.describe()).run_id
        await first.signal(FORCE_RECOVER_SIGNAL, {"reason": "disk errors"})
        await wait_for(lambda: recovered(stack, "node-0001"), limit=30, what="forced recovery of node-0001")

        # node-0002: its agent dies, and a pass finds it silent.
        node2_run = (await stack.machine("node-0002").describe()).run_id
        assert (await sim_admin(stack, "/admin/machines/node-0002/kill-agent", {}))["killed"] >= 1
        await asyncio.sleep(WATCH["heartbeat_timeout"] + 1)
        signalling = await stack.client.start_workflow(
            FleetWorkflow.run, stack_fleet_input(stack), id="fleet-signals", task_queue=stack.settings.task_queue
        )
        assert (await signalling.result()).silent == ["node-0002"]
        await wait_for(lambda: recovered(stack, "node-0002"), limit=30, what="recovery of node-0002")

        # node-0002 again: dave restarts its agent, which is taken over again without a reboot.
        second = stack.machine("node-0002")
        restarted_run = (await second.describe()).run_id
        old_agent = (await stack.status("node-0002")).agent
        await second.execute_update(RESTART_AGENT_UPDATE, {"reason": "agent upgrade", "by": "dave"})

        async def new_agent() -> bool:
            status = await stack.status("node-0002")
            return status.stage is MachineStage.WATCHING and status.agent != old_agent

        await wait_for(new_agent, limit=30, what="the new agent of node-0002")

        # node-0003: alice forces a recovery; in the next run bob takes it into maintenance, carol decommissions it
        # (with force: bob's maintenance stands).
        third = stack.machine("node-0003")
        forced_run = (await third.describe()).run_id
        await third.signal(FORCE_RECOVER_SIGNAL, {"reason": "fan noise", "by": "alice"})
        await wait_for(lambda: recovered(stack, "node-0003"), limit=30, what="forced recovery of node-0003")
        await third.execute_update(SET_MAINTENANCE_UPDATE, {"on": True, "reason": "fans", "by": "bob"})
        await stack.wait_for_stage(["node-0003"], MachineStage.MAINTENANCE)
        await third.execute_update(DECOMMISSION_UPDATE, {"reason": "end of lease", "by": "carol", "force": True})
        await third.result()

        # node-0004: the same, in typed requests.
        fourth = stack.machine("node-0004")
        typed_run = (await fourth.describe()).run_id
        await fourth.signal(FORCE_RECOVER_SIGNAL, RecoveryRequest("fan noise", "alice"))
        await wait_for(lambda: recovered(stack, "node-0004"), limit=30, what="forced recovery of node-0004")
        await fourth.execute_update(SET_MAINTENANCE_UPDATE, MaintenanceRequest(on=True, reason="fans", by="bob"))
        await stack.wait_for_stage(["node-0004"], MachineStage.MAINTENANCE)
        await fourth.execute_update(DECOMMISSION_UPDATE, OperatorRequest("end of lease", "carol", force=True))
        await fourth.result()

        client = stack.client
        # The lost heartbeat's run, recorded under a name of its own by each version of the recovery it went through.
        heartbeat_lost = await client.get_workflow_handle("machine-sim-node-0002", run_id=node2_run).fetch_history()
        histories = {
            "machine-first-run": await client.get_workflow_handle(first.id, run_id=first_run).fetch_history(),
            "machine-after-forced-recovery": await stack.machine("node-0001").fetch_history(),
            "machine-heartbeat-lost": heartbeat_lost,
            "machine-heartbeat-lost-confirmed": heartbeat_lost,
            "machine-heartbeat-lost-taken-over-in-its-run": heartbeat_lost,
            "machine-heartbeat-lost-one-patch-marker": heartbeat_lost,
            "machine-agent-restarted": await client.get_workflow_handle(
                second.id, run_id=restarted_run
            ).fetch_history(),
            "machine-after-agent-restart": await second.fetch_history(),
            "fleet-pass-admits": await admitting.fetch_history(),
            "fleet-pass-signals-silent": await signalling.fetch_history(),
            "machine-forced-by-an-operator": await client.get_workflow_handle(
                third.id, run_id=forced_run
            ).fetch_history(),
            "machine-decommissioned-in-maintenance": await third.fetch_history(),
            "machine-forced-by-a-typed-request": await client.get_workflow_handle(
                fourth.id, run_id=typed_run
            ).fetch_history(),
            "machine-typed-maintenance-then-decommissioned": await fourth.fetch_history(),
        }
    assert sorted(histories) == sorted(RECORDED)
    for name, history in histories.items():
        await replayer().replay_workflow(history)
        recorded = HISTORIES / f"{name}.json"
        if RECORDING and not recorded.exists():
            HISTORIES.mkdir(exist_ok=True)
            recorded.write_text(history.to_json())


def stack_fleet_input(stack: FleetStack) -> FleetInput:
    return fleet_input(stack.settings, "sim")


async def recovered(stack: FleetStack, provider_id: str) -> bool:
    status = await stack.status(provider_id)
    return status.recovery_count == 1 and status.stage is MachineStage.WATCHING
