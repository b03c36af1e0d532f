"""The fleet schedules: one per provider instance, made by workers, overlap SKIP, in step with settings, pause kept."""

from datetime import timedelta

import pytest
from temporalio.client import (
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
    # The one schedule of a Shepherd before provider instances, paused by an operator.
    old = Schedule(
        action=ScheduleActionStartWorkflow(
            FLEET_WORKFLOW_TYPE, fleet_input(settings, "rack1"), id="old", task_queue="schedules-test"
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(minutes=1))]),
        state=ScheduleState(paused=True, note="rack maintenance"),
    )
    await temporal_client.create_schedule(LEGACY_FLEET_SCHEDULE_ID, old)

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
