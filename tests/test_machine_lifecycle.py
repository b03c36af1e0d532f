"""MachineWorkflow's timing on the time-skipping test server: back-offs, recovery, signals.

The seed's back-offs are minutes to hours; the test server skips the waits.
The activities here are stand-ins registered under the real activity names,
because the point is the workflow's timing, not the I/O.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateStage
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer, Worker

from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import (
    MACHINE_STAGE,
    AgentCheckInput,
    AgentFacts,
    Backoff,
    BootWaitInput,
    BootWaitResult,
    DecommissionInput,
    HeartbeatLost,
    LifecyclePolicy,
    MachineInput,
    MachineStage,
    MachineStatus,
    MaintenanceInput,
    OperatorActionInput,
    ProvisionInput,
    ProvisionResult,
    QuarantineInput,
    RebootInput,
    RebootResult,
    RecoveryKind,
    RecoveryRequest,
    ReimageResult,
    RetireInput,
    RetireResult,
    SilenceCheck,
    SilenceCheckInput,
    StartAgentInput,
    StuckInput,
    initial_search_attributes,
    machine_task_queue,
    provider_task_queue,
)
from lifecycle.inputs import lifecycle_policy
from workflows.machine import STEP_ATTEMPTS_PER_RUN, MachineWorkflow
from workflows.machine.activities import TAKEOVER_HEARTBEAT_TIMEOUT
from workflows.machine.flows import RECOVERY_OF_TODAY

# The seed's back-offs are the settings' defaults.
SEED_POLICY = lifecycle_policy(Settings())
SEED_AGENT_BACKOFF = SEED_POLICY.agent_start_backoff


class FakeMachineActivities:
    """Stand-ins that fail agent starts, reboots and their records a set number of times, recording when and what."""

    def __init__(
        self, agent_failures: int = 0, reboot_failures: int = 0, record_failures: int = 0, retire_failures: int = 0
    ) -> None:
        self.agent_failures = agent_failures
        self.retire_failures = retire_failures
        self.retirements: list[DecommissionInput] = []
        self.retired_records: list[str] = []
        self.actions_logged: list[tuple[str, str]] = []
        self.reboot_failures = reboot_failures
        self.record_failures = record_failures
        self.agent_attempt_times: list[float] = []
        self.reboots: list[tuple[float, str]] = []
        self.records: list[RebootInput] = []
        self.boot_waits: list[BootWaitInput] = []
        self.quarantines: list[tuple[bool, str]] = []
        self.stuck_records: list[tuple[float, bool, str]] = []
        self.maintenance_records: list[tuple[bool, str]] = []
        # What check_agent_after_maintenance answers.
        self.agent_alive = True
        # What confirm_silence answers, and what it was asked; while silence_gate is set and not open, it waits.
        self.silence = SilenceCheck(True, "last heartbeat at 10:00")
        self.silence_checks: list[SilenceCheckInput] = []
        self.silence_gate: asyncio.Event | None = None
        # Agent starts that are never heard from again, as a task lost on its way to a worker, or a worker dead.
        self.agent_starts_lost = 0
        # While set and not open, record_operator_action waits for it: an operator action's handler still running.
        self.action_log_gate: asyncio.Event | None = None
        # Every call in order, by activity name.
        self.calls: list[str] = []
        # Whether the provider can reimage (most cannot: the static inventory, older plugins), and its reimages.
        self.can_reimage = False
        self.reimages: list[RebootInput] = []

    @property
    def activities(self) -> list[Any]:
        """The provider queue's."""
        return [
            self.provision_machine,
            self.reboot_through_provider,
            self.reimage_through_provider,
            self.retire_through_provider,
        ]

    @property
    def machine_queue_activities(self) -> list[Any]:
        return [self.start_agent, self.wait_for_boot, self.stop_agent]

    @property
    def main_queue_activities(self) -> list[Any]:
        return [
            self.record_reboot,
            self.record_quarantine,
            self.record_stuck,
            self.record_maintenance,
            self.check_agent_after_maintenance,
            self.confirm_silence,
            self.forget_decommissioned_agent,
            self.record_retired,
            self.record_operator_action,
        ]

    @activity.defn(name="record_operator_action")
    async def record_operator_action(self, input: OperatorActionInput) -> None:
        if self.action_log_gate is not None:
            await self.action_log_gate.wait()
        self.actions_logged.append((input.kind, input.detail))

    @activity.defn(name="forget_decommissioned_agent")
    async def forget_decommissioned_agent(self, input: DecommissionInput) -> None:
        self.calls.append("forget_decommissioned_agent")

    @activity.defn(name="stop_agent")
    async def stop_agent(self, input: DecommissionInput) -> str:
        self.calls.append("stop_agent")
        raise ApplicationError("SSH refused", type="SSH_ERROR", non_retryable=True)

    @activity.defn(name="retire_through_provider")
    async def retire_through_provider(self, input: DecommissionInput) -> RetireResult:
        self.calls.append("retire_through_provider")
        self.retirements.append(input)
        if len(self.retirements) <= self.retire_failures:
            raise ApplicationError("provider sim: unavailable", type="ProviderUnavailable", non_retryable=True)
        return RetireResult(action="released", detail="slot freed")

    @activity.defn(name="record_retired")
    async def record_retired(self, input: RetireInput) -> None:
        self.calls.append("record_retired")
        self.retired_records.append(input.detail)

    @activity.defn(name="record_maintenance")
    async def record_maintenance(self, input: MaintenanceInput) -> None:
        self.maintenance_records.append((input.on, input.detail))

    @activity.defn(name="check_agent_after_maintenance")
    async def check_agent_after_maintenance(self, input: AgentCheckInput) -> bool:
        self.calls.append("check_agent_after_maintenance")
        return self.agent_alive

    @activity.defn(name="confirm_silence")
    async def confirm_silence(self, input: SilenceCheckInput) -> SilenceCheck:
        self.silence_checks.append(input)
        if self.silence_gate is not None:
            await self.silence_gate.wait()
        return self.silence

    @activity.defn(name="record_stuck")
    async def record_stuck(self, input: StuckInput) -> None:
        self.stuck_records.append(
            (activity.info().current_attempt_scheduled_time.timestamp(), input.stuck, input.detail)
        )

    @activity.defn(name="record_quarantine")
    async def record_quarantine(self, input: QuarantineInput) -> None:
        self.quarantines.append((input.quarantined, input.detail))

    @activity.defn(name="reboot_through_provider")
    async def reboot_through_provider(self, input: RebootInput) -> RebootResult:
        self.calls.append("reboot_through_provider")
        self.reboots.append((activity.info().current_attempt_scheduled_time.timestamp(), input.cause))
        if len(self.reboots) <= self.reboot_failures:
            raise ApplicationError("provider sim: reboot: bad answer", type="ProviderProtocolError", non_retryable=True)
        return RebootResult(went_down=True, detail="fake")

    @activity.defn(name="reimage_through_provider")
    async def reimage_through_provider(self, input: RebootInput) -> ReimageResult:
        self.calls.append("reimage_through_provider")
        if not self.can_reimage:
            return ReimageResult(False, "provider sim cannot reimage a machine")
        self.reimages.append(input)
        return ReimageResult(True, "a fresh disk")

    @activity.defn(name="record_reboot")
    async def record_reboot(self, input: RebootInput) -> None:
        self.calls.append("record_reboot")
        self.records.append(input)
        if len(self.records) <= self.record_failures:
            raise ApplicationError("BMDB: connection lost", type="BMDBUnavailable")

    @activity.defn(name="wait_for_boot")
    async def wait_for_boot(self, input: BootWaitInput) -> BootWaitResult:
        self.calls.append("wait_for_boot")
        self.boot_waits.append(input)
        return BootWaitResult(came_back=True, waited=42.0, detail="SSH answers again")

    @activity.defn(name="provision_machine")
    async def provision_machine(self, input: ProvisionInput) -> ProvisionResult:
        return ProvisionResult(address="192.0.2.1", ssh_port=22, location="test")

    @activity.defn(name="start_agent")
    async def start_agent(self, input: StartAgentInput) -> AgentFacts:
        self.calls.append("start_agent")
        self.agent_attempt_times.append(activity.info().current_attempt_scheduled_time.timestamp())
        if len(self.agent_attempt_times) <= self.agent_starts_lost:
            await asyncio.Event().wait()
        if len(self.agent_attempt_times) <= self.agent_failures:
            raise ApplicationError("agent said: disk on fire", type="AGENT_ERROR", non_retryable=True)
        # Every agent started has a key of its own, as on a machine.
        key = f"SHA256:agent-{len(self.agent_attempt_times)}"
        return AgentFacts(started_at="2026-01-01T00:00:00+00:00", key_fingerprint=key)


