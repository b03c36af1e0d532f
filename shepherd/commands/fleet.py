"""``shepherd fleet``: each provider instance's fleet schedule and its last passes; pause, resume, trigger."""

from __future__ import annotations

import argparse
import asyncio
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from bmdb.store import BMDB, BMDBUnavailable
from foundation.settings import Settings, format_duration
from foundation.startup import connect_temporal
from lifecycle.contracts import FLEET_WORKFLOW_TYPE, fleet_schedule_id
from shepherd.commands.base import (
    CommandError,
    Subcommands,
    UsageError,
    add_by,
    add_common,
    no_temporal,
    operator,
    positive_int,
    reason_arg,
    show,
    with_bmdb,
)


class FleetError(Exception):
    """The fleet schedule is missing or could not be changed; the message says why."""


@dataclass(frozen=True)
class FleetAction:
    """What ``shepherd fleet`` was asked to do to the schedule (pause, resume, trigger), with the note and who."""

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


async def log_fleet_action(bmdb: BMDB, providers: Sequence[str], action: FleetAction) -> None:
    """Record a pause, resume or trigger of each provider's schedule as a fleet event naming who asked."""
    if action.event_kind is None:
        return
    for provider in providers:
        detail = f"provider {provider}: by {action.by}" + (f": {action.note}" if action.note else "")
        await bmdb.add_event(None, action.event_kind, detail)


@dataclass(frozen=True)
class FleetPass:
    """One fleet pass as ``shepherd fleet`` shows it: when it started, how it ended, its result and why."""

    started_at: datetime | None
    outcome: str  # running, completed, refused, failed, ...
    result: dict[str, Any]  # FleetPassResult as JSON; empty while running or when nothing came back
    why: str | None = None


async def apply(client: Client, provider: str, action: FleetAction) -> str | None:
    """Pause, resume or trigger the provider's fleet schedule; what was done, for the operator."""
    schedule_id = fleet_schedule_id(provider)
    handle = client.get_schedule_handle(schedule_id)
    note = f"{action.note or 'no note'} (by {action.by})"
    try:
        if action.pause:
            await handle.pause(note=note)
            return f"paused the fleet schedule {schedule_id}: no passes until `shepherd fleet --resume`"
        if action.resume:
            await handle.unpause(note=note)
            return f"resumed the fleet schedule {schedule_id}"
        if action.trigger:
            await handle.trigger()
            return f"started a fleet pass of {provider} now"
    except RPCError as error:
        raise _schedule_error(schedule_id, error) from None
    return None


def _schedule_error(schedule_id: str, error: RPCError) -> FleetError:
    if error.status == RPCStatusCode.NOT_FOUND:
        return FleetError(f"there is no fleet schedule {schedule_id!r} yet: a worker creates it when it starts")
    return FleetError(f"cannot reach the fleet schedule {schedule_id!r}: {error}")


async def schedule_line(client: Client, provider: str) -> tuple[str, dict[str, Any]]:
    """The schedule's state in one line, and as facts for --json."""
    schedule_id = fleet_schedule_id(provider)
    try:
        description = await client.get_schedule_handle(schedule_id).describe()
    except RPCError as error:
        raise _schedule_error(schedule_id, error) from None
    state = description.schedule.state
    intervals = description.schedule.spec.intervals
    every = f"every {format_duration(intervals[0].every.total_seconds())}" if intervals else "on its own calendar"
    upcoming = description.info.next_action_times[:1]
    facts = {
        "schedule_id": schedule_id,
        "paused": state.paused,
        "note": state.note or None,
        "interval_seconds": intervals[0].every.total_seconds() if intervals else None,
        "next_pass_at": upcoming[0].isoformat() if upcoming and not state.paused else None,
    }
    if state.paused:
        line = f"schedule {schedule_id}: PAUSED ({state.note or 'no note'}), {every}"
    else:
        next_pass = f", next pass {_clock(upcoming[0])}" if upcoming else ""
        line = f"schedule {schedule_id}: running, {every}{next_pass}"
    return line, facts


