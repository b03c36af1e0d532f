"""``--where``: one operator action on every machine a Temporal visibility query selects.

The query is the Temporal UI's list filter (``Provider = "rack1" AND MachineStage = "WATCHING"``), narrowed to
running machine workflows. The machines are listed with their count before anything is done; then, after a
confirmation (or ``--yes``), the action runs at a bounded rate with a line per machine as it finishes, and a
summary says how many succeeded and names each that did not. ``--dry-run`` stops after the list. Over
``bulk_max_machines`` machines neither ``--yes`` nor an answer at the prompt is enough: ``--max N`` must say that
N (at least the count) may be touched, so a query that selects more than meant stops before it acts.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from foundation.settings import Settings
from lifecycle.contracts import MaintenanceRequest, OperatorRequest
from operations.api_client import ApiOperatorClient, ApiRefused
from operations.client import OperatorClient
from operations.machine_actions import InvalidQuery, Target, refusal_text
from shepherd.commands.base import (
    EXIT_FAILURE,
    EXIT_OK,
    MACHINE_HELP,
    CommandError,
    UsageError,
    add_by,
    ask_machine,
    operate,
    operate_api,
    operator,
    positive_int,
    reason_arg,
    through_api,
)

# Machines an action is under way on at once; the rate paces the starts.
IN_FLIGHT = 10
DEFAULT_RATE = 5.0
# Machines the list before the confirmation names one by one; the count is always whole.
LISTED = 50


# What one machine's action does: the line to show for it, or an exception whose message says why not.
Act = Callable[[OperatorClient, Target], Awaitable[str]]


def add_where(parser: argparse.ArgumentParser) -> None:
    """--where and its companions; the command's MACHINE argument becomes optional."""
    parser.add_argument(
        "--where",
        metavar="QUERY",
        help="instead of MACHINE: every running machine this visibility query selects, "
        'e.g. \'Provider = "rack1" AND MachineStage = "WATCHING"\'',
    )
    parser.add_argument("--dry-run", action="store_true", help="with --where: list the machines, do nothing")
    parser.add_argument("--yes", action="store_true", help="with --where: do not ask for a confirmation")
    parser.add_argument(
        "--max",
        type=positive_int,
        metavar="N",
        help="with --where: act on at most N machines; needed, with N at least the count, when more than the "
        "setting bulk_max_machines are selected",
    )
    parser.add_argument(
        "--rate",
        type=_rate_arg,
        default=DEFAULT_RATE,
        help="with --where: machines started per second (default %(default)g)",
    )


def add_machines(parser: argparse.ArgumentParser, reason_help: str) -> None:
    """MACHINE or --where and its companions, and the --reason and --by every operator action carries."""
    parser.add_argument("machine", metavar="MACHINE", nargs="?", help=MACHINE_HELP)
    parser.add_argument("--reason", required=True, type=reason_arg, help=reason_help)
    add_by(parser)
    add_where(parser)


def run_update(
    settings: Settings,
    args: argparse.Namespace,
    update: str,
    action: str,
    *,
    doing: str,
    then: str,
    force: bool = False,
) -> int:
    """Send the update, with the reason and who asked, to MACHINE or to each machine --where selects; every
    machine answers for itself. action: the operator API's name of it; doing: what is asked, for the confirmation;
    then: for a machine whose workflow does not run, what to do once it runs again; force: the request's force."""
    check_target(args)
    request = OperatorRequest(args.reason, args.by or operator(), force=force)
    if args.where is not None:
        body: dict[str, Any] = {"reason": args.reason} | ({"force": True} if force else {})
        return run_bulk(settings, args, doing, updating(update, request), action, body)
    return ask_machine(settings, args, update, request, then=then)


