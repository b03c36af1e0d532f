"""The fleet schedules: one per provider instance, made by workers, overlap SKIP, in step with settings, pause kept."""

from datetime import timedelta

import pytest
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    ScheduleSpec,
    ScheduleState,
)
from temporalio.service import RPCError

from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from lifecycle.contracts import FLEET_WORKFLOW_TYPE, LEGACY_FLEET_SCHEDULE_ID, fleet_schedule_id
from lifecycle.inputs import fleet_input
from processes.worker import ensure_fleet_schedules


async def create_paused_legacy_schedule(client: Client, settings: Settings, provider: str) -> None:
    """The one schedule of a Shepherd before provider instances, paused by an operator."""
    old = Schedule(
        action=ScheduleActionStartWorkflow(
            FLEET_WORKFLOW_TYPE, fleet_input(settings, provider), id="old", task_queue=settings.task_queue
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(minutes=1))]),
        state=ScheduleState(paused=True, note="rack maintenance"),
    )
    await client.create_schedule(LEGACY_FLEET_SCHEDULE_ID, old)


async def test_schedule_is_created_then_updated_keeping_an_operators_pause(temporal_client):
    settings = Settings(task_queue="schedule-test", reconcile_interval=60.0)
    await ensure_fleet_schedules(temporal_client, settings)
    handle = temporal_client.get_schedule_handle(fleet_schedule_id("sim"))
    described = await handle.describe()
    assert described.schedule.policy.overlap is ScheduleOverlapPolicy.SKIP
    assert described.schedule.spec.intervals[0].every == timedelta(minutes=1)
    action = described.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow) and action.workflow == FLEET_WORKFLOW_TYPE

    await handle.pause(note="maintenance")
    await ensure_fleet_schedules(temporal_client, settings.replace(reconcile_interval=30.0, chunk_size=5))
    described = await handle.describe()
    assert described.schedule.state.paused and described.schedule.state.note == "maintenance"
    assert described.schedule.spec.intervals[0].every == timedelta(seconds=30)
    assert isinstance(described.schedule.action, ScheduleActionStartWorkflow)
    await handle.delete()


async def test_each_provider_instance_gets_a_schedule_and_the_old_one_hands_over_its_pause(temporal_client):
    settings = Settings(
        task_queue="schedules-test",
        providers=(ProviderInstance("rack1", "static"), ProviderInstance("rack2", "static")),
    )
    await create_paused_legacy_schedule(temporal_client, settings, "rack1")

    await ensure_fleet_schedules(temporal_client, settings)
    for name in ("rack1", "rack2"):
        handle = temporal_client.get_schedule_handle(fleet_schedule_id(name))
        described = await handle.describe()
        assert described.schedule.state.paused and described.schedule.state.note == "rack maintenance"
        action = described.schedule.action
        assert isinstance(action, ScheduleActionStartWorkflow) and action.id == fleet_schedule_id(name)
        await handle.delete()
    with pytest.raises(RPCError):
        await temporal_client.get_schedule_handle(LEGACY_FLEET_SCHEDULE_ID).describe()


async def test_a_new_schedule_starts_its_first_pass_at_once_and_an_existing_or_paused_one_does_not(temporal_client):
    settings = Settings(
        task_queue="first-pass-test", reconcile_interval=7 * 86400.0, providers=(ProviderInstance("fresh", "static"),)
    )
    handle = temporal_client.get_schedule_handle(fleet_schedule_id("fresh"))
    try:
        # A pass a week: only the trigger at creation can have started one.
        await ensure_fleet_schedules(temporal_client, settings, first_pass_now=True)
        assert (await handle.describe()).info.num_actions == 1
        await ensure_fleet_schedules(temporal_client, settings, first_pass_now=True)
        described = await handle.describe()
        assert described.info.num_actions == 1, "a worker's restart starts no pass"
        # No worker polls this test's queue: the pass would wait out its hour.
        for running in described.info.running_actions:
            await temporal_client.get_workflow_handle(running.workflow_id).terminate()
    finally:
        await handle.delete()
    paused = Settings(
        task_queue="first-pass-test", reconcile_interval=7 * 86400.0, providers=(ProviderInstance("held", "static"),)
    )
    await create_paused_legacy_schedule(temporal_client, paused, "held")
    handle = temporal_client.get_schedule_handle(fleet_schedule_id("held"))
    try:
        await ensure_fleet_schedules(temporal_client, paused, first_pass_now=True)
        described = await handle.describe()
        assert described.schedule.state.paused and described.info.num_actions == 0
    finally:
        await handle.delete()
