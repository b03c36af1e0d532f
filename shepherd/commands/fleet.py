"""``shepherd fleet``: each provider instance's fleet schedule and its last passes; pause, resume, trigger."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

from bmdb.store import BMDBUnavailable
from foundation.setting_values import format_duration
from foundation.settings import Settings
from operations.api_client import ApiOperatorClient
from operations.client import OperatorClient
from operations.documents import (
    clock,
    done_line,
    provider_document,
    provider_from_document,
    release_lines,
    schedule_document,
)
from operations.fleet_control import FleetAction, FleetPass, ScheduleState
from shepherd.commands.base import (
    EXIT_FAILURE,
    Subcommands,
    UsageError,
    add_by,
    add_common,
    operate,
    operate_api,
    operator,
    positive_int,
    reason_arg,
    show,
    through_api,
)
from shepherd.commands.bulk import confirmed

__all__ = ["FleetAction", "FleetPass", "format_passes", "held_lines", "print_fleet", "schedule_line"]


async def schedule_line(operators: OperatorClient, provider: str) -> tuple[str, dict[str, Any]]:
    """The schedule's state in one line, and as facts for --json."""
    state = await operators.schedule(provider)
    return schedule_text(state), schedule_document(state)


def schedule_text(state: ScheduleState) -> str:
    """A schedule's state in one line."""
    every = "on its own calendar"
    if state.interval_seconds is not None:
        every = f"every {format_duration(state.interval_seconds)}"
    if state.paused:
        return f"schedule {state.schedule_id}: PAUSED ({state.note or 'no note'}), {every}"
    next_pass = f", next pass {clock(state.next_pass_at)}" if state.next_pass_at else ""
    return f"schedule {state.schedule_id}: running, {every}{next_pass}"


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


