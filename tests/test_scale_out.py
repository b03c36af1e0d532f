"""Two workers on one task queue, one Temporal, one BMDB: every machine is handled once; what slows a worker."""

from __future__ import annotations

import importlib
import importlib.util
import py_compile
import sys
from collections import Counter

import asyncssh
from temporalio.client import Client

from activities.deps import ActivityDeps, open_activity_deps
from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import FORCE_RECOVER_SIGNAL, MachineStage
from processes.worker import build_workers, serving, uncompiled_modules
from tests.fleet_stack import fleet_stack
from tests.test_fleet import nodes, sim_admin
from tests.test_recovery import wait_for


async def test_two_workers_bring_a_fleet_up_handling_each_machine_once(tmp_path, temporal_client, bmdb_url, bmdb):
    machines = 12
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=machines) as stack:
        # A second worker process in all but name: its own client, BMDB pool, provider client and SSH sessions.
        second_client = await Client.connect(
            temporal_client.service_client.config.target_host,
            namespace=temporal_client.namespace,
            identity="second-worker",
            data_converter=DATA_CONVERTER,
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
            expected = {"admitted": 1, "provided": 1, "host_key_pinned": 1, "agent_started": 1}
            assert kinds == expected, (record.provider_id, kinds)
        # Both workers took part.
        histories = [await stack.machine(node).fetch_history() for node in nodes(machines)]
        identities = {
            event.activity_task_started_event_attributes.identity
            for history in histories
            for event in history.events
            if event.HasField("activity_task_started_event_attributes")
        }
        assert len(identities) == 2, identities


def test_a_workflow_module_without_bytecode_is_named_and_one_with_it_is_not(tmp_path, monkeypatch):
    # The sandbox imports a workflow's module for every run: without bytecode, each run compiles it.
    source = tmp_path / "some_workflows.py"
    source.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    module = importlib.import_module("some_workflows")
    try:
        assert uncompiled_modules([module]) == [str(source)]
        py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)))
        assert uncompiled_modules([module]) == []
    finally:
        sys.modules.pop("some_workflows", None)


async def test_the_workflow_cache_of_a_worker_is_its_setting(temporal_client, bmdb):
    key = asyncssh.generate_private_key("ssh-ed25519")
    settings = Settings(max_cached_workflows=7)
    deps = ActivityDeps(
        settings=settings, bmdb=bmdb, providers={}, client=temporal_client, ssh_key=key, ssh_public_key="unused"
    )
    (workflow_worker,) = [w for w in build_workers(temporal_client, deps) if w.config().get("workflows")]
    assert workflow_worker.config().get("max_cached_workflows") == 7


async def test_machines_evicted_from_a_small_workflow_cache_still_recover(tmp_path, temporal_client, bmdb_url):
    # A fleet larger than the cache: each signal to an evicted machine replays its history first.
    provider_ids = nodes(3)
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, max_cached_workflows=2) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(provider_ids, MachineStage.WATCHING)
        for provider_id in provider_ids:
            await stack.machine(provider_id).signal(FORCE_RECOVER_SIGNAL, {"reason": f"check {provider_id}"})

        async def recovered() -> bool:
            statuses = [await stack.status(provider_id) for provider_id in provider_ids]
            return all(s.recovery_count == 1 and s.stage is MachineStage.WATCHING for s in statuses)

        await wait_for(recovered, limit=60, what="a recovery of every machine")
        for provider_id in provider_ids:
            assert (await stack.status(provider_id)).last_recovery_reason == f"forced: check {provider_id}"
