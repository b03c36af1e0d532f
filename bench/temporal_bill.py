"""Benchmark: what a fleet costs Temporal, in Temporal Cloud's billable actions and in history storage.

Runs the stack bench.chaos assembles (a Temporal dev server, PostgreSQL, the simulator, the heartbeat server and
a worker, as separate processes, no faults) with --machines simulated machines, its fleet passes and its worker's
watchdog every --pass-interval seconds (a minute by default: shorter than an installation's default reconcile
interval, so that the healthy span sees several passes), then, in turn:

  bring-up      from the worker's start until every machine is WATCHING and heartbeating
  healthy       --healthy seconds of the whole fleet WATCHING, fleet passes included
  recovery      one machine's agent SIGKILLed: the worker's watchdog finds it silent, signals it, it is rebooted
                and taken over again, until it is WATCHING with a heartbeat from its new agent
  maintenance   another machine through `shepherd maintenance --on`, then `--off`, until WATCHING again

Every run of every workflow's history is fetched at the end, and each event falls into the span its time lies
in; bench.billable_actions counts them as Temporal Cloud bills them, and reads the billed requests that leave no
event (queries, recorded activity heartbeats, update requests) from the server's counters at the span's ends.

Extrapolation: a healthy machine's own actions over the healthy span are scaled to a day; the fleet pass costs
what one pass of the healthy span cost on average, times the passes a day at the default reconcile interval (the
one an installation runs with, not --pass-interval), shared among the machines. The month's projection for
larger fleets adds recoveries and maintenance rounds at the rates given (a machine's share of each) and the
retention of closed histories (--retention-days). The workers' watchdog looks outside Temporal: it costs a signal
to each silent machine, counted in the recovery, and nothing while every machine heartbeats.

The other timings are the short ones of bench.chaos (heartbeat every 5 s, silent after 30 s, reboots of 5 s): they
change how long a recovery takes, not what it records.

Run (about 13 minutes at 200 machines on two cores, 8 at 50):

    python -m bench.temporal_bill [--machines 200] [--healthy 300] [--pass-interval 60] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus

from bench.billable_actions import billable_actions, frontend_requests, history_bytes, unrecorded_actions
from bench.chaos import (
    PROVIDER,
    ChaosError,
    ChaosRun,
    Options,
    Stack,
    positive,
    run_on_stack,
)
from foundation.procfs import process_environments
from foundation.settings import Settings
from lifecycle.contracts import MachineStage, machine_workflow_id
from operations.machine_reads import machine_stages
from simulator.machine import MACHINE_ROOT_VARIABLE

MACHINE_WORKFLOW, FLEET_WORKFLOW = "MachineWorkflow", "FleetWorkflow"
DAY = 86400.0
MONTH_DAYS = 30
# Temporal Cloud's goal for a healthy machine, a day, in a fleet of 10,000 or more.
GOAL_A_DAY = 0.1
PROJECTED_FLEETS = (1_000, 10_000, 100_000)
POLL = 1.0
HISTORY_FETCHES_IN_FLIGHT = 20
# How often the run's passes and its worker's watchdog come, unless --pass-interval says otherwise.
PASS_INTERVAL = 60.0
# After a phase's last change, so the events that follow it (a handler's activity) fall in its span.
TRAILING = 5.0


def default_reconcile_interval() -> float:
    """The pass interval an installation runs with unless it sets SHEPHERD_RECONCILE_INTERVAL."""
    return float(next(f.default for f in fields(Settings) if f.name == "reconcile_interval"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class WorkflowRun:
    """One run of one workflow, its whole history."""

    workflow_type: str
    workflow_id: str
    run_id: str
    running: bool
    events: list[HistoryEvent]

    @property
    def started_at(self) -> datetime:
        return self.events[0].event_time.ToDatetime(UTC)

    def events_between(self, start: datetime, end: datetime) -> list[HistoryEvent]:
        return [event for event in self.events if start <= event.event_time.ToDatetime(UTC) < end]


@dataclass
class Span:
    """A phase of the run: its bounds and the frontend's request counters at each."""

    name: str
    start: datetime
    end: datetime | None = None
    requests_before: Counter[str] = field(default_factory=Counter)
    requests_after: Counter[str] = field(default_factory=Counter)

    @property
    def seconds(self) -> float:
        assert self.end is not None
        return (self.end - self.start).total_seconds()

    def unrecorded(self) -> Counter[str]:
        return unrecorded_actions(self.requests_before, self.requests_after)


