"""bench.billable_actions: Temporal Cloud's billable actions counted from histories and from request counters."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload, SearchAttributes
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory

from bench.billable_actions import (
    ACTIVITY_RETRIED,
    ACTIVITY_STARTED,
    CHILD_WORKFLOW,
    MARKERS,
    SCHEDULE_RUN,
    SEARCH_ATTRIBUTES,
    SIGNAL,
    TIMER_STARTED,
    UPDATE,
    WORKFLOW_STARTED,
    billable_actions,
    event_bytes,
    frontend_requests,
    history_bytes,
    unrecorded_actions,
)
from bench.temporal_bill import Assumptions, Bill

HISTORIES = Path(__file__).parent / "histories"
E = EventType


def attributes(*names: str) -> SearchAttributes:
    return SearchAttributes(indexed_fields={name: Payload(data=b'"x"') for name in names})


def event(kind: EventType.ValueType, **attributes: object) -> HistoryEvent:
    built = HistoryEvent(event_type=kind)
    for name, value in attributes.items():
        getattr(built, name).CopyFrom(value)
    return built


def started(*search_attributes: str) -> HistoryEvent:
    built = event(E.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    built.workflow_execution_started_event_attributes.search_attributes.CopyFrom(attributes(*search_attributes))
    return built


def activity_started(attempt: int) -> HistoryEvent:
    built = event(E.EVENT_TYPE_ACTIVITY_TASK_STARTED)
    built.activity_task_started_event_attributes.attempt = attempt
    return built


def upsert(*names: str) -> HistoryEvent:
    built = event(E.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES)
    built.upsert_workflow_search_attributes_event_attributes.search_attributes.CopyFrom(attributes(*names))
    return built


def marker(task: int) -> HistoryEvent:
    built = event(E.EVENT_TYPE_MARKER_RECORDED)
    built.marker_recorded_event_attributes.workflow_task_completed_event_id = task
    return built


def test_a_history_is_counted_by_temporal_clouds_list() -> None:
    history = [
        started("MachineStage"),
        event(E.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED),
        event(E.EVENT_TYPE_WORKFLOW_TASK_STARTED),
        event(E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED),
        upsert("MachineStage", "Provider"),
        upsert("TemporalChangeVersion"),
        marker(4),
        marker(4),
        event(E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED),
        activity_started(3),
        event(E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED),
        event(E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED),
        activity_started(1),
        event(E.EVENT_TYPE_ACTIVITY_TASK_FAILED),
        event(E.EVENT_TYPE_TIMER_STARTED),
        event(E.EVENT_TYPE_TIMER_FIRED),
        marker(17),
        event(E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED),
        event(E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED),
        event(E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED),
        event(E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED),
        event(E.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED),
        event(E.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED),
        event(E.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED),
        event(E.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW),
    ]
    assert billable_actions(history) == Counter(
        {
            WORKFLOW_STARTED: 1,
            SEARCH_ATTRIBUTES: 1,  # the versioning upsert is exempt
            MARKERS: 2,  # one a workflow task
            ACTIVITY_STARTED: 2,
            ACTIVITY_RETRIED: 2,  # the first activity's attempts 2 and 3
            TIMER_STARTED: 1,
            SIGNAL: 2,
            UPDATE: 1,
            CHILD_WORKFLOW: 1,
        }
    )


def test_a_run_its_schedule_started_costs_the_schedules_two_actions_more() -> None:
    assert billable_actions([started("TemporalScheduledById", "TemporalScheduledStartTime")]) == Counter(
        {WORKFLOW_STARTED: 1, SCHEDULE_RUN: 2}
    )
    assert billable_actions([started()]) == Counter({WORKFLOW_STARTED: 1})


def test_a_recorded_fleet_pass_counts_its_start_activities_and_timer() -> None:
    recorded = WorkflowHistory.from_json("fleet-pass", (HISTORIES / "fleet-pass-admits.json").read_text())
    # Recorded from a test's client start, not a schedule's: no schedule run.
    assert billable_actions(recorded.events) == Counter({WORKFLOW_STARTED: 1, ACTIVITY_STARTED: 5, TIMER_STARTED: 1})
    assert history_bytes(recorded.events) >= event_bytes(recorded.events) > 0


def test_unrecorded_actions_come_from_the_frontends_request_counters() -> None:
    def metrics(queries: int, heartbeats: int, updates: int) -> str:
        return "\n".join(
            [
                "# HELP service_requests service_requests counter",
                "# TYPE service_requests counter",
                f'service_requests{{namespace="default",operation="QueryWorkflow",service_name="frontend"}} {queries}',
                'service_requests{namespace="default",operation="RecordActivityTaskHeartbeat",'
                f'service_name="frontend"}} {heartbeats}',
                f'service_requests{{namespace="default",operation="UpdateWorkflowExecution",service_name="frontend"}} '
                f"{updates}",
                # The history service's side of the same calls, and another namespace's: not counted again.
                f'service_requests{{namespace="default",operation="QueryWorkflow",service_name="history"}} {queries}',
                f'service_requests{{namespace="other",operation="QueryWorkflow",service_name="frontend"}} {queries}',
                'service_requests_total{namespace="default",operation="QueryWorkflow",service_name="frontend"} 99',
            ]
        )

    before, after = frontend_requests(metrics(2, 10, 1)), frontend_requests(metrics(5, 14, 3))
    assert before["QueryWorkflow"] == 2
    assert unrecorded_actions(before, after) == Counter({"queries": 3, "recorded heartbeats": 4, "update requests": 2})


def measured(**fields: Any) -> Bill:
    """A bill measured with a pass a minute over five minutes, projected to a pass every 15 minutes."""
    return Bill(
        reconcile_interval=900.0,
        pass_interval=60.0,
        healthy_seconds=300.0,
        assumptions=Assumptions(recoveries=0.0, maintenance_rounds=0.0, retention_days=30.0),
        **fields,
    )


def test_the_day_is_projected_at_the_default_pass_interval_not_the_measured_one() -> None:
    # Measured with a pass a minute over five minutes; an installation passes every 15 minutes.
    bill = measured(
        machines=50,
        healthy_machine_actions={SIGNAL: 50},
        passes_in_healthy=5,
        pass_actions={WORKFLOW_STARTED: 1.0, SCHEDULE_RUN: 2.0, ACTIVITY_STARTED: 3.0, MARKERS: 1.0},
        pass_run_bytes=[4000, 6000],
    )
    assert bill.passes_a_day == 96
    assert bill.fleet_pass_a_day() == 7 * 96
    # Each machine's one signal in 300 s is 288 a day; the passes' 672 actions are shared among the fleet.
    assert bill.healthy_a_day(10_000) == pytest.approx(288 + 672 / 10_000)
    month = bill.month(10_000)
    assert month["actions"] == pytest.approx(30 * 672 + 30 * 10_000 * 288)
    assert month["retained_bytes"] == pytest.approx(96 * 5000 * 30)
    assert not bill.goal_met()
    assert Bill(**{**vars(bill), "healthy_machine_actions": {}}).goal_met()


def test_a_bring_up_counts_the_takeovers_recorded_heartbeats_beside_its_workflow() -> None:
    bill = measured(
        machines=2,
        bringup_actions={WORKFLOW_STARTED: 2, ACTIVITY_STARTED: 4},
        bringup_unrecorded={"recorded heartbeats": 2, "update requests": 1},
    )
    # Three actions of each machine's workflow, and its takeover's heartbeat; no update is a bring-up's.
    assert bill.bringup_per_machine == 4.0


def test_a_recovery_counts_its_recorded_heartbeats_and_queries_beside_its_workflow() -> None:
    bill = measured(
        machines=2,
        recovery_actions={SIGNAL: 1, ACTIVITY_STARTED: 3},
        recovery_unrecorded={"recorded heartbeats": 2, "queries": 1, "update requests": 0},
    )
    assert bill.per_recovery == 7
