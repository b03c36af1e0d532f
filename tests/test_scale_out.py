"""Two workers on one task queue, one Temporal, one BMDB: every machine is handled once."""

from __future__ import annotations

from collections import Counter

from temporalio.client import Client

from activities.deps import open_activity_deps
from lifecycle.contracts import MachineStage
from processes.worker import serving
from tests.fleet_stack import fleet_stack
from tests.test_fleet import nodes, sim_admin


async def test_two_workers_bring_a_fleet_up_handling_each_machine_once(tmp_path, temporal_client, bmdb_url, bmdb):
    machines = 12
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=machines) as stack:
        # A second worker process in all but name: its own client, BMDB pool, provider client and SSH sessions.
        second_client = await Client.connect(
            temporal_client.service_client.config.target_host,
            namespace=temporal_client.namespace,
            identity="second-worker",
        )
        second_deps = await open_activity_deps(stack.settings, second_client, bmdb_url)
        try:
            async with serving(second_client, second_deps):
                result = await stack.run_pass()
                assert result.admitted == nodes(machines)
                await stack.wait_for_stage(nodes(machines), MachineStage.WATCHING, limit=120)
        finally:
            await second_deps.close()

        state = await sim_admin(stack, "/admin/state")
        assert state["creations"] == {node: 1 for node in nodes(machines)}
        records = await bmdb.list_machines()
        assert sorted(r.provider_id for r in records) == nodes(machines)
        for record in records:
            kinds = Counter(e.kind for e in await bmdb.list_events(record.machine_id))
            assert kinds == {"admitted": 1, "provided": 1, "agent_started": 1}, (record.provider_id, kinds)
        # Both workers took part.
        histories = [await stack.machine(node).fetch_history() for node in nodes(machines)]
        identities = {
            event.activity_task_started_event_attributes.identity
            for history in histories
            for event in history.events
            if event.HasField("activity_task_started_event_attributes")
        }
        assert len(identities) == 2, identities
