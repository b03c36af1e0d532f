"""The JSON an operator reads of the fleet's schedules and of the event log: what `shepherd fleet --json` and
`shepherd events --json` print and the operator API answers, written once so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from bmdb.store import Event, MachineRecord
from lifecycle.contracts import fleet_schedule_id, machine_workflow_id
from operations.fleet_control import FleetAction, FleetPass, HoldRelease, ScheduleState
from operations.machine_documents import DocumentError, read_field, read_moment, read_object


def schedule_document(state: ScheduleState) -> dict[str, Any]:
    """A fleet schedule's state; the next pass only while it runs."""
    return {
        "schedule_id": state.schedule_id,
        "paused": state.paused,
        "note": state.note or None,
        "interval_seconds": state.interval_seconds,
        "next_pass_at": state.next_pass_at.isoformat() if state.next_pass_at and not state.paused else None,
    }


def provider_document(provider: str, state: ScheduleState, passes: Sequence[FleetPass]) -> dict[str, Any]:
    """One provider instance's fleet: its schedule, the recoveries held as its newest pass saw them, its passes."""
    rows = [
        {
            "started_at": p.started_at.isoformat() if p.started_at else None,
            "outcome": p.outcome,
            "why": p.why,
            "result": p.result,
        }
        for p in passes
    ]
    held = next((p.result.get("recoveries_held") for p in passes if p.result), None)
    return {"provider": provider, "schedule": schedule_document(state), "recoveries_held": held, "passes": rows}


def events_document(record: MachineRecord | None, events: Sequence[Event]) -> dict[str, Any]:
    """The event log of one machine (record), or a listing across machines (None), whose events name theirs."""
    return {
        "machine_id": None if record is None else str(record.machine_id),
        "provider_id": None if record is None else record.provider_id,
        "workflow_id": None if record is None else machine_workflow_id(record.provider, record.provider_id),
        "events": [
            {"at": e.at.isoformat(), "kind": e.kind, "detail": e.detail}
            | ({"provider_id": e.provider_id} if record is None else {})
            for e in events
        ],
    }


def schedule_from_document(document: object) -> ScheduleState:
    """schedule_document read back; DocumentError naming what is wrong."""
    fields = read_object(document, "fleet schedule")
    interval = read_field(fields, "interval_seconds", (int, float), optional=True)
    return ScheduleState(
        schedule_id=read_field(fields, "schedule_id", str),
        paused=read_field(fields, "paused", bool),
        note=read_field(fields, "note", str, optional=True) or "",
        interval_seconds=None if interval is None else float(interval),
        next_pass_at=read_moment(fields, "next_pass_at"),
    )


def provider_from_document(document: object) -> tuple[str, ScheduleState, list[FleetPass]]:
    """provider_document read back: the provider instance, its schedule and its passes (the recoveries held are
    in the newest pass's result, where the document took them from)."""
    fields = read_object(document, "provider's fleet")
    passes = read_field(fields, "passes", list)
    return (
        read_field(fields, "provider", str),
        schedule_from_document(read_field(fields, "schedule", dict)),
        [_pass_from_document(p) for p in passes],
    )


def _pass_from_document(document: object) -> FleetPass:
    fields = read_object(document, "fleet pass")
    return FleetPass(
        started_at=read_moment(fields, "started_at"),
        outcome=read_field(fields, "outcome", str),
        result=read_field(fields, "result", dict),
        why=read_field(fields, "why", str, optional=True),
    )


def events_from_document(document: object) -> tuple[str | None, list[Event]]:
    """events_document read back: the heading naming the machine (None for a listing across machines) and the
    events, newest first."""
    fields = read_object(document, "event log")
    machine_id = read_field(fields, "machine_id", str, optional=True)
    heading = None
    if machine_id is not None:
        provider_id, workflow_id = read_field(fields, "provider_id", str), read_field(fields, "workflow_id", str)
        heading = machine_heading(provider_id, workflow_id, machine_id)
    events = []
    for entry in read_field(fields, "events", list):
        event = read_object(entry, "event")
        at = read_moment(event, "at")
        if at is None:
            raise DocumentError("an event's field 'at' is null")
        provider_id = read_field(event, "provider_id", str, optional=True) if machine_id is None else None
        events.append(Event(None, at, read_field(event, "kind", str), read_field(event, "detail", str), provider_id))
    return heading, events


def machine_heading(provider_id: str, workflow_id: str, machine_id: str) -> str:
    """The line an event log of one machine begins with."""
    return f"{provider_id} ({workflow_id}), BMDB machine {machine_id}"


def done_line(provider: str, action: FleetAction) -> str:
    """What an action on the provider's schedule did, for the operator."""
    schedule_id = fleet_schedule_id(provider)
    if action.pause:
        return f"paused the fleet schedule {schedule_id}: no passes until `shepherd fleet --resume`"
    if action.resume:
        return f"resumed the fleet schedule {schedule_id}"
    return f"started a fleet pass of {provider} now"


def release_lines(releases: Sequence[HoldRelease]) -> list[str]:
    """A line for the operator for each provider whose held recoveries were asked to go ahead."""
    lines = []
    for hold in releases:
        if hold.held_since is None:
            lines.append(f"provider {hold.provider}: no recoveries are held")
        elif hold.released_now:
            lines.append(
                f"provider {hold.provider}: released the recoveries held since {clock(hold.held_since)} "
                f"({hold.silent_count} machines silent): {_released_pass(hold.pass_started)}"
            )
        else:
            lines.append(
                f"provider {hold.provider}: already released by {hold.released_by} at {clock(hold.released_at)}: "
                f"{hold.release_reason}"
            )
    return lines


def _released_pass(started: bool | None) -> str:
    if started:
        return "a pass started now signals them"
    if started is False:
        return "the fleet schedule is paused: the first look after `shepherd fleet --resume` signals them"
    return "the workers' next look signals them"


def clock(at: datetime | None) -> str:
    """A moment as the fleet's lines write it: UTC to the second, or - for none."""
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else "-"
