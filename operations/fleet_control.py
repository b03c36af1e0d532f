"""What an operator does to a provider instance's fleet: its schedule paused, resumed or triggered, its last
passes read, the recoveries its watchdog holds released."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from lifecycle.contracts import FLEET_WORKFLOW_TYPE, fleet_schedule_id
from operations.connections import Connections, OperatorError


class FleetError(OperatorError):
    """The fleet schedule is missing or could not be changed; the message says why."""


@dataclass(frozen=True)
class FleetAction:
    """What an operator asks of a fleet schedule (pause, resume, trigger), with the note and who asked."""

    pause: bool = False
    resume: bool = False
    trigger: bool = False
    note: str = ""
    by: str = "unknown"

    @property
    def event_kind(self) -> str | None:
        """The fleet event that records this action in BMDB; None when it changes nothing."""
        if self.pause:
            return "fleet_paused"
        if self.resume:
            return "fleet_resumed"
        return "fleet_triggered" if self.trigger else None


@dataclass(frozen=True)
class FleetPass:
    """One fleet pass: when it started, how it ended, its result and why."""

    started_at: datetime | None
    outcome: str  # running, completed, refused, failed, ...
    result: dict[str, Any]  # FleetPassResult as JSON; empty while running or when nothing came back
    why: str | None = None


@dataclass(frozen=True)
class ScheduleState:
    """A fleet schedule as Temporal describes it."""

    schedule_id: str
    paused: bool
    note: str
    interval_seconds: float | None  # None for a schedule on a calendar of its own
    next_pass_at: datetime | None


@dataclass(frozen=True)
class HoldRelease:
    """What releasing a provider's held recoveries found: no hold, a hold released now, or one released before."""

    provider: str
    held_since: datetime | None = None
    silent_count: int = 0
    released_now: bool = False
    released_by: str | None = None
    released_at: datetime | None = None
    release_reason: str | None = None
    # For a hold released now: whether its provider's pass was started at once (True), not, its schedule being
    # paused (False), or could not be (None: no schedule yet, or Temporal did not answer).
    pass_started: bool | None = None


class FleetControl(Connections):
    """The fleet schedules in Temporal and the holds in BMDB."""

    async def apply(self, provider: str, action: FleetAction) -> bool:
        """Pause, resume or trigger the provider's fleet schedule; whether the action changed anything."""
        schedule_id = fleet_schedule_id(provider)
        handle = (await self.temporal()).get_schedule_handle(schedule_id)
        note = f"{action.note or 'no note'}; by {self.credited(action.by)}"
        try:
            if action.pause:
                await handle.pause(note=note)
            elif action.resume:
                await handle.unpause(note=note)
            elif action.trigger:
                await handle.trigger()
            else:
                return False
        except RPCError as error:
            raise _schedule_error(schedule_id, error) from None
        return True

    async def schedule(self, provider: str) -> ScheduleState:
        """The provider's fleet schedule now; FleetError when there is none or Temporal cannot be asked."""
        schedule_id = fleet_schedule_id(provider)
        try:
            description = await (await self.temporal()).get_schedule_handle(schedule_id).describe()
        except RPCError as error:
            raise _schedule_error(schedule_id, error) from None
        state = description.schedule.state
        intervals = description.schedule.spec.intervals
        upcoming = description.info.next_action_times[:1]
        return ScheduleState(
            schedule_id,
            state.paused,
            state.note or "",
            intervals[0].every.total_seconds() if intervals else None,
            upcoming[0] if upcoming else None,
        )

    async def last_passes(self, provider: str, count: int) -> list[FleetPass]:
        """The provider's most recent passes, newest first; a pass runs under its schedule's id and a timestamp."""
        client = await self.temporal()
        passes = []
        query = f'WorkflowType = "{FLEET_WORKFLOW_TYPE}" AND WorkflowId STARTS_WITH "{fleet_schedule_id(provider)}-"'
        async for execution in client.list_workflows(query, limit=count):
            handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
            if execution.status == WorkflowExecutionStatus.RUNNING:
                passes.append(FleetPass(execution.start_time, "running", {}))
                continue
            try:
                result = await handle.result(follow_runs=False)
                passes.append(FleetPass(execution.start_time, "completed", result if isinstance(result, dict) else {}))
            except WorkflowFailureError as failure:
                passes.append(_failed_pass(execution.start_time, failure))
        passes.sort(key=lambda p: p.started_at or datetime.min, reverse=True)
        return passes

    async def release_recoveries(self, providers: Sequence[str], by: str, reason: str) -> list[HoldRelease]:
        """Let each provider's held recoveries go ahead until its silence ends."""
        bmdb = await self.bmdb()
        releases = []
        for provider in providers:
            hold, released = await bmdb.release_recoveries(provider, by=self.credited(by), reason=reason)
            if hold is None:
                releases.append(HoldRelease(provider))
                continue
            releases.append(
                HoldRelease(
                    provider,
                    hold.held_since,
                    hold.silent_count,
                    released,
                    hold.released_by,
                    hold.released_at,
                    hold.release_reason,
                    await self._pass_now(provider) if released else None,
                )
            )
        return releases

    async def _pass_now(self, provider: str) -> bool | None:
        """Start the provider's pass now, so the recoveries just released need not wait up to a reconcile interval
        for it (a rack's worth of machines is down meanwhile). Not while its schedule is paused: the pause is the
        operator's to lift. What happened, as HoldRelease.pass_started says."""
        try:
            if (await self.schedule(provider)).paused:
                return False
            await (await self.temporal()).get_schedule_handle(fleet_schedule_id(provider)).trigger()
        except (FleetError, RPCError):
            return None
        return True

    async def log_fleet_action(self, providers: Sequence[str], action: FleetAction) -> None:
        """Record a pause, resume or trigger of each provider's schedule as a fleet event naming who asked."""
        if action.event_kind is None:
            return
        bmdb = await self.bmdb()
        for provider in providers:
            detail = f"provider {provider}: by {self.credited(action.by)}" + (f": {action.note}" if action.note else "")
            await bmdb.add_event(None, action.event_kind, detail)


def _schedule_error(schedule_id: str, error: RPCError) -> FleetError:
    if error.status == RPCStatusCode.NOT_FOUND:
        return FleetError(f"there is no fleet schedule {schedule_id!r} yet: a worker creates it when it starts")
    return FleetError(f"cannot reach the fleet schedule {schedule_id!r}: {error}")


def _failed_pass(started_at: datetime | None, failure: WorkflowFailureError) -> FleetPass:
    cause = failure.cause
    result: dict[str, Any] = {}
    if isinstance(cause, ApplicationError):
        # The pass result travels as the failure's detail, so a refused pass still shows its counts.
        if cause.details and isinstance(cause.details[0], dict):
            result = cause.details[0]
        outcome = "refused" if cause.type == "ReconcileRefused" else "failed"
        return FleetPass(started_at, outcome, result, cause.message)
    return FleetPass(started_at, type(cause).__name__.lower() if cause else "failed", result, str(cause or failure))
