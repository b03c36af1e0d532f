"""The fleet coming up end to end: FleetWorkflow, MachineWorkflows, simulator, BMDB, SSH."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import platform
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from temporalio.client import WorkflowFailureError
from temporalio.worker import Replayer

from activities.fleet import each_at_most
from activities.workflow_start import start_machine_workflow
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import (
    MACHINE_ID,
    MACHINE_STAGE,
    PROVIDER,
    PROVIDER_ID,
    MachineStage,
    fleet_schedule_id,
)
from lifecycle.inputs import fleet_input
from operations.client import OperatorClient
from proto import takeover_pb2
from shepherd.commands.dev_stack.stack_settings import settings_environment
from shepherd.commands.fleet import schedule_line
from shepherd.commands.machines import age, print_machines
from simulator import Faults
from tests.elf_files import AARCH64, elf
from tests.fleet_stack import fleet_stack
from workflows.fleet import FleetWorkflow
from workflows.machine import MachineWorkflow


def nodes(count: int) -> list[str]:
    return [f"node-{n:04d}" for n in range(1, count + 1)]


async def sim_admin(stack_or_url: Any, path: str, payload: dict[str, Any] | None = None) -> Any:
    url = stack_or_url if isinstance(stack_or_url, str) else stack_or_url.simulator.api_url
    async with aiohttp.ClientSession() as session:
        if payload is None:
            async with session.get(url + path) as response:
                response.raise_for_status()
                return await response.json()
        async with session.post(url + path, json=payload) as response:
            response.raise_for_status()
            return await response.json()


async def test_fleet_comes_up_and_a_second_pass_changes_nothing(tmp_path, temporal_client, bmdb_url, bmdb):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=4) as stack:
        result = await stack.run_pass()
        assert result.admitted == nodes(4)
        await stack.wait_for_stage(nodes(4), MachineStage.WATCHING)

        records = await bmdb.list_machines()
        assert [r.provider_id for r in records] == nodes(4)
        for record in records:
            assert record.status == "provided"
            assert record.agent_public_key is not None and len(record.agent_public_key) == 32
            assert record.ssh_host_key and record.ssh_host_key.startswith("ssh-ed25519 ")
            status = await stack.status(record.provider_id)
            assert status.machine_id == str(record.machine_id)
            assert status.agent is not None and status.agent.key_fingerprint.startswith("SHA256:")
            kinds = [e.kind for e in await bmdb.list_events(record.machine_id)]
            assert kinds == ["agent_started", "host_key_pinned", "provided", "admitted"]

        again = await stack.run_pass()
        assert again.admitted == [] and again.workflows_started == 0
        assert again.plan is not None and again.plan.note == "no free capacity"

        # Search attributes the UI (and we) can filter on, a summary and current details to read.
        description = await stack.machine("node-0001").describe()
        record = records[0]
        assert description.typed_search_attributes.get(MACHINE_STAGE) == "WATCHING"
        assert description.typed_search_attributes.get(PROVIDER) == "sim"
        assert description.typed_search_attributes.get(PROVIDER_ID) == "node-0001"
        assert description.typed_search_attributes.get(MACHINE_ID) == str(record.machine_id)
        found = [e.id async for e in temporal_client.list_workflows('ProviderId = "node-0003"')]
        assert found == ["machine-sim-node-0003"]
        assert await description.static_summary() == "node-0001 at provider sim"
        metadata = await stack.machine("node-0001").query("__temporal_workflow_metadata")
        details = metadata.current_details
        assert "**node-0001** at provider sim, address 127.0.0.1" in details and "**WATCHING** since" in details

        # Workflow code is deterministic: the histories just made replay cleanly.
        replayer = Replayer(workflows=[MachineWorkflow, FleetWorkflow], data_converter=DATA_CONVERTER)
        for provider_id in nodes(4):
            await replayer.replay_workflow(await stack.machine(provider_id).fetch_history())

        # `shepherd machines` shows each machine with its stage.
        output = io.StringIO()
        async with OperatorClient(stack.settings, database_url=bmdb_url) as operators:
            assert await print_machines(operators, out=output) == 0
        lines = output.getvalue().splitlines()
        assert lines[0].split()[:2] == ["PROVIDER", "ID"] and len(lines) == 5
        assert all("WATCHING" in line and "127.0.0.1:" in line for line in lines[1:])
        assert max(len(line) for line in lines) <= 80


async def test_a_pass_admits_chunk_after_chunk_up_to_max_machines(tmp_path, temporal_client, bmdb_url, bmdb):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=6, max_machines=5, chunk_size=2) as stack:
        pass_id = f"{fleet_schedule_id('sim')}-{uuid.uuid4().hex[:8]}"
        handle = await temporal_client.start_workflow(
            FleetWorkflow.run, fleet_input(stack.settings, "sim"), id=pass_id, task_queue=stack.settings.task_queue
        )
        first = await handle.result()
        # Two whole chunks, then the last one the limit leaves: one pass, not three reconcile intervals.
        assert first.admitted == nodes(5)
        assert first.plan is not None and first.plan.to_create == ["node-0005"]
        plans = [
            event.activity_task_scheduled_event_attributes.activity_type.name
            async for event in handle.fetch_history_events()
            if event.HasField("activity_task_scheduled_event_attributes")
        ].count("plan_reconcile_pass")
        assert plans == 3
        second = await stack.run_pass()
        assert second.admitted == []
        assert second.plan is not None and "limit of 5" in second.plan.note
        await stack.wait_for_stage(nodes(5), MachineStage.WATCHING)
        assert len(await bmdb.list_provided("sim")) == 5
        replayer = Replayer(workflows=[FleetWorkflow], data_converter=DATA_CONVERTER)
        await replayer.replay_workflow(await handle.fetch_history())


async def test_disagreement_stops_the_pass_and_names_the_machine(tmp_path, temporal_client, bmdb_url, bmdb):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3) as stack:
        # Someone else takes a machine from the provider behind Shepherd's back.
        provider = stack.deps.provider("sim")
        await provider.create_machine("node-0002", "someone-else", stack.deps.ssh_public_key)
        with pytest.raises(WorkflowFailureError) as caught:
            await stack.run_pass()
        message = str(caught.value.cause)
        assert "disagree" in message and "node-0002" in message
        assert await bmdb.list_provided("sim") == []
        fleet_events = await bmdb.list_events(None)
        assert fleet_events[0].kind == "reconcile_refused" and "node-0002" in fleet_events[0].detail
        assert (await sim_admin(stack, "/admin/state"))["creations"] == {"node-0002": 1}


async def test_a_bmdb_machine_without_workflow_gets_one(tmp_path, temporal_client, bmdb_url, bmdb):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=2, max_machines=1) as stack:
        # Admitted, then the worker died before starting the workflow.
        await bmdb.admit_machine("sim", "node-0002")
        result = await stack.run_pass()
        assert result.admitted == [] and result.workflows_started == 1
        await stack.wait_for_stage(["node-0002"], MachineStage.WATCHING)


async def test_agent_error_reaches_status_and_events_and_is_retried(tmp_path, temporal_client, bmdb_url, bmdb):
    failing_agent = tmp_path / "failing-agent"
    reply = takeover_pb2.TakeoverResponse(error=takeover_pb2.TakeoverError(message="disk on fire"))
    encoded = base64.b64encode(reply.SerializeToString()).decode()
    failing_agent.write_text(f"#!/bin/sh\ncat > /dev/null\nprintf '%s' '{encoded}' | base64 -d\n")
    failing_agent.chmod(0o755)
    async with fleet_stack(
        tmp_path, temporal_client, bmdb_url, machines=1, agent_executable_path=failing_agent
    ) as stack:
        await stack.run_pass()
        status = await stack.wait_for_error("node-0001", attempts=2)
        assert status.stage is MachineStage.AGENT_STARTING
        assert status.attempts >= 2
        assert status.last_error is not None and "disk on fire" in status.last_error
        assert status.last_error.startswith("AGENT_ERROR")
        record = (await bmdb.list_machines())[0]
        failures = [e for e in await bmdb.list_events(record.machine_id) if e.kind == "agent_start_failed"]
        assert failures and "disk on fire" in failures[0].detail
        assert record.agent_started_at is None


async def test_a_machine_no_agent_runs_on_waits_for_an_operator_not_for_the_next_back_off(
    tmp_path, temporal_client, bmdb_url, bmdb
):
    foreign = tmp_path / "agent-aarch64"
    foreign.write_bytes(elf(AARCH64))
    async with fleet_stack(
        tmp_path,
        temporal_client,
        bmdb_url,
        machines=1,
        agent_executable_path=foreign,
        agent_start_backoff_maximum=3600.0,
    ) as stack:
        await stack.run_pass()
        status = await stack.wait_for_error("node-0001")
        assert status.stage is MachineStage.AGENT_STARTING
        assert status.last_error is not None and status.last_error.startswith("MACHINE_UNSUPPORTED: ")
        assert status.last_error.endswith("the agent executable is built for aarch64")
        assert f"the machine is {platform.machine()} with glibc " in status.last_error
        # Not the first back-off (0.5 s) but the longest: no retry soon changes what the machine is.
        assert status.next_attempt_at is not None
        wait = datetime.fromisoformat(status.next_attempt_at) - datetime.now(UTC)
        assert wait > timedelta(minutes=50), wait
        record = (await bmdb.list_machines())[0]
        failures = [e for e in await bmdb.list_events(record.machine_id) if e.kind == "agent_start_failed"]
        assert len(failures) == 1 and "built for aarch64" in failures[0].detail
        # An operator who gave the workers an agent for it asks for the retry at once.
        await stack.machine("node-0001").signal("retry_now", {"reason": "aarch64 agent added", "by": "alice"})
        await stack.wait_for_error("node-0001", attempts=2)


async def test_ssh_refused_is_retried_until_the_machine_answers(tmp_path, temporal_client, bmdb_url):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1) as stack:
        await sim_admin(stack, "/admin/faults", {"ssh_refuse": ["*"]})
        await stack.run_pass()
        status = await stack.wait_for_error("node-0001")
        assert status.stage is MachineStage.AGENT_STARTING
        assert status.last_error is not None and "CONNECT_REFUSED" in status.last_error
        await sim_admin(stack, "/admin/faults", {"ssh_refuse": []})
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        pytest.param("api_error_rate", "ProviderUnavailable: provider sim: create machine node-0001", id="outage"),
        pytest.param("api_malformed_rate", "ProviderProtocolError: provider sim: create machine", id="malformed"),
    ],
)
async def test_provider_faults_are_reported_and_retried(tmp_path, temporal_client, bmdb_url, bmdb, fault, error):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1) as stack:
        machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
        await sim_admin(stack, "/admin/faults", {fault: 1.0})
        await start_machine_workflow(stack.client, stack.settings, "sim", "node-0001", str(machine_id))
        status = await stack.wait_for_error("node-0001", attempts=2)
        assert status.stage is MachineStage.PROVISIONING
        assert status.last_error is not None and status.last_error.startswith(error)
        await sim_admin(stack, "/admin/faults", {fault: 0.0})
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        assert (await sim_admin(stack, "/admin/state"))["creations"] == {"node-0001": 1}


async def test_worker_killed_mid_fleet_leaves_no_duplicate_and_no_orphan(tmp_path, temporal_client, bmdb_url):
    machines = 8
    async with fleet_stack(
        tmp_path,
        temporal_client,
        bmdb_url,
        machines=machines,
        run_worker=False,
        sim_faults=Faults(exec_delay=0.5),
        provider_timeout=2.0,
        ssh_exec_timeout=5.0,
        device_creation_interval=0.1,
        reconcile_interval=3600.0,
    ) as stack:
        env = {**os.environ, **settings_environment(stack.settings), "SHEPHERD_DATABASE_URL": bmdb_url}

        def start_worker() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-m", "shepherd", "worker"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "worker.log").open("ab"),
            )

        first = start_worker()
        fleet = await stack.client.start_workflow(
            "FleetWorkflow", fleet_input(stack.settings, "sim"), id="fleet-crash", task_queue=stack.settings.task_queue
        )
        # Kill the worker once some machines are taken over and others are not.
        bmdb = BMDB(bmdb_url, pool_size=1)
        try:
            for _ in range(600):
                counts = await bmdb.count_by_status()
                if counts.get("agent_started", 0) >= 2:
                    break
                await asyncio.sleep(0.05)
            assert 0 < counts.get("agent_started", 0) < machines, counts
            first.send_signal(signal.SIGKILL)
            first.wait()

            second = start_worker()
            try:
                await fleet.result()
                await stack.wait_for_stage(nodes(machines), MachineStage.WATCHING, limit=120)
            finally:
                second.send_signal(signal.SIGTERM)
                assert second.wait(30) == 0

            state = await sim_admin(stack, "/admin/state")
            assert state["creations"] == {node: 1 for node in nodes(machines)}
            records = await bmdb.list_machines()
            assert sorted(r.provider_id for r in records) == nodes(machines)
            assert all(r.status == "provided" and r.agent_public_key for r in records)
        finally:
            await bmdb.close()


def test_ages_in_the_machines_table_fit_six_characters():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    ages = {s: age(now - timedelta(seconds=s), now) for s in (0, 59, 187, 3599, 18720, 1051200, 8639999)}
    assert ages == {
        0: "0s",
        59: "59s",
        187: "3m07s",
        3599: "59m59s",
        18720: "5h12m",
        1051200: "12d04h",
        8639999: "99d23h",
    }
    assert age(None, now) == "-" and age(now + timedelta(seconds=5), now) == "0s"


async def test_pass_calls_temporal_a_bounded_number_at_once_and_keeps_the_order():
    in_flight = most = 0

    async def call(n: int) -> int:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        # Later items finish first, so an order kept by finishing time would show.
        await asyncio.sleep(0.001 * (50 - n))
        in_flight -= 1
        return n * 10

    assert await each_at_most(list(range(50)), 7, call) == [n * 10 for n in range(50)]
    assert most == 7


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (2592000, "30d"),
        (9000, "2h30m"),
        (3605, "1h00m05s"),
        (60, "1m"),
        (90, "1m30s"),
        (45, "45s"),
        (1.5, "1.5s"),
        (0.25, "250ms"),
        (0, "0s"),
    ],
)
async def test_the_fleet_schedules_interval_reads_as_an_operator_writes_it(seconds, shown):
    interval = SimpleNamespace(every=timedelta(seconds=seconds))
    description = SimpleNamespace(
        schedule=SimpleNamespace(
            state=SimpleNamespace(paused=True, note="rack move"), spec=SimpleNamespace(intervals=[interval])
        ),
        info=SimpleNamespace(next_action_times=[]),
    )

    class Handle:
        async def describe(self) -> Any:
            return description

    client = SimpleNamespace(get_schedule_handle=lambda schedule_id: Handle())
    line, facts = await schedule_line(OperatorClient(Settings(), temporal=client), "sim")  # type: ignore[arg-type]
    assert line == f"schedule shepherd-fleet-sim: PAUSED (rack move), every {shown}"
    assert facts["interval_seconds"] == seconds