async def start_machine(env, queue: str, policy: LifecyclePolicy) -> Any:
    return await env.client.start_workflow(
        MachineWorkflow.run,
        MachineInput("sim", "node-0001", str(uuid.uuid4()), policy),
        id=f"machine-sim-{uuid.uuid4()}",
        task_queue=queue,
    )


async def test_agent_start_waits_the_seed_backoff_between_attempts(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=4)
    policy = SEED_POLICY
    async with machine_worker(env, fakes, "backoff") as queue:
        handle = await start_machine(env, queue, policy)
        # Each failed attempt is followed by a wait of 300 s x 1.2^n.
        for failures in range(1, 5):
            await env.sleep(timedelta(seconds=1))
            status = await handle.query(MachineWorkflow.status)
            assert status.stage is MachineStage.AGENT_STARTING
            assert status.attempts == failures
            assert status.last_error == "AGENT_ERROR: agent said: disk on fire"
            await env.sleep(timedelta(seconds=SEED_AGENT_BACKOFF.delay(failures)))
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING
        assert status.attempts == 0 and status.agent is not None
        gaps = [round(b - a) for a, b in zip(fakes.agent_attempt_times, fakes.agent_attempt_times[1:], strict=False)]
        assert gaps == [300, 360, 432, 518]
        await handle.terminate()


async def test_retry_now_ends_a_back_off_and_is_ignored_when_nothing_fails(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=2)
    policy = SEED_POLICY
    async with machine_worker(env, fakes, "retry-now") as queue:
        handle = await start_machine(env, queue, policy)
        await env.sleep(timedelta(seconds=1))
        assert (await handle.query(MachineWorkflow.status)).attempts == 1
        await handle.signal(MachineWorkflow.retry_now, "pin reset")
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.AGENT_STARTING and status.attempts == 2
        # The second failure waits its back-off again: one signal, one retry.
        await env.sleep(timedelta(seconds=SEED_AGENT_BACKOFF.delay(2) - 10))
        assert (await handle.query(MachineWorkflow.status)).attempts == 2
        await env.sleep(timedelta(seconds=20))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING
        gaps = [round(b - a) for a, b in zip(fakes.agent_attempt_times, fakes.agent_attempt_times[1:], strict=False)]
        assert gaps[0] < 5 and gaps[1] == 360

        await handle.signal(MachineWorkflow.retry_now)
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and len(fakes.agent_attempt_times) == 3
        await handle.terminate()


FAST = replace(SEED_POLICY, provision_backoff=Backoff(1, 1, 1), agent_start_backoff=Backoff(1, 1, 1))


@asynccontextmanager
async def machine_worker(env, fakes: FakeMachineActivities, purpose: str) -> AsyncIterator[str]:
    """Workers running MachineWorkflow on a queue of its own, the fakes on its provider's queues; yields the queue."""
    queue = f"{purpose}-{uuid.uuid4()}"
    async with (
        Worker(env.client, task_queue=queue, workflows=[MachineWorkflow], activities=fakes.main_queue_activities),
        Worker(env.client, task_queue=provider_task_queue(queue, "sim"), activities=fakes.activities),
        Worker(env.client, task_queue=machine_task_queue(queue, "sim"), activities=fakes.machine_queue_activities),
    ):
        yield queue


async def skipped_until(env, handle: Any, done: Callable[[MachineStatus], bool], *, limit: int = 100) -> MachineStatus:
    """The machine's status once done says so, the server's time skipped a minute at a time and the worker given a
    moment of real time between (a local activity's retries wait in real time)."""
    for _ in range(limit):
        await env.sleep(timedelta(seconds=60))
        status: MachineStatus = await handle.query(MachineWorkflow.status)
        if done(status):
            return status
        await asyncio.sleep(0.1)
    raise AssertionError(f"not done after {limit} minutes skipped: {status}")


async def watching_machine(env, fakes: FakeMachineActivities, queue: str, policy: LifecyclePolicy = FAST) -> Any:
    handle = await start_machine(env, queue, policy)
    await env.sleep(timedelta(seconds=1))
    assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.WATCHING
    return handle