def format_passes(passes: list[FleetPass]) -> list[str]:
    """80 columns: one line a pass, and a line for why it failed or whom it found silent."""
    row = "{:<19} {:<9} {:>8} {:>6} {:>8} {:>9} {:>6}"
    lines = [row.format("PASS STARTED (UTC)", "OUTCOME", "PROVIDER", "BMDB", "ADMITTED", "WORKFLOWS", "SILENT")]
    for fleet_pass in passes:
        result = fleet_pass.result
        plan = result.get("plan") or {}
        lines.append(
            row.format(
                clock(fleet_pass.started_at),
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
        if plan.get("left_alone"):
            alone = plan["left_alone"]
            told = ", ".join(
                f"{count} {why}" for why, count in sorted(alone.items(), key=lambda item: (-item[1], item[0]))
            )
            lines += textwrap.wrap(
                f"{sum(alone.values())}: {told}", 80, initial_indent="  left alone: ", subsequent_indent="    "
            )
        if result.get("spared_after_hold"):
            spared = result["spared_after_hold"]
            lines.append(f"  spared: {spared} silent since before a hold ended, given time to come back")
    if len(lines) == 1:
        lines.append("(no passes yet)")
    return lines


async def print_fleet(
    operators: OperatorClient,
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
    fleets: list[tuple[dict[str, Any], str | None]] = []
    for provider in providers:
        done = done_line(provider, action) if await operators.apply(provider, action) else None
        state = await operators.schedule(provider)
        fleets.append((provider_document(provider, state, await operators.last_passes(provider, passes)), done))
    return show_fleet(fleets, told, as_json=as_json, out=out)


def show_fleet(
    fleets: Sequence[tuple[dict[str, Any], str | None]],
    told: Sequence[str] = (),
    *,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Print each provider's fleet document (with the line saying what was done to it, if anything) after the told
    lines, whether Temporal or the operator API gave them; --json the documents alone."""
    lines: list[str] = [*told]
    for document, done in fleets:
        _, state, recent = provider_from_document(document)
        lines += [
            *([""] if lines else []),
            *([done] if done else []),
            schedule_text(state),
            *held_lines(recent),
            *format_passes(recent),
        ]
    return show(out, as_json, lambda: {"providers": [document for document, _ in fleets]}, lambda: lines)


def register(commands: Subcommands) -> None:
    """Add ``shepherd fleet`` to the commands."""
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
    parser.add_argument(
        "--yes",
        action="store_true",
        help="with --release-recoveries and no --provider: do not ask before releasing every provider instance's",
    )
    add_by(parser)
    parser.add_argument("--provider", help="only this provider instance's schedule (default: every one)")
    parser.add_argument(
        "--passes", type=positive_int, default=5, help="how many recent passes to show (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Pause, resume or trigger the fleet schedules, or release held recoveries; then show each schedule."""
    if args.note and not (args.pause or args.resume):
        raise UsageError("--note goes with --pause or --resume")
    if args.release_recoveries and args.reason is None:
        raise UsageError("--release-recoveries needs --reason: why the held recoveries may go ahead")
    if args.reason is not None and not args.release_recoveries:
        raise UsageError("--reason goes with --release-recoveries")
    if args.yes and not args.release_recoveries:
        raise UsageError("--yes goes with --release-recoveries")
    if args.by is not None and not (args.pause or args.resume or args.trigger or args.release_recoveries):
        raise UsageError("--by goes with --pause, --resume, --trigger or --release-recoveries")
    if through_api(settings, args):
        return operate_api(settings, lambda api: _through_api(api, args))
    by = args.by or operator()
    action = FleetAction(pause=args.pause, resume=args.resume, trigger=args.trigger, note=args.note, by=by)
    providers = [instance.name for instance in settings.provider_instances]
    if args.provider is not None:
        providers = [settings.provider_instance(args.provider).name]
    if args.release_recoveries and not _release_confirmed(args, providers):
        return EXIT_FAILURE

    async def act(operators: OperatorClient) -> int:
        told: list[str] = []
        if args.release_recoveries:
            # BMDB is opened only to release: pausing must work while BMDB is down.
            told = release_lines(await operators.release_recoveries(providers, by, args.reason))
        code = await print_fleet(operators, providers, action, passes=args.passes, as_json=args.json, told=told)
        if action.event_kind is not None:
            try:
                await operators.log_fleet_action(providers, action)
            except BMDBUnavailable as error:
                # Done is done: the schedule's note keeps who asked.
                print(f"not recorded in BMDB's event log: {error}", file=sys.stderr)
        return code

    return operate(settings, act)


async def _through_api(api: ApiOperatorClient, args: argparse.Namespace) -> int:
    """What run() does, asked of the operator API: which provider instances there are is the API's to say."""
    shown = await api.fleet_document(args.provider, args.passes)
    verb = next((v for v in ("pause", "resume", "trigger", "release_recoveries") if getattr(args, v)), None)
    if verb is None:
        return show_fleet([(document, None) for document in shown["providers"]], as_json=args.json)
    body: dict[str, Any] = {"reason": args.reason} if args.release_recoveries else {}
    if args.note:
        body["note"] = args.note
    if args.confirm is not None and args.release_recoveries:
        body["confirm"] = args.confirm
    providers = [provider for provider, _, _ in (provider_from_document(d) for d in shown["providers"])]
    if args.release_recoveries and not _release_confirmed(args, providers):
        return EXIT_FAILURE
    fleets, told = [], []
    for provider in providers:
        answer = await api.fleet_action(provider, verb.replace("_", "-"), body, passes=args.passes)
        if "approval" in answer:
            # The policy gives it to two people: it waits for the second.
            told.append(answer["answer"])
            continue
        told += answer.get("released", [])
        fleets.append((answer["providers"][0], answer.get("done")))
    return show_fleet(fleets, told, as_json=args.json)


def _release_confirmed(args: argparse.Namespace, providers: Sequence[str]) -> bool:
    """Whether to release the held recoveries of every provider instance named: asked when no --provider chose one
    and there is more than one, since each hold stands for its own silence, which may not be understood yet."""
    if args.provider is not None or len(providers) < 2 or args.yes:
        return True
    if confirmed(f"release the held recoveries of all {len(providers)} provider instances ({', '.join(providers)})?"):
        return True
    print("nothing done; name one with --provider, or give --yes")
    return False
