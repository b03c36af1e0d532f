"""Temporal Cloud's billable actions, counted from workflow histories and from the server's request counters.

The counting follows Temporal Cloud's published list of actions (docs.temporal.io/cloud/actions; which version is
said in docs/benchmarks.md):

  workflow started          every run's WorkflowExecutionStarted: a client's start, a continue-as-new, a child's
  schedule run              two more for a run its schedule started (three in all with the start)
  activity started          every ActivityTaskScheduled
  activity retried          each attempt after the first, from ActivityTaskStarted's attempt
  timer started             every TimerStarted, the SDK's implicit ones (a condition's timeout) among them
  signal                    every WorkflowExecutionSignaled, from a client or another workflow
  update                    every accepted update (a rejected one leaves no event: see the request counters)
  search attributes         every UpsertWorkflowSearchAttributes, one however many attributes it sets, except
                            one that sets TemporalChangeVersion alone (versioning: exempt)
  markers                   the markers of one workflow task count once (side effects, local activities; the
                            SDK's patch markers too, which makes this an upper bound)
  child workflow            the parent's StartChildWorkflowExecutionInitiated (the child's start counts in its own
                            history: two in all)
  options updated           every WorkflowExecutionOptionsUpdated

Billed but written to no history: queries, recorded activity heartbeats and rejected updates. Those are read from
the frontend's request counters (its Prometheus text) over the same span instead.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import History, HistoryEvent

WORKFLOW_STARTED = "workflow started"
SCHEDULE_RUN = "schedule run"
ACTIVITY_STARTED = "activity started"
ACTIVITY_RETRIED = "activity retried"
TIMER_STARTED = "timer started"
SIGNAL = "signal"
UPDATE = "update"
SEARCH_ATTRIBUTES = "search attributes"
MARKERS = "markers"
CHILD_WORKFLOW = "child workflow"
OPTIONS_UPDATED = "options updated"

# What the schedule sets on the runs it starts; a schedule run costs two actions besides the workflow start.
SCHEDULED_BY = "TemporalScheduledById"
SCHEDULE_ACTIONS = 2
CHANGE_VERSION = "TemporalChangeVersion"

# Frontend requests that are billed yet leave no event: queries answered by a worker, activity heartbeats that
# reached the server (the SDK throttles the rest), updates (a rejected one is billed too).
QUERY_REQUESTS = ("QueryWorkflow",)
HEARTBEAT_REQUESTS = ("RecordActivityTaskHeartbeat", "RecordActivityTaskHeartbeatById")
UPDATE_REQUESTS = ("UpdateWorkflowExecution",)

_ONE_EACH = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED: ACTIVITY_STARTED,
    EventType.EVENT_TYPE_TIMER_STARTED: TIMER_STARTED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED: SIGNAL,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED: UPDATE,
    EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED: CHILD_WORKFLOW,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_OPTIONS_UPDATED: OPTIONS_UPDATED,
}


def billable_actions(events: Iterable[HistoryEvent]) -> Counter[str]:
    """The billable actions the events record, by kind; kinds with none are absent."""
    actions: Counter[str] = Counter()
    marked_tasks: set[int] = set()
    for event in events:
        kind = event.event_type
        if kind in _ONE_EACH:
            actions[_ONE_EACH[kind]] += 1
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            actions[WORKFLOW_STARTED] += 1
            started = event.workflow_execution_started_event_attributes
            if SCHEDULED_BY in started.search_attributes.indexed_fields:
                actions[SCHEDULE_RUN] += SCHEDULE_ACTIONS
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            # The started event is written once the attempt ends, with that attempt's number: earlier attempts
            # of the same activity were retries.
            retries = event.activity_task_started_event_attributes.attempt - 1
            if retries > 0:
                actions[ACTIVITY_RETRIED] += retries
        elif kind == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            if set(fields) - {CHANGE_VERSION}:
                actions[SEARCH_ATTRIBUTES] += 1
        elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
            task = event.marker_recorded_event_attributes.workflow_task_completed_event_id
            if task not in marked_tasks:
                marked_tasks.add(task)
                actions[MARKERS] += 1
    return actions


def history_bytes(events: Iterable[HistoryEvent]) -> int:
    """The history's size serialized as the server returns it: the events and their framing."""
    return History(events=list(events)).ByteSize()


def event_bytes(events: Iterable[HistoryEvent]) -> int:
    """The sum of the events' own serialized sizes."""
    return sum(event.ByteSize() for event in events)


_REQUESTS = re.compile(r"^service_requests\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def frontend_requests(metrics: str, namespace: str = "default") -> Counter[str]:
    """Requests the frontend served for the namespace, by operation, from the server's Prometheus text."""
    requests: Counter[str] = Counter()
    for line in metrics.splitlines():
        found = _REQUESTS.match(line)
        if found is None:
            continue
        labels = dict(_LABEL.findall(found["labels"]))
        if labels.get("service_name") != "frontend" or labels.get("namespace") != namespace:
            continue
        requests[labels.get("operation", "")] += int(float(found["value"]))
    return requests


def unrecorded_actions(before: Counter[str], after: Counter[str]) -> Counter[str]:
    """Billed requests between two readings of frontend_requests that leave no event (updates are counted from
    their events; the update requests beyond them were rejected or retried, given apart)."""
    served = after - before
    return Counter(
        {
            "queries": sum(served[name] for name in QUERY_REQUESTS),
            "recorded heartbeats": sum(served[name] for name in HEARTBEAT_REQUESTS),
            "update requests": sum(served[name] for name in UPDATE_REQUESTS),
        }
    )