async def test_heartbeat_lost_reboots_retrying_with_the_seed_backoff_then_takes_over_again(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(reboot_failures=3)
    async with machine_worker(env, fakes, "recovery") as queue:
        handle = await watching_machine(env, fakes, queue)
        first_run = (await handle.describe()).run_id
        await handle.signal(MachineWorkflow.heartbeat_lost, "last heartbeat at 10:00")
        for failures in range(1, 4):
            await env.sleep(timedelta(seconds=1))
            status = await handle.query(MachineWorkflow.status)
            assert status.stage is MachineStage.RECOVERING and status.attempts == failures
            assert status.last_error is not None and status.last_error.startswith("ProviderProtocolError")
            await env.sleep(timedelta(seconds=FAST.recovery_backoff.delay(failures)))
        await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        # Rebooted, continued as new, agent started again.
        assert status.stage is MachineStage.WATCHING
        assert status.recovery_count == 1
        assert status.last_recovery_reason == "heartbeat lost: last heartbeat at 10:00"
        assert (await handle.describe()).run_id != first_run
        gaps = [b[0] - a[0] for a, b in zip(fakes.reboots, fakes.reboots[1:], strict=False)]
        # 60, 72 and 86.4 s; the skipped clock adds a moment's real time to each.
        assert len(gaps) == 3 and all(abs(gap - FAST.recovery_backoff.delay(n)) < 1.5 for n, gap in enumerate(gaps, 1))
        assert len(fakes.agent_attempt_times) == 2
        await handle.terminate()


@pytest.mark.parametrize(
    ("argument", "reason"),
    [
        ({"reason": "disk errors"}, "forced: disk errors"),
        (None, "forced: no reason given"),
        ("smells of smoke", "forced: smells of smoke"),
        ({"why": 3}, "forced: unreadable reason \"{'why': 3}\""),
    ],
)
async def test_force_recover_arguments(time_skipping_env, argument, reason):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "force") as queue:
        handle = await watching_machine(env, fakes, queue)
        if argument is None:
            await handle.signal("force_recover")
        else:
            await handle.signal("force_recover", argument)
        await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        assert status.last_recovery_reason == reason
        assert [cause for _, cause in fakes.reboots] == [reason]
        await handle.terminate()


async def test_malformed_json_argument_is_not_lost(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "force") as queue:
        handle = await watching_machine(env, fakes, queue)
        garbage = Payload(metadata={"encoding": b"json/plain"}, data=b"{not json")
        await handle.signal("force_recover", RawValue(garbage))
        await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING
        assert status.recovery_count == 1 and len(fakes.reboots) == 1
        assert status.last_recovery_reason == "forced: {not json"
        await handle.terminate()