async def last_passes(client: Client, provider: str, count: int) -> list[FleetPass]:
    """The provider's most recent passes, newest first; a pass runs under its schedule's id and a timestamp."""
    passes = []
    query = f'WorkflowType = "{FLEET_WORKFLOW_TYPE}" AND WorkflowId STARTS_WITH "{fleet_schedule_id(provider)}-"'
    async for execution in client.list_workflows(query, limit=count):
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        status = execution.status
        if status == WorkflowExecutionStatus.RUNNING:
            passes.append(FleetPass(execution.start_time, "running", {}))
            continue
        try:
            result = await handle.result(follow_runs=False)
            passes.append(FleetPass(execution.start_time, "completed", result if isinstance(result, dict) else {}))
        except WorkflowFailureError as failure:
            passes.append(_failed_pass(execution.start_time, failure))
    passes.sort(key=lambda p: p.started_at or datetime.min, reverse=True)
    return passes


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


async def release_recoveries(bmdb: BMDB, providers: Sequence[str], by: str, reason: str) -> list[str]:
    """Let each provider's held recoveries go ahead until its silence ends; a line for the operator each."""
    lines = []
    for provider in providers:
        hold, released = await bmdb.release_recoveries(provider, by=by, reason=reason)
        if hold is None:
            lines.append(f"provider {provider}: no recoveries are held")
        elif released:
            lines.append(
                f"provider {provider}: released the recoveries held since {_clock(hold.held_since)} "
                f"({hold.silent_count} machines silent): the next pass signals them"
            )
        else:
            lines.append(
                f"provider {provider}: already released by {hold.released_by} at {_clock(hold.released_at)}: "
                f"{hold.release_reason}"
            )
    return lines


def held_lines(passes: list[FleetPass]) -> list[str]:
    """What the newest pass with a result says of held recoveries; nothing when none are held."""
    newest = next((p.result for p in passes if p.result), {})
    hold = newest.get("recoveries_held")
    if not hold:
        return []
    lines = textwrap.wrap(
        f"RECOVERIES HELD since {hold['since'][:19].replace('T', ' ')}: {hold['reason']}",
        80,
        subsequent_indent="  ",
    )
    lines += textwrap.wrap(
        ", ".join(hold["sample"]) + (" ..." if hold["silent_count"] > len(hold["sample"]) else ""),
        80,
        initial_indent="  silent: ",
        subsequent_indent="          ",
    )
    if hold.get("released_at"):
        lines.append(f"  released by {hold['released_by']}: {hold['release_reason']}")
    else:
        lines.append(f"  once the cause is known: shepherd fleet --release-recoveries --provider {hold['provider']} \\")
        lines.append('      --reason "..."')
    return lines


