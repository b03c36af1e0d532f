"""The ensure step of a fleet pass: it counts the running machine workflows, and lists them only when it must."""

from __future__ import annotations

import asyncio
import logging
import uuid

import asyncssh
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.deps import ActivityDeps
from activities.fleet import FULL_LISTING_EVERY, FleetActivities
from activities.workflow_start import start_machine_workflow
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.ssh_identity import public_key_openssh
from lifecycle.contracts import EnsureWorkflowsInput, EnsureWorkflowsResult, machine_workflow_id, running_machines_of

PROVIDER = "rack"
# No worker polls it: the machine workflows started here wait, running, as WATCHING machines do.
IDLE = Settings(task_queue="ensure-idle")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def running_count_reaches(client: Client, count: int) -> None:
    """Visibility lags behind starts and terminations a moment; a pass would see the same."""
    for _ in range(200):
        if (await client.count_workflows(running_machines_of(PROVIDER))).count == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"visibility never showed {count} running {PROVIDER} machine workflows")


async def managed_and_running(client: Client, bmdb: BMDB, provider_ids: list[str]) -> None:
    for provider_id in provider_ids:
        machine_id, _ = await bmdb.admit_machine(PROVIDER, provider_id)
        assert await start_machine_workflow(client, IDLE, PROVIDER, provider_id, str(machine_id))


def fleet_activities(client: Client, bmdb: BMDB, clock: Clock) -> FleetActivities:
    key = asyncssh.generate_private_key("ssh-ed25519")
    deps = ActivityDeps(
        settings=IDLE, bmdb=bmdb, providers={}, client=client, ssh_key=key, ssh_public_key=public_key_openssh(key)
    )
    return FleetActivities(deps, clock=clock)


async def ensure(fleet: FleetActivities) -> EnsureWorkflowsResult:
    return await ActivityEnvironment().run(fleet.ensure_machine_workflows, EnsureWorkflowsInput(provider=PROVIDER))


async def test_a_pass_lists_the_running_workflows_only_when_their_count_shows_one_missing(temporal_client, bmdb):
    await managed_and_running(temporal_client, bmdb, ["node-1", "node-2", "node-3"])
    await running_count_reaches(temporal_client, 3)
    clock = Clock()
    fleet = fleet_activities(temporal_client, bmdb, clock)

    # A worker's first pass lists them all: it has never looked.
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=3, started=[], listed=True)
    clock.now += 60
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=3, started=[], listed=False)

    # An operator terminates one machine's workflow; its agent may well keep heartbeating.
    await temporal_client.get_workflow_handle(machine_workflow_id(PROVIDER, "node-2")).terminate("by hand")
    await running_count_reaches(temporal_client, 2)
    clock.now += 60
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=3, started=["node-2"], listed=True)
    description = await temporal_client.get_workflow_handle(machine_workflow_id(PROVIDER, "node-2")).describe()
    assert description.status is not None and description.status.name == "RUNNING"

    await running_count_reaches(temporal_client, 3)
    clock.now += 60
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=3, started=[], listed=False)


async def test_a_stray_workflow_hiding_a_missing_one_is_found_by_the_full_listing(temporal_client, bmdb, caplog):
    await managed_and_running(temporal_client, bmdb, ["node-1", "node-2"])
    # A workflow of a machine BMDB does not manage (a BMDB restored from an older backup, say).
    assert await start_machine_workflow(temporal_client, IDLE, PROVIDER, "ghost", str(uuid.uuid4()))
    await running_count_reaches(temporal_client, 3)
    clock = Clock()
    fleet = fleet_activities(temporal_client, bmdb, clock)
    with caplog.at_level(logging.WARNING, logger="activities.fleet"):
        assert await ensure(fleet) == EnsureWorkflowsResult(machines=2, started=[], listed=True)
    assert "1 running rack machine workflow(s) of machines BMDB does not manage: machine-rack-ghost" in caplog.text

    await temporal_client.get_workflow_handle(machine_workflow_id(PROVIDER, "node-2")).terminate("by hand")
    await running_count_reaches(temporal_client, 2)
    # Two machines, two running workflows: the count cannot tell that the wrong two run.
    clock.now += FULL_LISTING_EVERY - 1
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=2, started=[], listed=False)
    clock.now += 1
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=2, started=["node-2"], listed=True)


async def test_a_decommissioned_machine_is_neither_counted_nor_given_a_workflow(temporal_client, bmdb, caplog):
    await managed_and_running(temporal_client, bmdb, ["node-1", "node-2"])
    await running_count_reaches(temporal_client, 2)
    retired = next(m for m in await bmdb.list_provided(PROVIDER) if m.provider_id == "node-2")
    assert await bmdb.retire(retired.machine_id, "test")
    clock = Clock()
    fleet = fleet_activities(temporal_client, bmdb, clock)
    # Its workflow still runs a moment after the retirement, as a decommission's last step does: no stray.
    with caplog.at_level(logging.WARNING, logger="activities.fleet"):
        assert await ensure(fleet) == EnsureWorkflowsResult(machines=1, started=[], listed=True)
    assert "does not manage" not in caplog.text
    await temporal_client.get_workflow_handle(machine_workflow_id(PROVIDER, "node-2")).terminate("decommissioned")
    await running_count_reaches(temporal_client, 1)
    clock.now += 60
    assert await ensure(fleet) == EnsureWorkflowsResult(machines=1, started=[], listed=False)