def actions_between(runs: Sequence[WorkflowRun], span: Span, *, workflow_id: str | None = None) -> Counter[str]:
    """The billable actions the runs recorded within the span, of one workflow id if given."""
    assert span.end is not None
    total: Counter[str] = Counter()
    for run in runs:
        if workflow_id is None or run.workflow_id == workflow_id:
            total += billable_actions(run.events_between(span.start, span.end))
    return total


async def fetch_runs(client: Client) -> list[WorkflowRun]:
    """Every run of every machine and fleet workflow the server keeps, closed ones included, with its history."""
    listed = [
        execution
        async for execution in client.list_workflows()
        if execution.workflow_type in (MACHINE_WORKFLOW, FLEET_WORKFLOW)
    ]
    gate = asyncio.Semaphore(HISTORY_FETCHES_IN_FLIGHT)

    async def fetch(execution: Any) -> WorkflowRun:
        async with gate:
            history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
        return WorkflowRun(
            execution.workflow_type,
            execution.id,
            execution.run_id,
            execution.status == WorkflowExecutionStatus.RUNNING,
            list(history.events),
        )

    return list(await asyncio.gather(*(fetch(execution) for execution in listed)))


@dataclass
class Assumptions:
    """The rates the month's projection assumes, per machine a month, and how long closed histories are kept."""

    recoveries: float
    maintenance_rounds: float
    retention_days: float


@dataclass
class Bill:
    """What the run measured, and its projection to a day and a month at an installation's pass interval."""

    machines: int
    # The passes' interval the projection assumes (an installation's default), and the one the run measured at.
    reconcile_interval: float
    pass_interval: float
    healthy_seconds: float
    assumptions: Assumptions
    # Actions by kind, per span; the per-machine figures below are derived from them.
    bringup_actions: dict[str, int] = field(default_factory=dict)
    bringup_fleet_actions: dict[str, int] = field(default_factory=dict)
    bringup_unrecorded: dict[str, int] = field(default_factory=dict)
    passes_in_bringup: int = 0
    healthy_machine_actions: dict[str, int] = field(default_factory=dict)
    healthy_unrecorded: dict[str, int] = field(default_factory=dict)
    passes_in_healthy: int = 0
    pass_actions: dict[str, float] = field(default_factory=dict)
    recovery_actions: dict[str, int] = field(default_factory=dict)
    recovery_unrecorded: dict[str, int] = field(default_factory=dict)
    recovery_seconds: float = 0.0
    maintenance_actions: dict[str, int] = field(default_factory=dict)
    maintenance_unrecorded: dict[str, int] = field(default_factory=dict)
    # History bytes: a healthy machine's running run, a pass's run, the runs of the recovered and maintained
    # machines in order (the last one running).
    healthy_run_bytes: list[int] = field(default_factory=list)
    pass_run_bytes: list[int] = field(default_factory=list)
    recovered_runs_bytes: list[int] = field(default_factory=list)
    maintained_runs_bytes: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def per_pass(self) -> float:
        return sum(self.pass_actions.values())

    @property
    def passes_a_day(self) -> float:
        """Passes a day at the projected interval: a pass's cost does not depend on how long ago the last ran."""
        return DAY / self.reconcile_interval

    @property
    def bringup_per_machine(self) -> float:
        """A machine's bring-up: its own workflow, its share of the billed requests of no event (the takeover's
        recorded heartbeat), and what the passes that admitted it spent beyond a pass's cost."""
        fleet_beyond = sum(self.bringup_fleet_actions.values()) - self.passes_in_bringup * self.per_pass
        unrecorded = sum(n for kind, n in self.bringup_unrecorded.items() if kind != "update requests")
        return (sum(self.bringup_actions.values()) + unrecorded + max(0.0, fleet_beyond)) / self.machines

    @property
    def healthy_own_a_day(self) -> float:
        """A healthy machine's own actions a day (its workflow, its share of the billed requests of no event)."""
        own = sum(self.healthy_machine_actions.values()) + sum(
            n for kind, n in self.healthy_unrecorded.items() if kind != "update requests"
        )
        return own / self.machines * DAY / self.healthy_seconds

    def fleet_pass_a_day(self) -> float:
        return self.per_pass * self.passes_a_day

    def healthy_a_day(self, machines: int) -> float:
        """A healthy machine's actions a day in a fleet of that size, the passes shared among them."""
        return self.healthy_own_a_day + self.fleet_pass_a_day() / machines

    def goal_met(self) -> bool:
        """Whether a healthy machine costs under the goal a day once the fleet is 10,000 machines."""
        return self.healthy_a_day(10_000) < GOAL_A_DAY

    @property
    def per_recovery(self) -> int:
        """A recovery's actions: its workflow's, and the queries and recorded heartbeats (the takeover's, the boot
        wait's: one per 24 s of a real boot) it caused."""
        unrecorded = self.recovery_unrecorded
        return (
            sum(self.recovery_actions.values())
            + unrecorded.get("queries", 0)
            + unrecorded.get("recorded heartbeats", 0)
        )

    @property
    def per_maintenance(self) -> int:
        # Updates are counted from their events; a rejected one (none here) would show as a request beyond them.
        return sum(self.maintenance_actions.values()) + self.maintenance_unrecorded.get("queries", 0)

    def healthy_bytes(self) -> float:
        return statistics.mean(self.healthy_run_bytes) if self.healthy_run_bytes else 0.0

    def pass_bytes(self) -> float:
        return statistics.mean(self.pass_run_bytes) if self.pass_run_bytes else 0.0

    def closed_run_bytes(self, runs: list[int]) -> float:
        """What one round adds to the closed histories: the runs it closed, beyond the healthy run it began in."""
        return float(sum(runs[:-1])) if len(runs) > 1 else 0.0

    def month(self, machines: int) -> dict[str, float]:
        """Actions and storage of a month for a fleet of that size (bring-ups apart: once a machine)."""
        a = self.assumptions
        actions = (
            MONTH_DAYS * self.fleet_pass_a_day()
            + MONTH_DAYS * machines * self.healthy_own_a_day
            + machines * a.recoveries * self.per_recovery
            + machines * a.maintenance_rounds * self.per_maintenance
        )
        closed_a_day = self.passes_a_day * self.pass_bytes() + machines / MONTH_DAYS * (
            a.recoveries * self.closed_run_bytes(self.recovered_runs_bytes)
            + a.maintenance_rounds * self.closed_run_bytes(self.maintained_runs_bytes)
        )
        return {
            "machines": machines,
            "actions": actions,
            "actions_a_healthy_machine_a_day": self.healthy_a_day(machines),
            "bringup_actions_once": machines * self.bringup_per_machine,
            "active_bytes": machines * self.healthy_bytes(),
            "retained_bytes": closed_a_day * a.retention_days,
        }

    def document(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "per_pass": self.per_pass,
            "passes_a_day": self.passes_a_day,
            "fleet_pass_a_day": self.fleet_pass_a_day(),
            "bringup_per_machine": self.bringup_per_machine,
            "healthy_own_a_day": self.healthy_own_a_day,
            "healthy_a_day_here": self.healthy_a_day(self.machines),
            "goal_met": self.goal_met(),
            "per_recovery": self.per_recovery,
            "per_maintenance": self.per_maintenance,
            "months": [self.month(n) for n in (self.machines, *PROJECTED_FLEETS)],
        }


