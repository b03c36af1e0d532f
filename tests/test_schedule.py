"""The fleet schedule: created by workers, overlap SKIP, kept in line with settings, pause kept."""

from datetime import timedelta

from temporalio.client import ScheduleActionStartWorkflow, ScheduleOverlapPolicy

from foundation.settings import Settings
from lifecycle.contracts import FLEET_SCHEDULE_ID, FLEET_WORKFLOW_TYPE
from processes.worker import ensure_fleet_schedule


async def test_schedule_is_created_then_updated_keeping_an_operators_pause(temporal_client):
    settings = Settings(task_queue="schedule-test", reconcile_interval=60.0)
    await ensure_fleet_schedule(temporal_client, settings)
    handle = temporal_client.get_schedule_handle(FLEET_SCHEDULE_ID)
    described = await handle.describe()
    assert described.schedule.policy.overlap is ScheduleOverlapPolicy.SKIP
    assert described.schedule.spec.intervals[0].every == timedelta(minutes=1)
    action = described.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow) and action.workflow == FLEET_WORKFLOW_TYPE

    await handle.pause(note="maintenance")
    await ensure_fleet_schedule(temporal_client, settings.replace(reconcile_interval=30.0, chunk_size=5))
    described = await handle.describe()
    assert described.schedule.state.paused and described.schedule.state.note == "maintenance"
    assert described.schedule.spec.intervals[0].every == timedelta(seconds=30)
    assert isinstance(described.schedule.action, ScheduleActionStartWorkflow)
    await handle.delete()