async def test_signals_during_recovery_are_coalesced_into_one_reboot(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(reboot_failures=1)
    async with machine_worker(env, fakes, "coalesce") as queue:
        handle = await watching_machine(env, fakes, queue)
        await handle.signal("force_recover", {"reason": "first"})
        await env.sleep(timedelta(seconds=1))
        await handle.signal("force_recover", {"reason": "second"})
        await handle.signal(MachineWorkflow.heartbeat_lost, "silent")
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.RECOVERING and status.recovery_requests_coalesced == 2
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.recovery_count == 1
        assert [cause for _, cause in fakes.reboots] == ["forced: first", "forced: first"]  # one failed, one done
        await handle.terminate()


async def test_recovery_asked_for_before_the_agent_started_waits_for_it(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=2)
    async with machine_worker(env, fakes, "early") as queue:
        handle = await start_machine(env, queue, FAST)
        await handle.signal("force_recover", {"reason": "early"})
        # A query can be answered before the workflow task carrying the signal has completed.
        for _ in range(50):
            status = await handle.query(MachineWorkflow.status)
            if status.recovery_requested:
                break
            await asyncio.sleep(0.1)
        assert status.stage in (MachineStage.PROVISIONING, MachineStage.AGENT_STARTING)
        assert status.recovery_requested == RecoveryRequest("early", kind=RecoveryKind.FORCED)
        assert status.recovery_requested.describe() == "forced: early"
        await env.sleep(timedelta(seconds=10))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.last_recovery_reason == "forced: early"
        assert len(fakes.reboots) == 1
        await handle.terminate()


async def test_the_takeover_after_a_reboot_runs_in_the_recovery_run_and_the_next_run_begins_watching(
    time_skipping_env,
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "in-run") as queue:
        handle = await watching_machine(env, fakes, queue)
        first_run = (await handle.describe()).run_id
        await handle.signal(MachineWorkflow.heartbeat_lost, "silent")
        await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.recovery_count == 1
        assert status.agent is not None and status.agent.key_fingerprint == "SHA256:agent-2"
        recovery = await env.client.get_workflow_handle(handle.id, run_id=first_run).fetch_history()
        assert scheduled(recovery) == [
            "provision_machine",
            "start_agent",
            "reboot_through_provider",
            "wait_for_boot",
            "start_agent",
        ]
        # One patch marker stands for every change a recovery went through; the BMDB steps ran locally.
        assert markers(recovery) == [f"core_patch {RECOVERY_OF_TODAY}", "confirm_silence", "record_reboot"]
        assert len(upserts(recovery, "TemporalChangeVersion")) == 1
        # The next run begins where the recovery left the machine, WATCHING, and asks nothing of anyone.
        next_run = await handle.fetch_history()
        assert next_run.run_id != first_run
        assert scheduled(next_run) == [] and markers(next_run) == [] and upserts(next_run) == []
        await handle.terminate()


async def test_an_operators_recovery_asked_during_the_takeover_after_a_reboot_goes_ahead_in_the_next_run(
    time_skipping_env,
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    policy = replace(FAST, agent_start_backoff=Backoff(60, 60, 1))
    async with machine_worker(env, fakes, "in-run-request") as queue:
        handle = await watching_machine(env, fakes, queue, policy)
        first_run = (await handle.describe()).run_id
        # The takeover after the reboot fails once, and waits its back-off in the recovery's run.
        fakes.agent_failures = len(fakes.agent_attempt_times) + 1
        await handle.signal(MachineWorkflow.heartbeat_lost, "silent")
        await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.AGENT_STARTING and status.attempts == 1
        assert status.recovery_count == 1 and (await handle.describe()).run_id == first_run
        await handle.signal("force_recover", {"reason": "second", "by": "alice"})
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.recovery_count == 2
        assert [cause for _, cause in fakes.reboots] == ["heartbeat lost: silent", "forced: second (by alice)"]
        assert status.last_recovery_reason == "forced: second (by alice)" and status.recovery_requested is None
        await handle.terminate()


def scheduled(history: Any) -> list[str]:
    """The activities a run scheduled on task queues, in order."""
    return [
        event.activity_task_scheduled_event_attributes.activity_type.name
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


def markers(history: Any) -> list[str]:
    """A run's markers, in order: a patch by its id, a local activity by its name."""
    found = []
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            marker = event.marker_recorded_event_attributes
            if marker.marker_name == "core_patch":
                found.append(f"core_patch {json.loads(marker.details['patch-data'].payloads[0].data)['id']}")
            else:
                found.append(json.loads(marker.details["data"].payloads[0].data)["activity_type"])
    return found


def upserts(history: Any, attribute: str | None = None) -> list[Any]:
    """A run's search-attribute upserts, or those that set attribute."""
    return [
        event
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
        and (
            attribute is None
            or attribute in event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        )
    ]


async def test_a_hundred_recoveries_keep_the_history_short(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "many") as queue:
        # No recovery budget (as in a workflow started before there was one), or it would be quarantined.
        handle = await watching_machine(env, fakes, queue, replace(FAST, recovery_budget=None))
        for n in range(100):
            await handle.signal(MachineWorkflow.heartbeat_lost, f"silence {n}")
            await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        assert status.recovery_count == 100 and status.stage is MachineStage.WATCHING
        history = await handle.fetch_history()
        assert len(history.events) < 60
        await handle.terminate()


async def test_heartbeat_lost_about_an_agent_that_was_replaced_is_ignored(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "stale") as queue:
        first = await watching_machine(env, fakes, queue)
        handle = env.client.get_workflow_handle(first.id)
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent", "SHA256:agent-1"))
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.recovery_count == 1
        assert status.agent is not None and status.agent.key_fingerprint == "SHA256:agent-2"

        # A watchdog pass that read BMDB before that recovery finished: about the old agent, so no second reboot.
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent", "SHA256:agent-1"))
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.recovery_count == 1 and len(fakes.reboots) == 1

        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent again", "SHA256:agent-2"))
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert (
            status.recovery_count == 2 and [cause for _, cause in fakes.reboots][-1] == "heartbeat lost: silent again"
        )
        await handle.terminate()


async def test_a_heartbeat_lost_that_bmdb_does_not_confirm_reboots_nothing(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    fakes.silence = SilenceCheck(False, "not recovered: its agent heartbeats")
    async with machine_worker(env, fakes, "unconfirmed") as queue:
        handle = await watching_machine(env, fakes, queue)
        # Anyone who can signal the workflow can send this: the Temporal UI, a script, a stale watchdog.
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("forged", "SHA256:agent-1"))
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.recovery_requested is None
        assert status.agent is not None and status.agent.key_fingerprint == "SHA256:agent-1"
        assert fakes.reboots == [] and status.recovery_count == 0
        (check,) = fakes.silence_checks
        assert (check.machine_id, check.provider, check.agent_key_fingerprint) == (
            status.machine_id,
            "sim",
            "SHA256:agent-1",
        )

        # Confirmed, the same signal reboots it; an operator's recovery is never asked about.
        fakes.silence = SilenceCheck(True, "last heartbeat at 10:00")
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent", "SHA256:agent-1"))
        await env.sleep(timedelta(seconds=120))
        await handle.signal("force_recover", {"reason": "disk errors", "by": "alice"})
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.recovery_count == 2 and len(fakes.silence_checks) == 2
        await handle.terminate()


async def test_an_operators_recovery_asked_while_a_silence_is_confirmed_goes_ahead(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    fakes.silence = SilenceCheck(False, "not recovered: its agent heartbeats")
    fakes.silence_gate = asyncio.Event()
    async with machine_worker(env, fakes, "confirming") as queue:
        handle = await watching_machine(env, fakes, queue)
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("stale", "SHA256:agent-1"))
        # The confirmation runs in the worker, within the workflow task: held in real time, not the server's.
        await asyncio.sleep(1)
        assert len(fakes.silence_checks) == 1
        await handle.signal("force_recover", {"reason": "disk errors", "by": "alice"})
        await asyncio.sleep(1)
        fakes.silence_gate.set()
        await skipped_until(env, handle, lambda status: status.recovery_count == 1)
        assert len(fakes.silence_checks) == 1 and [cause for _, cause in fakes.reboots] == [
            "forced: disk errors (by alice)"
        ]
        await handle.terminate()


async def test_a_reboot_recorded_after_a_blip_is_not_repeated_and_the_takeover_waits_for_the_boot(time_skipping_env):
    env = time_skipping_env
    # BMDB fails the record three times, each through the activity's quick retries and then the step's back-off.
    fakes = FakeMachineActivities(record_failures=3)
    async with machine_worker(env, fakes, "reboot-once") as queue:
        handle = await watching_machine(env, fakes, queue)
        recovering_run = (await handle.describe()).run_id
        await handle.signal(MachineWorkflow.heartbeat_lost, "silent")
        # The record's quick retries run in the worker, in real time; the step's back-offs in the server's.
        status = await skipped_until(
            env, handle, lambda status: status.stage is MachineStage.WATCHING and status.recovery_count == 1
        )
        assert len(fakes.reboots) == 1, "the provider was asked to reboot once"
        assert len(fakes.records) == 4 and {r.cycle for r in fakes.records} == {recovering_run}
        assert fakes.calls == [
            "start_agent",
            "reboot_through_provider",
            *["record_reboot"] * 4,
            "wait_for_boot",
            "start_agent",
        ]
        (wait,) = fakes.boot_waits
        assert wait.went_down and wait.deadline == FAST.boot_deadline == Settings().boot_deadline
        assert status.waiting_for_boot_since is None
        await handle.terminate()


async def test_a_takeover_never_heard_from_is_tried_again_after_its_heartbeat_timeout_not_its_whole_time(
    time_skipping_env,
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    fakes.agent_starts_lost = 1
    async with machine_worker(env, fakes, "lost-takeover") as queue:
        handle = await start_machine(env, queue, FAST)
        await skipped_until(env, handle, lambda status: status.stage is MachineStage.WATCHING)
        first, second = fakes.agent_attempt_times
        # The activity's retry (a second on) after the heartbeat timeout, well before its start-to-close.
        assert second - first <= TAKEOVER_HEARTBEAT_TIMEOUT.total_seconds() + 2 < FAST.agent_start_timeout
        await handle.terminate()


BUDGET = replace(FAST, recovery_budget=3, recovery_budget_window=3600.0)


async def lose_heartbeat(env, handle: Any, cause: str) -> MachineStatus:
    """Signal heartbeat_lost about the machine's current agent, and its status two minutes later."""
    agent = (await handle.query(MachineWorkflow.status)).agent
    await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost(cause, agent.key_fingerprint))
    await env.sleep(timedelta(seconds=120))
    return await handle.query(MachineWorkflow.status)


async def test_a_machine_past_its_recovery_budget_is_quarantined_until_an_operator_releases_it(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "budget") as queue:
        handle = await start_machine(env, queue, BUDGET)
        await env.sleep(timedelta(seconds=1))
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(MachineWorkflow.release, {"reason": "fixed", "by": "alice"})
        assert "not quarantined: it is WATCHING" in str(refused.value.cause)

        for n in range(1, 4):
            status = await lose_heartbeat(env, handle, f"silent {n}")
            assert (status.stage, status.recovery_count) == (MachineStage.WATCHING, n)
            assert [r.reason for r in status.recent_recoveries][-1] == f"heartbeat lost: silent {n}"

        # The fourth within the hour: not rebooted, quarantined with the recoveries that spent the budget.
        status = await lose_heartbeat(env, handle, "silent 4")
        assert status.stage is MachineStage.QUARANTINED and status.recovery_count == 3 and len(fakes.reboots) == 3
        assert status.quarantine is not None
        assert status.quarantine.reason.startswith("3 recoveries within 1:00:00, its budget")
        assert [r.reason for r in status.quarantine.recoveries] == [f"heartbeat lost: silent {n}" for n in (1, 2, 3)]
        assert fakes.quarantines == [(True, status.quarantine.reason)]
        # Hours later it is still left alone.
        await env.sleep(timedelta(hours=5))
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.QUARANTINED
        assert len(fakes.reboots) == 3

        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(MachineWorkflow.release, {"by": "alice"})
        assert "say why" in str(refused.value.cause)
        answer = await handle.execute_update(MachineWorkflow.release, {"reason": "PSU replaced", "by": "alice"})
        assert answer.startswith("released by alice (unverified) (PSU replaced)")
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert (status.stage, status.recovery_count, status.quarantine) == (MachineStage.WATCHING, 4, None)
        assert status.last_recovery_reason == "heartbeat lost: silent 4 (released by alice (unverified): PSU replaced)"
        assert len(status.recent_recoveries) == 1, "the budget starts afresh"
        assert fakes.quarantines[-1] == (False, "released by alice (unverified): PSU replaced")
        await handle.terminate()


async def test_past_its_budget_a_machine_is_reimaged_once_and_quarantined_only_when_that_did_not_help(
    time_skipping_env,
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    fakes.can_reimage = True
    async with machine_worker(env, fakes, "reimage") as queue:
        handle = await start_machine(env, queue, BUDGET)
        await env.sleep(timedelta(seconds=1))
        for n in range(1, 4):
            await lose_heartbeat(env, handle, f"silent {n}")
        assert not fakes.reimages and len(fakes.reboots) == 3

        # The fourth within the hour: a fresh OS instead of a quarantine, recorded as a reimage, then taken over.
        status = await lose_heartbeat(env, handle, "silent 4")
        assert (status.stage, status.recovery_count, status.quarantine) == (MachineStage.WATCHING, 4, None)
        assert len(fakes.reimages) == 1 and len(fakes.reboots) == 3 and not fakes.quarantines
        assert fakes.reimages[0].reimage and fakes.records[-1].reimage, "the record forgets the host key too"
        assert fakes.calls[-3:] == ["record_reboot", "wait_for_boot", "start_agent"]
        assert status.last_recovery_reason == (
            "heartbeat lost: silent 4; its recovery budget is spent: reimaged before a quarantine"
        )
        assert [r.reimaged for r in status.recent_recoveries] == [False, False, False, True]

        # Silent again with the reimage still in the window: that did not help, a person looks.
        status = await lose_heartbeat(env, handle, "silent 5")
        assert status.stage is MachineStage.QUARANTINED and len(fakes.reimages) == 1 and len(fakes.reboots) == 3
        assert fakes.quarantines and fakes.quarantines[0][0]
        await handle.terminate()


async def test_a_provider_that_cannot_reimage_leaves_the_quarantine_as_it_was(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "no-reimage") as queue:
        handle = await start_machine(env, queue, BUDGET)
        await env.sleep(timedelta(seconds=1))
        for n in range(1, 5):
            status = await lose_heartbeat(env, handle, f"silent {n}")
        assert status.stage is MachineStage.QUARANTINED and len(fakes.reboots) == 3
        assert fakes.calls.count("reimage_through_provider") == 1, "asked once; the provider declined"
        assert not fakes.reimages
        await handle.terminate()


async def test_an_operator_asks_for_a_reimage_which_the_budget_never_counts(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    fakes.can_reimage = True
    async with machine_worker(env, fakes, "reimage-forced") as queue:
        handle = await start_machine(env, queue, BUDGET)
        await env.sleep(timedelta(seconds=1))
        await handle.signal("force_recover", {"reason": "disk errors", "by": "alice", "reimage": True})
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert (status.stage, status.recovery_count) == (MachineStage.WATCHING, 1)
        assert status.last_recovery_reason == "forced reimage: disk errors (by alice)"
        assert len(fakes.reimages) == 1 and not fakes.reboots
        assert fakes.reimages[0].kind is RecoveryKind.FORCED
        assert ("reimage_forced", "by alice (unverified): disk errors") in fakes.actions_logged

        # Where the provider cannot, the operator's machine is rebooted instead.
        fakes.can_reimage = False
        await handle.signal("force_recover", {"reason": "try again", "reimage": True})
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert (status.stage, status.recovery_count) == (MachineStage.WATCHING, 2)
        assert len(fakes.reimages) == 1 and len(fakes.reboots) == 1
        await handle.terminate()


async def test_forced_recoveries_are_never_quarantined_and_the_budget_window_slides(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "budget-window") as queue:
        handle = await start_machine(env, queue, BUDGET)
        await env.sleep(timedelta(seconds=1))
        for n in range(4):
            await handle.signal("force_recover", {"reason": f"operator {n}"})
            await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert (status.stage, status.recovery_count) == (MachineStage.WATCHING, 4) and not fakes.quarantines
        # An hour on, the forced recoveries have left the window.
        await env.sleep(timedelta(hours=1))
        status = await lose_heartbeat(env, handle, "silent")
        assert (status.stage, status.recovery_count) == (MachineStage.WATCHING, 5) and not fakes.quarantines
        await handle.terminate()


async def test_a_forced_recovery_releases_a_quarantined_machine(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "budget-forced") as queue:
        handle = await start_machine(env, queue, replace(BUDGET, recovery_budget=1))
        await env.sleep(timedelta(seconds=1))
        await lose_heartbeat(env, handle, "first")
        assert (await lose_heartbeat(env, handle, "second")).stage is MachineStage.QUARANTINED
        await handle.signal("force_recover", {"reason": "reseated the NIC"})
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert (status.stage, status.recovery_count) == (MachineStage.WATCHING, 2)
        assert fakes.quarantines[-1] == (False, "released by unknown (unverified): forced: reseated the NIC")
        await handle.terminate()


async def test_an_agent_start_that_outlasts_its_deadline_is_flagged_stuck_and_keeps_its_back_off(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=8)
    async with machine_worker(env, fakes, "stuck") as queue:
        handle = await start_machine(env, queue, replace(SEED_POLICY, agent_start_deadline=3600.0))
        await env.sleep(timedelta(seconds=3500))
        assert (await handle.query(MachineWorkflow.status)).stuck is None and fakes.stuck_records == []
        await env.sleep(timedelta(seconds=200))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.AGENT_STARTING and status.stuck is not None
        assert status.stuck.reason == "AGENT_STARTING for 1:00:00, longer than its 1:00:00 deadline"
        assert status.stuck.last_error == "AGENT_ERROR: agent said: disk on fire"
        [(flagged_at, stuck, detail)] = fakes.stuck_records
        assert stuck and detail.endswith("last error: AGENT_ERROR: agent said: disk on fire")

        await env.sleep(timedelta(hours=1))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.stuck is None
        assert [(s, d.split(" after ")[0]) for _, s, d in fakes.stuck_records[1:]] == [(False, "AGENT_STARTING done")]
        # Flagged, not hurried: the attempts kept the seed's back-off.
        gaps = [b - a for a, b in zip(fakes.agent_attempt_times, fakes.agent_attempt_times[1:], strict=False)]
        assert len(gaps) == 8 and all(abs(gap - SEED_AGENT_BACKOFF.delay(n)) < 2 for n, gap in enumerate(gaps, 1))
        assert fakes.agent_attempt_times[6] < flagged_at < fakes.agent_attempt_times[7]
        await handle.terminate()


async def maintenance(handle: Any, **request: Any) -> str:
    return await handle.execute_update(MachineWorkflow.set_maintenance, request)


@pytest.mark.parametrize(("agent_alive", "recover"), [(True, False), (False, False), (True, True)])
async def test_a_machine_in_maintenance_is_left_alone_and_its_agent_decides_what_follows(
    time_skipping_env, agent_alive: bool, recover: bool
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    fakes.agent_alive = agent_alive
    async with machine_worker(env, fakes, "maintenance") as queue:
        handle = await watching_machine(env, fakes, queue)
        answer = await maintenance(handle, on=True, reason="replacing DIMM", by="alice")
        assert answer == "in maintenance (replacing DIMM): never rebooted or taken over until it ends"
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.MAINTENANCE and status.maintenance is not None
        assert (status.maintenance.by, status.maintenance.left) == ("alice (unverified)", MachineStage.WATCHING)
        # The technician powers it off: the watchdog's signal changes nothing, for hours.
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent", "SHA256:agent-1"))
        await env.sleep(timedelta(hours=3))
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.MAINTENANCE
        assert fakes.reboots == [] and len(fakes.agent_attempt_times) == 1

        await maintenance(handle, on=False, by="alice", recover=recover)
        await env.sleep(timedelta(seconds=120))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and status.maintenance is None
        assert fakes.maintenance_records == [
            (True, "by alice (unverified): replacing DIMM (it was WATCHING)"),
            (False, "by alice (unverified): maintenance done" + ("; reboot asked" if recover else "")),
        ]
        if recover:
            assert [cause for _, cause in fakes.reboots] == [
                "forced: maintenance over, reboot asked by alice (unverified): maintenance done"
            ]
        else:
            assert fakes.reboots == [], "maintenance ends without a reboot unless one is asked for"
            assert "check_agent_after_maintenance" in fakes.calls
        # Taken over again when its agent is gone (or after the reboot), else the same agent is watched.
        assert len(fakes.agent_attempt_times) == (1 if agent_alive and not recover else 2)
        await handle.terminate()


async def test_maintenance_asked_during_failing_agent_starts_stops_the_attempts_until_it_ends(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=3)
    async with machine_worker(env, fakes, "maintenance-steps") as queue:
        handle = await start_machine(env, queue, SEED_POLICY)
        await env.sleep(timedelta(seconds=1))
        answer = await maintenance(handle, on=True, reason="recabling", by="bob")
        assert answer.startswith("maintenance asked (recabling): it is AGENT_STARTING")
        await env.sleep(timedelta(seconds=1))
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.MAINTENANCE
        await env.sleep(timedelta(hours=6))
        assert len(fakes.agent_attempt_times) == 1, "no takeover while in maintenance"
        await maintenance(handle, on=False, reason="cabled", by="bob")
        await env.sleep(timedelta(seconds=2))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.AGENT_STARTING and len(fakes.agent_attempt_times) == 2
        await handle.terminate()


async def test_maintenance_requests_that_make_no_sense_are_refused(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "maintenance-refused") as queue:
        handle = await watching_machine(env, fakes, queue)
        refusals = [
            ({"on": False}, "not in maintenance: it is WATCHING"),
            ({"on": True}, "say why the machine goes into maintenance"),
            ({"on": True, "reason": "x", "recover": True}, '"recover" (a reboot once maintenance ends) goes with'),
            ({"reason": "x"}, 'give {"on": true'),
            ("on", 'give {"on": true'),
        ]
        for request, message in refusals:
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update(MachineWorkflow.set_maintenance, request)
            assert message in str(refused.value.cause), request
        await maintenance(handle, on=True, reason="fans", by="carol")
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await maintenance(handle, on=True, reason="fans again")
        assert "already in maintenance, asked by carol" in str(refused.value.cause)
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.MAINTENANCE
        await handle.terminate()


async def decommission(handle: Any, **request: Any) -> str:
    return await handle.execute_update(MachineWorkflow.decommission, request)


async def test_a_decommissioned_machine_is_retired_and_its_workflow_completes_with_what_was_done(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(retire_failures=2)
    async with machine_worker(env, fakes, "decommission") as queue:
        handle = await watching_machine(env, fakes, queue)
        answer = await decommission(handle, reason="end of lease", by="dave")
        assert answer.startswith("decommissioning (end of lease): its agent is stopped, then provider sim releases")
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await decommission(handle, reason="again")
        assert "it is being decommissioned, asked by dave" in str(refused.value.cause)
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        # The provider's outage is retried with the back-off, shown like any failing step's.
        assert status.stage is MachineStage.DECOMMISSIONING and status.attempts >= 1
        assert status.last_error == "ProviderUnavailable: provider sim: unavailable"
        # The watchdog and an operator's maintenance no longer apply.
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent", "SHA256:agent-1"))
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await maintenance(handle, on=True, reason="fans", by="erin")
        assert "it is being decommissioned" in str(refused.value.cause)

        result = await handle.result()
        assert (result.reason, result.by, result.provider_action) == ("end of lease", "dave (unverified)", "released")
        assert result.agent.startswith("not stopped (SSH_ERROR: SSH refused)")
        assert fakes.calls[-6:] == [
            "forget_decommissioned_agent",
            "stop_agent",
            "retire_through_provider",
            "retire_through_provider",
            "retire_through_provider",
            "record_retired",
        ]
        assert fakes.reboots == [] and len(fakes.agent_attempt_times) == 1
        assert fakes.retired_records[0].startswith("asked by dave (unverified): end of lease; agent: not stopped")
        description = await handle.describe()
        assert description.typed_search_attributes.get(MACHINE_STAGE) == MachineStage.DECOMMISSIONED.value


async def test_decommissioning_a_recovering_machine_waits_for_its_reboot(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(reboot_failures=1)
    async with machine_worker(env, fakes, "decommission-recovering") as queue:
        handle = await watching_machine(env, fakes, queue)
        await handle.signal(MachineWorkflow.heartbeat_lost, HeartbeatLost("silent", "SHA256:agent-1"))
        await env.sleep(timedelta(seconds=1))
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.RECOVERING
        answer = await decommission(handle, reason="dead disk", by="dave")
        assert answer.startswith("decommission asked (dead disk): once its reboot is done")
        result = await handle.result()
        assert result.provider_action == "released"
        # The reboot under way finished; nothing was taken over after it.
        assert fakes.calls.index("reboot_through_provider") < fakes.calls.index("retire_through_provider")
        assert "start_agent" not in fakes.calls[fakes.calls.index("reboot_through_provider") :]


@pytest.mark.parametrize("held_in", ["maintenance", "quarantine", "failing agent start"])
async def test_a_machine_held_apart_is_decommissioned_at_once(time_skipping_env, held_in: str):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=100 if held_in == "failing agent start" else 0)
    policy = replace(FAST, recovery_budget=0, recovery_budget_window=3600)
    async with machine_worker(env, fakes, "decommission-held") as queue:
        if held_in == "failing agent start":
            handle = await start_machine(env, queue, SEED_POLICY)
            expected = MachineStage.AGENT_STARTING
        else:
            handle = await watching_machine(env, fakes, queue, policy)
            if held_in == "maintenance":
                await maintenance(handle, on=True, reason="fans", by="erin")
                expected = MachineStage.MAINTENANCE
            else:
                await lose_heartbeat(env, handle, "silent")
                expected = MachineStage.QUARANTINED
        await env.sleep(timedelta(seconds=1))
        assert (await handle.query(MachineWorkflow.status)).stage is expected
        # Over erin's maintenance, frank says so (force).
        await decommission(handle, reason="scrapped", by="frank", force=held_in == "maintenance")
        await env.sleep(timedelta(seconds=2))
        result = await handle.result()
        assert result.by == "frank (unverified)" and fakes.reboots == []
        # Woken from its back-off at once: no attempt after the decommission was asked for.
        assert fakes.calls.count("start_agent") == 1


async def test_decommission_requests_without_a_reason_are_refused(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "decommission-refused") as queue:
        handle = await watching_machine(env, fakes, queue)
        for request in [None, {}, {"reason": "  "}, {"by": "x"}, 42]:
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update(MachineWorkflow.decommission, request)
            assert "say why the machine is decommissioned" in str(refused.value.cause), request
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.WATCHING
        assert "retire_through_provider" not in fakes.calls
        await handle.terminate()


async def test_operator_actions_say_who_asked_in_the_status_and_the_event_log(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=1)
    async with machine_worker(env, fakes, "actions") as queue:
        handle = await start_machine(env, queue, SEED_POLICY)
        await env.sleep(timedelta(seconds=1))
        await handle.signal(MachineWorkflow.retry_now, {"reason": "cable fixed", "by": "alice"})
        await env.sleep(timedelta(seconds=2))
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.WATCHING
        await handle.signal("force_recover", {"reason": "disk errors", "by": "bob"})
        await env.sleep(timedelta(seconds=120))
        await handle.signal("force_recover", "smells of smoke")
        await env.sleep(timedelta(seconds=120))
        await maintenance(handle, on=True, reason="fans", by="carol")
        # Its BMDB mark is recorded before the workflow ends: the test server keeps skipped time locked for an
        # activity of a workflow terminated as it was sent to a worker.
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        # Kept across the recoveries' continue-as-new.
        assert [(a.action, a.by, a.reason) for a in status.actions] == [
            ("retry_now", "alice (unverified)", "cable fixed"),
            ("force_recover", "bob (unverified)", "disk errors"),
            ("force_recover", "unknown (unverified)", "smells of smoke"),
            ("set_maintenance", "carol (unverified)", "on: fans"),
        ]
        assert [cause for _, cause in fakes.reboots] == ["forced: disk errors (by bob)", "forced: smells of smoke"]
        assert fakes.actions_logged == [
            ("retry_asked", "by alice (unverified): cable fixed"),
            ("recovery_forced", "by bob (unverified): disk errors"),
            ("recovery_forced", "by unknown (unverified): smells of smoke"),
        ]
        await handle.terminate()


@pytest.mark.parametrize("asked", ["decommission", "maintenance"])
async def test_an_update_accepted_while_a_run_waits_for_its_handlers_is_carried_into_the_next_run(
    time_skipping_env, asked: str
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, f"on-the-way-out-{asked}") as queue:
        handle = await watching_machine(env, fakes, queue)
        first_run = (await handle.describe()).run_id
        # A restart's handler logs the action in BMDB; held there, the run has decided to continue as new and
        # waits for that handler before it does.
        fakes.action_log_gate = asyncio.Event()
        restart = await handle.start_update(
            MachineWorkflow.restart_agent,
            {"reason": "agent 2.1", "by": "alice"},
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
        )
        if asked == "decommission":
            answer = await decommission(handle, reason="scrapped", by="frank")
            assert answer.startswith("decommissioning (scrapped)")
        else:
            answer = await maintenance(handle, on=True, reason="fans", by="carol")
            assert answer == "in maintenance (fans): never rebooted or taken over until it ends"
        fakes.action_log_gate.set()
        await restart.result()
        if asked == "decommission":
            result = await asyncio.wait_for(handle.result(), timeout=60)
            assert (result.by, result.reason, result.provider_action) == ("frank (unverified)", "scrapped", "released")
        else:
            await env.sleep(timedelta(seconds=2))
            status = await handle.query(MachineWorkflow.status)
            assert (await handle.describe()).run_id != first_run, "the restart continued the workflow as new"
            assert status.stage is MachineStage.MAINTENANCE and status.maintenance is not None
            assert (status.maintenance.by, status.maintenance.left) == (
                "carol (unverified)",
                MachineStage.AGENT_STARTING,
            )
            assert fakes.maintenance_records == [(True, "by carol (unverified): fans (it was AGENT_STARTING)")]
            await maintenance(handle, on=False, reason="fans replaced", by="carol")
            await env.sleep(timedelta(seconds=2))
            assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.WATCHING
            await handle.terminate()
        # Whatever was asked began before the restart's takeover, which a machine in maintenance or being
        # decommissioned must not get; a maintenance's end lets it run.
        assert fakes.calls.count("start_agent") == (1 if asked == "decommission" else 2)
        assert fakes.reboots == []
        for run_id in (first_run, (await handle.describe()).run_id):
            history = await env.client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
            await Replayer(workflows=[MachineWorkflow], data_converter=DATA_CONVERTER).replay_workflow(history)


async def test_a_decommission_the_provider_does_not_carry_out_is_flagged_stuck(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(retire_failures=1000)
    async with machine_worker(env, fakes, "decommission-stuck") as queue:
        handle = await watching_machine(env, fakes, queue, SEED_POLICY)
        await decommission(handle, reason="end of lease", by="dave")
        await env.sleep(timedelta(hours=1, minutes=30))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.DECOMMISSIONING and status.stuck is not None
        assert status.stuck.reason.startswith("DECOMMISSIONING for 1:00:00, longer than its 1:00:00 deadline")
        assert [stuck for _, stuck, _ in fakes.stuck_records] == [True]
        await handle.terminate()


async def test_a_step_that_keeps_failing_continues_as_new_and_keeps_its_count_deadline_and_requests(
    time_skipping_env,
):
    env = time_skipping_env
    failures = 2 * STEP_ATTEMPTS_PER_RUN + 10
    fakes = FakeMachineActivities(agent_failures=failures)
    async with machine_worker(env, fakes, "long-failing") as queue:
        handle = await start_machine(env, queue, replace(FAST, agent_start_deadline=20.0))
        await env.sleep(timedelta(seconds=1))
        first = await handle.describe()
        began = (await handle.query(MachineWorkflow.status)).stage_since
        await handle.signal("force_recover", {"reason": "asked early", "by": "erin"})
        await env.sleep(timedelta(seconds=STEP_ATTEMPTS_PER_RUN + 5))
        status = await handle.query(MachineWorkflow.status)
        assert (await handle.describe()).run_id != first.run_id, "continued as new"
        assert status.stage is MachineStage.AGENT_STARTING and status.attempts > STEP_ATTEMPTS_PER_RUN
        assert status.stage_since == began and status.last_error == "AGENT_ERROR: agent said: disk on fire"
        assert status.stuck is not None, "flagged stuck in the first run, still flagged in the next"
        first_history = await env.client.get_workflow_handle(handle.id, run_id=first.run_id).fetch_history()
        assert len(first_history.events) < 12 * STEP_ATTEMPTS_PER_RUN
        await env.sleep(timedelta(seconds=failures))
        await env.sleep(timedelta(minutes=5))
        status = await handle.query(MachineWorkflow.status)
        # Every attempt was made once, the agent runs, and the recovery asked for in the first run was done.
        assert len(fakes.agent_attempt_times) == failures + 2
        assert status.stage is MachineStage.WATCHING and status.recovery_count == 1
        assert [cause for _, cause in fakes.reboots] == ["forced: asked early (by erin)"]
        assert [stuck for _, stuck, _ in fakes.stuck_records] == [True, False]
        await handle.terminate()


async def upserted_stages(handle: Any) -> list[str]:
    """The MachineStage values the run's history upserted, in order."""
    stages = []
    async for event in handle.fetch_history_events():
        if event.HasField("upsert_workflow_search_attributes_event_attributes"):
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            stages.append(json.loads(fields[MACHINE_STAGE.name].data))
    return stages


async def test_a_run_upserts_its_stage_only_where_its_search_attributes_do_not_show_it(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "upserts") as queue:
        machine_id = str(uuid.uuid4())
        # As the fleet starts one: its search attributes show PROVISIONING from the start.
        handle = await env.client.start_workflow(
            MachineWorkflow.run,
            MachineInput("sim", "node-0001", machine_id, FAST, search_attributes_carried=True),
            id=f"machine-sim-{uuid.uuid4()}",
            task_queue=queue,
            search_attributes=initial_search_attributes("sim", "node-0001", machine_id),
        )
        await env.sleep(timedelta(seconds=1))
        assert (await handle.query(MachineWorkflow.status)).stage is MachineStage.WATCHING
        assert await upserted_stages(handle) == ["AGENT_STARTING", "WATCHING"]
        await handle.terminate()

        # A first run's input of before carries no such promise, and its run upserts at its start as it did.
        older = await start_machine(env, queue, FAST)
        await env.sleep(timedelta(seconds=1))
        assert await upserted_stages(older) == ["PROVISIONING", "AGENT_STARTING", "WATCHING"]
        await older.terminate()