def agent_pids(machines_dir: Path, provider_id: str) -> list[int]:
    """The processes running on one simulated machine: its agent."""
    root = f"{MACHINE_ROOT_VARIABLE}={machines_dir / provider_id}"
    return [
        pid
        for pid, environment in process_environments()
        if any(v == root.encode() or v.startswith(f"{root}/".encode()) for v in environment)
    ]


class BillRun:
    """The benchmark: bring-up, a healthy span, a recovery and a maintenance round, then the histories counted."""

    def __init__(self, stack: Stack, options: Options, healthy: float, assumptions: Assumptions) -> None:
        self.stack = stack
        self.options = options
        self.healthy = healthy
        # For its snapshot of the fleet (Temporal's stages beside BMDB's heartbeats); no fault is struck.
        self.observer = ChaosRun(stack, options)
        self.say = stack.say
        self.bill = Bill(
            options.machines, default_reconcile_interval(), options.reconcile_interval, healthy, assumptions
        )

    async def requests(self) -> Counter[str]:
        url = f"http://127.0.0.1:{self.stack.ports.temporal_metrics}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            response.raise_for_status()
            return frontend_requests(await response.text())

    async def begin(self, name: str) -> Span:
        return Span(name, datetime.now(UTC), requests_before=await self.requests())

    async def end(self, span: Span) -> Span:
        await asyncio.sleep(TRAILING)
        span.end = datetime.now(UTC)
        span.requests_after = await self.requests()
        self.say(f"{span.name}: {span.seconds:.0f}s")
        return span

    async def stage_of(self, workflow_id: str) -> str | None:
        return (await machine_stages(self.stack.client)).get(workflow_id)

    async def until(self, what: str, limit: float, done: Any) -> None:
        deadline = time.monotonic() + limit
        while not await done():
            if time.monotonic() > deadline:
                raise ChaosError(f"{what} did not happen within {limit:.0f}s")
            await asyncio.sleep(POLL)

    async def all_watching(self) -> bool:
        snapshot = await self.observer.observe()
        machines = self.options.machines
        return snapshot.watching == machines and snapshot.fresh == machines

    async def run(self) -> Bill:
        machines = self.options.machines
        bringup = Span("bring-up", datetime.now(UTC))
        await self.stack.start()
        bringup.requests_before = await self.requests()
        self.say(f"bringing {machines} machines up")
        await self.until("the bring-up", self.options.bringup_limit, self.all_watching)
        await self.end(bringup)

        healthy = await self.begin("healthy")
        self.say(f"the fleet is healthy: counting for {self.healthy:.0f}s")
        await asyncio.sleep(self.healthy)
        await self.end(healthy)

        provider_ids = sorted(
            str(row[0]) for row in await self.stack.sql("SELECT provider_id FROM machine_provided ORDER BY 1")
        )
        recovered, maintained = provider_ids[0], provider_ids[1]
        recovery = await self.recovery(recovered)
        maintenance = await self.maintenance(maintained)

        self.say("fetching every history")
        runs = await fetch_runs(self.stack.client)
        self.count(runs, bringup, healthy, recovery, maintenance, recovered, maintained)
        return self.bill

    async def recovery(self, provider_id: str) -> Span:
        workflow_id = machine_workflow_id(PROVIDER, provider_id)
        span = await self.begin("recovery")
        pids = agent_pids(self.stack.machines_dir, provider_id)
        if not pids:
            raise ChaosError(f"no agent process found on {provider_id}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.say(f"killed the agent of {provider_id}; waiting for its recovery")

        async def recovered() -> bool:
            rows = await self.stack.sql(
                "SELECT"
                " (SELECT count(*) FROM events e WHERE e.machine_id = p.machine_id AND e.kind = 'rebooted'"
                "   AND e.at >= %(since)s),"
                " (SELECT count(*) FROM machine_agent_heartbeat h JOIN machine_agent_started a USING (machine_id)"
                "   WHERE h.machine_id = p.machine_id AND a.agent_started_at >= %(since)s)"
                " FROM machine_provided p WHERE p.provider = %(provider)s AND p.provider_id = %(id)s",
                {"since": span.start, "provider": PROVIDER, "id": provider_id},
            )
            rebooted, heartbeating = (int(n) for n in rows[0])
            return rebooted > 0 and heartbeating > 0 and await self.stage_of(workflow_id) == MachineStage.WATCHING

        # Silent after the heartbeat timeout, found by the worker's next look, rebooted and taken over.
        watchdog = self.stack.settings.watchdog_interval
        await self.until("the recovery", self.options.heartbeat_timeout + 3 * watchdog + 120, recovered)
        await self.end(span)
        self.bill.recovery_seconds = round(span.seconds, 1)
        return span

    async def maintenance(self, provider_id: str) -> Span:
        workflow_id = machine_workflow_id(PROVIDER, provider_id)
        span = await self.begin("maintenance")
        await self.stack.shepherd("maintenance", workflow_id, "--on", "--reason", "bench: a round")

        async def in_stage(stage: MachineStage) -> bool:
            return await self.stage_of(workflow_id) == stage

        await self.until("maintenance --on", 120, lambda: in_stage(MachineStage.MAINTENANCE))
        await self.stack.shepherd("maintenance", workflow_id, "--off", "--reason", "bench: done")
        await self.until("maintenance --off", 300, lambda: in_stage(MachineStage.WATCHING))
        return await self.end(span)

    def count(
        self,
        runs: list[WorkflowRun],
        bringup: Span,
        healthy: Span,
        recovery: Span,
        maintenance: Span,
        recovered: str,
        maintained: str,
    ) -> None:
        bill = self.bill
        machine_runs = [r for r in runs if r.workflow_type == MACHINE_WORKFLOW]
        passes = [r for r in runs if r.workflow_type == FLEET_WORKFLOW]
        assert bringup.end is not None and healthy.end is not None

        bill.bringup_actions = dict(actions_between(machine_runs, bringup))
        bill.bringup_fleet_actions = dict(actions_between(passes, bringup))
        bill.bringup_unrecorded = dict(bringup.unrecorded())
        bill.passes_in_bringup = sum(1 for r in passes if bringup.start <= r.started_at < bringup.end)

        bill.healthy_machine_actions = dict(actions_between(machine_runs, healthy))
        bill.healthy_unrecorded = dict(healthy.unrecorded())
        # A pass's cost: the whole runs started within the healthy span, each counted from its own history.
        whole = [r for r in passes if healthy.start <= r.started_at < healthy.end and not r.running]
        bill.passes_in_healthy = len(whole)
        if not whole:
            raise ChaosError(f"no fleet pass ran within the {healthy.seconds:.0f}s of the healthy span")
        kinds: Counter[str] = sum((billable_actions(r.events) for r in whole), Counter())
        bill.pass_actions = {kind: n / len(whole) for kind, n in kinds.items()}
        bill.pass_run_bytes = [history_bytes(r.events) for r in whole]

        recovered_id, maintained_id = (machine_workflow_id(PROVIDER, p) for p in (recovered, maintained))
        bill.recovery_actions = dict(actions_between(machine_runs, recovery, workflow_id=recovered_id))
        bill.recovery_unrecorded = dict(recovery.unrecorded())
        bill.maintenance_actions = dict(actions_between(machine_runs, maintenance, workflow_id=maintained_id))
        bill.maintenance_unrecorded = dict(maintenance.unrecorded())

        def runs_of(workflow_id: str) -> list[int]:
            own = sorted((r for r in machine_runs if r.workflow_id == workflow_id), key=lambda r: r.started_at)
            return [history_bytes(r.events) for r in own]

        bill.recovered_runs_bytes = runs_of(recovered_id)
        bill.maintained_runs_bytes = runs_of(maintained_id)
        bill.healthy_run_bytes = [
            history_bytes(r.events)
            for r in machine_runs
            if r.running and r.workflow_id not in (recovered_id, maintained_id)
        ]
        other_fleet = actions_between(passes, recovery) + actions_between(passes, maintenance)
        if sum(other_fleet.values()):
            bill.notes.append(
                "the passes during the recovery and the maintenance round are the passes' own cost, counted once in"
                " the pass figure"
            )


def kib(value: float) -> str:
    return f"{value / 1024:,.1f} KiB"


def big_bytes(value: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return kib(value)


def kinds(actions: dict[str, Any]) -> str:
    return ", ".join(f"{kind} {n:g}" for kind, n in sorted(actions.items()) if n) or "none"


def table(bill: Bill) -> list[str]:
    """The bill as lines: what was measured, then the month for larger fleets."""
    here = bill.healthy_a_day(bill.machines)
    at_10k = bill.healthy_a_day(10_000)
    a = bill.assumptions
    rows = [
        (
            "a fleet pass (actions)",
            f"{bill.per_pass:g}  ({kinds(bill.pass_actions)}; mean of {bill.passes_in_healthy} passes, one every "
            f"{bill.pass_interval:g}s), {bill.fleet_pass_a_day():,.0f} a day at one pass every "
            f"{bill.reconcile_interval:g}s",
        ),
        (
            "a healthy machine's own actions a day",
            f"{bill.healthy_own_a_day:.4f}  (over {bill.healthy_seconds:.0f}s: {kinds(bill.healthy_machine_actions)};"
            f" billed requests of no event: {kinds(bill.healthy_unrecorded)})",
        ),
        (
            f"a healthy machine a day, passes shared ({bill.machines} machines)",
            f"{here:.3f}  (goal {GOAL_A_DAY:g} at 10,000 or more: {'met' if bill.goal_met() else 'NOT met'}; at "
            f"10,000: {at_10k:.3f}, {at_10k / GOAL_A_DAY:.2f}x the goal; at 100,000: "
            f"{bill.healthy_a_day(100_000):.4f})",
        ),
        (
            "a bring-up (actions a machine)",
            f"{bill.bringup_per_machine:.1f}  (its workflow: {kinds(bill.bringup_actions)}; billed requests of no "
            f"event: {kinds(bill.bringup_unrecorded)}; the passes admitting: "
            f"{kinds(bill.bringup_fleet_actions)} in {bill.passes_in_bringup} passes)",
        ),
        (
            "a recovery (actions)",
            f"{bill.per_recovery}  ({kinds(bill.recovery_actions)}; billed requests of no event: "
            f"{kinds(bill.recovery_unrecorded)}; {bill.recovery_seconds:.0f}s)",
        ),
        (
            "a maintenance round, --on and --off (actions)",
            f"{bill.per_maintenance}  ({kinds(bill.maintenance_actions)}; requests: "
            f"{kinds(bill.maintenance_unrecorded)})",
        ),
        (
            "history of a healthy machine (its running run)",
            f"{kib(bill.healthy_bytes())} mean, {kib(max(bill.healthy_run_bytes, default=0))} at most",
        ),
        ("history of a fleet pass", f"{kib(bill.pass_bytes())} mean"),
        (
            "histories of the recovered machine, run by run",
            " -> ".join(kib(b) for b in bill.recovered_runs_bytes) + " (the last one running)",
        ),
        (
            "histories of the maintained machine, run by run",
            " -> ".join(kib(b) for b in bill.maintained_runs_bytes) + " (the last one running)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"temporal bill: {bill.machines} machines, measured with a fleet pass and a watchdog look every "
        f"{bill.pass_interval:g}s over a healthy span of {bill.healthy_seconds:.0f}s; projected with a pass every "
        f"{bill.reconcile_interval:g}s (the default reconcile interval)",
        "",
        *(f"{name:<{width}}  {value}" for name, value in rows),
        "",
        f"a month (30 days), assuming {a.recoveries:g} recoveries and {a.maintenance_rounds:g} maintenance rounds a "
        f"machine a month, closed histories kept {a.retention_days:g} days; bring-ups once a machine, apart:",
        f"{'machines':>9} {'actions':>12} {'a healthy machine a day':>24} {'bring-ups once':>15} "
        f"{'running histories':>18} {'closed histories':>17}",
    ]
    for machines in (bill.machines, *PROJECTED_FLEETS):
        m = bill.month(machines)
        lines.append(
            f"{machines:>9,} {m['actions']:>12,.0f} {m['actions_a_healthy_machine_a_day']:>24.4f} "
            f"{m['bringup_actions_once']:>15,.0f} {big_bytes(m['active_bytes']):>18} "
            f"{big_bytes(m['retained_bytes']):>17}"
        )
    if bill.notes:
        lines += ["", *(f"note: {note}" for note in bill.notes)]
    return lines


def parse_options(argv: Sequence[str] | None = None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.temporal_bill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=positive(int), default=200, help="simulated machines (default %(default)s)")
    parser.add_argument(
        "--healthy", type=positive(float), default=300.0, help="seconds of the healthy span (default %(default)s)"
    )
    parser.add_argument(
        "--recoveries", type=float, default=0.1, help="recoveries a machine a month, projected (default %(default)s)"
    )
    parser.add_argument(
        "--maintenance-rounds",
        type=float,
        default=0.1,
        help="maintenance rounds a machine a month, projected (default %(default)s)",
    )
    parser.add_argument(
        "--retention-days",
        type=positive(float),
        default=30.0,
        help="days the namespace keeps closed histories (default %(default)s)",
    )
    parser.add_argument(
        "--pass-interval",
        type=positive(float),
        default=PASS_INTERVAL,
        help="seconds between the run's fleet passes and its watchdog's looks; the projection uses the default "
        "reconcile interval whatever this is (default %(default)s)",
    )
    parser.add_argument("--bringup-limit", type=positive(float), default=900.0, help="seconds (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the bill as a JSON document")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, state) and say where")
    args = parser.parse_args(argv)
    options = Options(
        machines=args.machines,
        seed=1,
        worker_kills=0,
        heartbeat_timeout=30.0,
        reconcile_interval=args.pass_interval,
        margin=10.0,
        after_outage=0.0,
        bringup_limit=args.bringup_limit,
    )
    return options, args


async def run(bill_run: BillRun) -> Bill:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await bill_run.run()


def main(argv: Sequence[str] | None = None) -> int:
    options, args = parse_options(argv)
    assumptions = Assumptions(args.recoveries, args.maintenance_rounds, args.retention_days)
    stack = Stack(Path(tempfile.mkdtemp(prefix="shepherd-bill-")).resolve(), options, time.monotonic())
    bill = run_on_stack(stack, lambda: run(BillRun(stack, options, args.healthy, assumptions)), keep=args.keep)
    if args.json:
        print(json.dumps(bill.document(), indent=2, default=str))
    else:
        print("\n".join(table(bill)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