def _clock(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def format_passes(passes: list[FleetPass]) -> list[str]:
    """80 columns: one line a pass, and a line for why it failed or whom it found silent."""
    row = "{:<19} {:<9} {:>8} {:>6} {:>8} {:>9} {:>6}"
    lines = [row.format("PASS STARTED (UTC)", "OUTCOME", "PROVIDER", "BMDB", "ADMITTED", "WORKFLOWS", "SILENT")]
    for fleet_pass in passes:
        result = fleet_pass.result
        plan = result.get("plan") or {}
        lines.append(
            row.format(
                _clock(fleet_pass.started_at),
                fleet_pass.outcome,
                plan.get("provider_count", "-"),
                plan.get("bmdb_count", "-"),
                len(result.get("admitted", [])) if result else "-",
                result.get("workflows_started", "-"),
                len(result.get("silent", [])) if result else "-",
            )
        )
        if fleet_pass.why:
            lines += textwrap.wrap(fleet_pass.why, 80, initial_indent="  why: ", subsequent_indent="       ")
        if result.get("silent"):
            silent = ", ".join(result["silent"])
            lines += textwrap.wrap(silent, 80, initial_indent="  silent: ", subsequent_indent="          ")
        if result.get("spared_after_hold"):
            spared = result["spared_after_hold"]
            lines.append(f"  spared: {spared} silent since before a hold ended, given time to come back")
    if len(lines) == 1:
        lines.append("(no passes yet)")
    return lines


async def print_fleet(
    client: Client,
    providers: Sequence[str],
    action: FleetAction,
    *,
    passes: int = 5,
    as_json: bool = False,
    out: TextIO | None = None,
    told: Sequence[str] = (),
) -> int:
    """Apply the action to each provider's schedule, then show each schedule, held recoveries and its last passes.

    told: lines about what was done before (released recoveries), printed first.
    """
    documents: list[dict[str, Any]] = []
    lines: list[str] = [*told]
    for provider in providers:
        done = await apply(client, provider, action)
        line, facts = await schedule_line(client, provider)
        recent = await last_passes(client, provider, passes)
        rows = [
            {
                "started_at": p.started_at.isoformat() if p.started_at else None,
                "outcome": p.outcome,
                "why": p.why,
                "result": p.result,
            }
            for p in recent
        ]
        held = next((p.result.get("recoveries_held") for p in recent if p.result), None)
        documents.append({"provider": provider, "schedule": facts, "recoveries_held": held, "passes": rows})
        lines += [
            *([""] if lines else []),
            *([done] if done else []),
            line,
            *held_lines(recent),
            *format_passes(recent),
        ]
    return show(out, as_json, lambda: {"providers": documents}, lambda: lines)


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("fleet", help="the fleet schedule and its last passes; pause, resume, trigger")
    add_common(parser)
    change = parser.add_mutually_exclusive_group()
    change.add_argument("--pause", action="store_true", help="stop scheduling passes (machines keep their workflows)")
    change.add_argument("--resume", action="store_true", help="schedule passes again")
    change.add_argument("--trigger", action="store_true", help="run a pass now")
    change.add_argument(
        "--release-recoveries",
        action="store_true",
        help="let the recoveries the watchdog holds go ahead, until the silence ends (needs --reason)",
    )
    parser.add_argument("--note", default="", help="why, kept with the schedule's state (with --pause/--resume)")
    parser.add_argument("--reason", type=reason_arg, help="why the held recoveries may go ahead, for the record")
    add_by(parser)
    parser.add_argument("--provider", help="only this provider instance's schedule (default: every one)")
    parser.add_argument(
        "--passes", type=positive_int, default=5, help="how many recent passes to show (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    if args.note and not (args.pause or args.resume):
        raise UsageError("--note goes with --pause or --resume")
    if args.release_recoveries and args.reason is None:
        raise UsageError("--release-recoveries needs --reason: why the held recoveries may go ahead")
    if args.reason is not None and not args.release_recoveries:
        raise UsageError("--reason goes with --release-recoveries")
    if args.by is not None and not (args.pause or args.resume or args.trigger or args.release_recoveries):
        raise UsageError("--by goes with --pause, --resume, --trigger or --release-recoveries")
    by = args.by or operator()
    action = FleetAction(pause=args.pause, resume=args.resume, trigger=args.trigger, note=args.note, by=by)
    providers = [instance.name for instance in settings.provider_instances]
    if args.provider is not None:
        providers = [settings.provider_instance(args.provider).name]

    async def show(client: Client, told: Sequence[str] = ()) -> int:
        return await print_fleet(client, providers, action, passes=args.passes, as_json=args.json, told=told)

    async def release(client: Client, bmdb: BMDB) -> int:
        return await show(client, await release_recoveries(bmdb, providers, by, args.reason))

    async def connected() -> Client:
        return await connect_temporal(settings)

    async def show_only() -> int:
        return await show(await connected())

    if args.release_recoveries:
        # BMDB is opened only to release: pausing must work while BMDB is down.
        return with_bmdb(settings, connected, release, FleetError)
    try:
        code = asyncio.run(show_only())
    except FleetError as error:
        raise CommandError(str(error)) from None
    if action.event_kind is not None:
        try:
            with_bmdb(settings, no_temporal, lambda _, bmdb: log_fleet_action(bmdb, providers, action))
        except BMDBUnavailable as error:
            # Done is done: the schedule's note keeps who asked.
            print(f"not recorded in BMDB's event log: {error}", file=sys.stderr)
    return code