def _rate_arg(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < rate <= 1000:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1000 machines a second, got {text}")
    return rate


def check_target(args: argparse.Namespace) -> None:
    """Exactly one of MACHINE and --where; the bulk flags only with --where."""
    if (args.machine is None) == (args.where is None):
        raise UsageError("name one MACHINE, or select machines with --where QUERY")
    if args.where is None and (args.dry_run or args.yes or args.max is not None or args.rate != DEFAULT_RATE):
        raise UsageError("--dry-run, --yes, --max and --rate go with --where")
    if args.where is not None and not args.where.strip():
        raise UsageError("--where needs a query, e.g. 'MachineStage = \"WATCHING\"'")


def updating(update: str, request: OperatorRequest | MaintenanceRequest) -> Act:
    """The act of sending one update to each machine's workflow; its answer is the line shown."""

    async def act(operators: OperatorClient, target: Target) -> str:
        return await operators.ask_workflow(target.workflow_id, update, request)

    return act


def confirmed(question: str) -> bool:
    """Ask on stdout, read the answer from stdin; only yes is yes."""
    print(f"{question} [y/N] ", end="", flush=True)
    answer = sys.stdin.readline()
    if not answer or not sys.stdin.isatty():
        # A terminal echoed the answer and its newline; a pipe did not.
        print()
    return answer.strip().lower() in ("y", "yes")


async def act_on_all(
    operators: OperatorClient, targets: list[Target], act: Act, rate: float
) -> list[tuple[Target, str]]:
    """Run act on every target, starting at most rate a second with at most IN_FLIGHT under way; a line as each
    finishes. Returns the targets it failed on, with why."""
    failures: list[tuple[Target, str]] = []
    slots = asyncio.Semaphore(IN_FLIGHT)
    finished = 0

    async def one(target: Target) -> None:
        nonlocal finished
        try:
            line = await act(operators, target)
        except Exception as error:
            why = refusal_text(error)
            line = f"{target.workflow_id}: not done: {why}"
            failures.append((target, why))
        finally:
            slots.release()
        finished += 1
        print(f"[{finished}/{len(targets)}] {line}", flush=True)

    tasks = []
    for index, target in enumerate(targets):
        if index:
            await asyncio.sleep(1 / rate)
        await slots.acquire()
        tasks.append(asyncio.create_task(one(target)))
    await asyncio.gather(*tasks)
    return failures


def run_bulk(
    settings: Settings, args: argparse.Namespace, doing: str, act: Act, action: str, body: dict[str, Any]
) -> int:
    """List what args.where selects, confirm, and act on each machine; doing: what is asked, for the prompt.
    Through the operator API, the API selects and acts as its policy allows: action and body are its request."""
    if through_api(settings, args):
        return operate_api(settings, lambda api: _bulk_through_api(api, settings, args, doing, action, body))

    async def run(operators: OperatorClient) -> int:
        try:
            targets = await operators.select(args.where)
        except InvalidQuery as error:
            raise UsageError(str(error)) from None
        if not _listed(args, targets) or not _within_bound(settings, args, len(targets)):
            return EXIT_OK if args.dry_run else EXIT_FAILURE
        if not _confirmed(args, doing, len(targets)):
            return EXIT_FAILURE
        failures = await act_on_all(operators, targets, act, args.rate)
        return _summary(len(targets), [(target.workflow_id, why) for target, why in failures])

    return operate(settings, run)


async def _bulk_through_api(
    api: ApiOperatorClient,
    settings: Settings,
    args: argparse.Namespace,
    doing: str,
    action: str,
    body: dict[str, Any],
) -> int:
    asked = body | {"where": args.where}
    try:
        selected = await api.bulk(action, asked | {"dry_run": True})
    except ApiRefused as refused:
        if refused.status == 400:
            raise UsageError(str(refused)) from None
        raise
    targets = [Target(m["workflow_id"], m["provider_id"], m["stage"]) for m in selected["machines"]]
    if not _listed(args, targets) or not _within_bound(settings, args, len(targets)):
        return EXIT_OK if args.dry_run else EXIT_FAILURE
    if not _confirmed(args, doing, len(targets)):
        return EXIT_FAILURE
    count = selected.get("confirm_needed")
    if count is not None:
        # The policy asks for the count typed back; the API counts again when the request comes.
        typed = args.confirm
        if typed is None:
            print(f"the policy asks for the number of machines typed back to go on ({count}): ", end="", flush=True)
            typed = sys.stdin.readline().strip()
        if typed != str(count):
            print(f"{typed!r} is not {count}: nothing done")
            return EXIT_FAILURE
        asked["confirm"] = count
    answer = await api.bulk(action, asked)
    if "approval" in answer:
        print(answer["answer"])  # the policy gives it to two people: it waits for the second
        return EXIT_OK
    results = answer["results"]
    for finished, result in enumerate(results, start=1):
        print(f"[{finished}/{len(results)}] {result['line']}", flush=True)
    failures = [(r["workflow_id"], r["why"]) for r in results if r["outcome"] != "done"]
    return _summary(len(results), failures)


def _listed(args: argparse.Namespace, targets: list[Target]) -> bool:
    """Name what --where selected; whether to go on (not for a dry run). CommandError when nothing is."""
    if not targets:
        raise CommandError(f"no running machine workflow matches --where {args.where!r}: nothing done")
    print(f"{len(targets)} machine(s) match --where {args.where!r}:")
    for target in targets[:LISTED]:
        print(f"  {target.provider_id:<24} {target.stage:<16} {target.workflow_id}")
    if len(targets) > LISTED:
        print(f"  and {len(targets) - LISTED} more")
    if args.dry_run:
        print("dry run: nothing done")
        return False
    return True


def _within_bound(settings: Settings, args: argparse.Namespace, count: int) -> bool:
    """Whether count machines may be acted on: at most --max, and over bulk_max_machines only with --max. Says
    why not."""
    if args.max is not None and count > args.max:
        print(f"{count} machines are more than --max {args.max}: nothing done")
        return False
    if args.max is None and count > settings.bulk_max_machines:
        print(
            f"{count} machines are more than bulk_max_machines ({settings.bulk_max_machines}), which --yes or an "
            f"answer alone may touch: nothing done; give --max {count} to act on all of them"
        )
        return False
    return True


def _confirmed(args: argparse.Namespace, doing: str, count: int) -> bool:
    if args.yes or confirmed(f"{doing} on these {count} machine(s)?"):
        return True
    print("nothing done")
    return False


def _summary(count: int, failures: list[tuple[str, str]]) -> int:
    print(f"done: {count - len(failures)} of {count} succeeded", end="")
    print(f", {len(failures)} did not:" if failures else "")
    for workflow_id, why in failures:
        print(f"  {workflow_id}: {why}")
    return EXIT_FAILURE if failures else EXIT_OK
