"""Activities of the fleet reconcile pass."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

from temporalio import activity
from temporalio.service import RPCError

from activities.deps import ActivityDeps, provider_errors
from activities.workflow_start import start_machine_workflow
from bmdb.store import HeldRecoveries, ProvidedMachine, SilentMachine
from lifecycle.contracts import (
    HEARTBEAT_LOST_SIGNAL,
    AdmitInput,
    EnsureWorkflowsInput,
    EnsureWorkflowsResult,
    HeartbeatLost,
    ReconcilePassInput,
    ReconcilePassPlan,
    RecoveryHold,
    RecoveryHoldRule,
    WatchdogInput,
    WatchdogResult,
    machine_workflow_id,
    running_machines_of,
)
from lifecycle.inputs import recovery_hold_rule
from lifecycle.reconcile import plan_reconcile
from lifecycle.takeover import key_fingerprint
from lifecycle.watchdog import hold_reason, hold_threshold, spared_after_hold
from providers import CountsLeftAlone

log = logging.getLogger(__name__)

# How many disagreeing machines a pass names in its result; the event log and
# the worker's log name them all.
_DISAGREEMENTS_SHOWN = 20
# How many silent machines a held pass names in its result and its event.
_HELD_SAMPLE = 10
# Temporal calls a pass makes at once: a start or a signal is a few milliseconds
# of waiting on the server, so one at a time paces a pass that starts or signals
# hundreds (after a worker outage, a fleet-wide network loss) to a dozen a second.
TEMPORAL_CALLS_IN_FLIGHT = 20
# A pass lists the running machine workflows only when their count differs from the machines BMDB manages: counting
# is one call, listing costs the server about 0.2 ms a workflow (20 s at 100,000 machines). Equal counts can still
# hide a machine without a workflow behind a workflow of a machine BMDB does not manage (a BMDB restored from an
# older backup, a row deleted by hand), so each worker also lists them all at least this often (seconds).
FULL_LISTING_EVERY = 3600.0
# A silence whose workflow confirmed it as its recovery began is left to that recovery this long before a look tells
# the workflow again (in case it was reset to before it): the reboot may wait its turn at the provider's rate limit
# for many heartbeat timeouts, and each telling was a workflow task and a billed signal coalesced into it.
CONFIRMED_SILENCE_TOLD_AGAIN_AFTER = timedelta(hours=1)

T = TypeVar("T")
R = TypeVar("R")


async def each_at_most(items: Sequence[T], limit: int, act: Callable[[T], Awaitable[R]]) -> list[R]:
    """act on every item, at most limit at once; the results in the items' order."""
    slots = asyncio.Semaphore(limit)

    async def one(item: T) -> R:
        async with slots:
            return await act(item)

    return list(await asyncio.gather(*(one(item) for item in items)))


class FleetActivities:
    """Side effects of the fleet reconcile pass: plan it, admit machines, start missing workflows, signal the silent."""

    def __init__(
        self,
        deps: ActivityDeps,
        *,
        full_listing_every: float = FULL_LISTING_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deps = deps
        self._full_listing_every = full_listing_every
        self._clock = clock
        # When this worker last listed each provider's running workflows; a new worker lists at its first pass.
        self._listed_at: dict[str, float] = {}

    @activity.defn
    async def plan_reconcile_pass(self, input: ReconcilePassInput) -> ReconcilePassPlan:
        """List provider and BMDB in parallel and decide what this pass creates."""
        provider = self.deps.provider(input.provider)
        async with provider_errors():
            in_provider, in_bmdb = await asyncio.gather(
                provider.list_machines(), self.deps.bmdb.list_provided(input.provider)
            )
        plan = plan_reconcile(
            in_provider,
            in_bmdb,
            max_machines=input.max_machines,
            chunk_size=input.chunk_size,
            is_valid_id=provider.is_valid_id,
        )
        for provider_id in plan.invalid_ids:
            log.error("BMDB has %s machine with an id the provider never issues: %r", input.provider, provider_id)
        if plan.invalid_listed:
            shown = ", ".join(repr(p[:80]) for p in plan.invalid_listed[:_DISAGREEMENTS_SHOWN])
            log.error(
                "provider %s lists %d machine(s) under ids of a form it never issues, left alone: %s",
                input.provider,
                len(plan.invalid_listed),
                shown,
            )
        if plan.newly_missing or plan.back_again:
            missing, back = await self.deps.bmdb.record_provider_listing(
                input.provider, plan.newly_missing, plan.back_again
            )
            for provider_id in missing:
                log.error(
                    "provider %s no longer lists machine %s: reported, never rebooted", input.provider, provider_id
                )
            for provider_id in back:
                log.info("provider %s lists machine %s again", input.provider, provider_id)
        disagreements = [str(d) for d in plan.disagreements]
        if disagreements:
            detail = f"{plan.note}: " + "; ".join(disagreements)
            log.error("reconcile pass %s", detail)
            await self.deps.bmdb.add_event(None, "reconcile_refused", detail)
        else:
            log.info("reconcile pass: %d in provider, %d in BMDB, %s", plan.provider_count, plan.bmdb_count, plan.note)
        return ReconcilePassPlan(
            provider_count=plan.provider_count,
            bmdb_count=plan.bmdb_count,
            managed_count=plan.managed_count,
            to_create=[m.provider_id for m in plan.to_create],
            disagreements=disagreements[:_DISAGREEMENTS_SHOWN],
            disagreement_count=len(disagreements),
            note=plan.note,
            left_alone=dict(provider.left_alone) if isinstance(provider, CountsLeftAlone) else {},
        )

    @activity.defn
    async def watch_silent_machines(self, input: WatchdogInput) -> WatchdogResult:
        """The fleet pass's look for silent machines (see look); made whenever the last look was."""
        async with self.deps.bmdb.watchdog_turn(input.provider, by=f"fleet pass {activity.info().workflow_id}"):
            return await self.look(input)

    async def look_if_due(self, input: WatchdogInput, *, unless_within: float, by: str) -> WatchdogResult | None:
        """The worker's watchdog: the look of a fleet pass (see look), unless the provider's last look, by any
        worker or pass, ended less than unless_within seconds ago; None then."""
        async with self.deps.bmdb.watchdog_turn(input.provider, by=by, unless_within=unless_within) as due:
            return await self.look(input) if due else None

    async def look(self, input: WatchdogInput) -> WatchdogResult:
        """Signal every machine whose agent went silent, unless so many are silent that the fault is more likely ours.

        One BMDB query finds the silent; when the circuit breaker trips, none is signalled, the hold is recorded
        (a fleet event when it begins) and stays until the silence ends or an operator releases it. The machines
        that fell silent during a hold get a grace from its end to come back: their agents may still be waiting
        out their retry back-off. Call it in a turn of bmdb's watchdog_turn, so no two looks overlap.
        """
        bmdb = self.deps.bmdb
        as_of = datetime.fromisoformat(input.as_of)
        silent = await bmdb.silent_machines(
            input.provider,
            as_of=as_of,
            first_heartbeat_within=input.first_heartbeat_within,
            heartbeat_within=input.heartbeat_within,
        )
        watched = await bmdb.watched_machines(input.provider)
        last = watched.last_heartbeat_at
        rule = input.hold_rule or recovery_hold_rule(self.deps.settings)
        spared = _spared(input.provider, rule, silent, watched.hold_ended_at, as_of)
        silent = [m for m in silent if m not in spared]
        why = hold_reason(
            rule,
            silent=len(silent),
            watched=watched.count,
            last_heartbeat_age=None if last is None else (as_of - last).total_seconds(),
        )
        hold = None
        if why is None and watched.hold_standing:
            await bmdb.end_recovery_hold(
                input.provider, f"{len(silent)} of {watched.count} watched machines silent: recoveries go ahead"
            )
            log.warning("recoveries of provider %s resumed: %d machine(s) silent now", input.provider, len(silent))
            # Whoever is still silent fell silent during the hold: their grace begins now.
            ending = _spared(input.provider, rule, silent, as_of, as_of)
            spared += ending
            silent = [m for m in silent if m not in ending]
        elif why is not None:
            held, began = await bmdb.hold_recoveries(
                input.provider,
                reason=why,
                silent_count=len(silent),
                threshold=hold_threshold(rule, watched.count),
                sample=[m.provider_id for m in silent[:_HELD_SAMPLE]],
            )
            hold = _hold_payload(held)
            if not hold.released:
                log.error(
                    "recoveries of provider %s %s: %s; no machine signalled. Once the cause is known: "
                    "shepherd fleet --release-recoveries --provider %s --reason ...",
                    input.provider,
                    "held" if began else f"still held (since {hold.since})",
                    why,
                    input.provider,
                )
                return WatchdogResult([], len(silent), watched.count, hold, len(spared))
            log.warning("recoveries of provider %s held (%s) but released by %s", input.provider, why, held.released_by)
        untold = [m for m in silent if not _told_lately(m, as_of, input.heartbeat_within)]
        signalled = await self._signal_silent(input.provider, untold)
        return WatchdogResult(signalled, len(silent), watched.count, hold, len(spared))

    @activity.defn
    async def signal_silent_machines(self, input: WatchdogInput) -> list[str]:
        """watch_silent_machines as passes scheduled before the circuit breaker call it: whom it signalled."""
        return (await self.watch_silent_machines(input)).signalled

    async def _signal_silent(self, provider: str, silent: Sequence[SilentMachine]) -> list[str]:
        # Logged before the signals: the recovery (or quarantine) a signal starts writes its own events at once,
        # and the log must tell the cause before its effect.
        await self.deps.bmdb.record_heartbeats_lost(silent)

        async def signal(machine: SilentMachine) -> SilentMachine | None:
            handle = self.deps.client.get_workflow_handle(machine_workflow_id(provider, machine.provider_id))
            try:
                lost = HeartbeatLost(machine.cause(), key_fingerprint(machine.agent_public_key))
                await handle.signal(HEARTBEAT_LOST_SIGNAL, lost)
            except RPCError as error:
                # No running workflow: the ensure step of the next pass starts one.
                log.warning("cannot signal %s: %s", handle.id, error)
                return None
            return machine

        told = [m for m in await each_at_most(silent, TEMPORAL_CALLS_IN_FLIGHT, signal) if m is not None]
        await self.deps.bmdb.record_silence_signalled(told)
        signalled = [m.provider_id for m in told]
        # Counted here, where the looks of the workers and of the passes both signal.
        self.deps.metrics.silent_signalled.add(len(signalled), {"provider": provider})
        if signalled:
            log.info("agents silent on %d machine(s): %s", len(signalled), ", ".join(signalled[:20]))
        return signalled

    @activity.defn
    async def admit_machine(self, input: AdmitInput) -> str:
        """Record the machine in BMDB, then start its workflow; returns the machine id."""
        machine_id, _ = await self.deps.bmdb.admit_machine(input.provider, input.provider_id)
        await start_machine_workflow(
            self.deps.client, self.deps.settings, input.provider, input.provider_id, str(machine_id)
        )
        return str(machine_id)

    @activity.defn
    async def ensure_machine_workflows(self, input: EnsureWorkflowsInput) -> EnsureWorkflowsResult:
        """Start the workflow of every BMDB machine that has none running, unless it was decommissioned."""
        provided = await self.deps.bmdb.list_provided(input.provider)
        in_bmdb = [m for m in provided if not m.retired]
        # Only this provider's: in a fleet of several, each pass would otherwise count or list all of them.
        query = running_machines_of(input.provider)
        listed_at = self._listed_at.get(input.provider)
        if listed_at is not None and self._clock() - listed_at < self._full_listing_every:
            if (await self.deps.client.count_workflows(query)).count == len(in_bmdb):
                return EnsureWorkflowsResult(machines=len(in_bmdb), started=[], listed=False)
        listing_started = self._clock()
        running: set[str] = set()
        async for execution in self.deps.client.list_workflows(query):
            running.add(execution.id)
        self._listed_at[input.provider] = listing_started
        expected = {machine_workflow_id(input.provider, m.provider_id): m for m in in_bmdb}
        # A decommissioned machine's workflow runs on a moment after BMDB marks it retired.
        retired = {machine_workflow_id(input.provider, m.provider_id) for m in provided if m.retired}
        strays = sorted(running - expected.keys() - retired)
        if strays:
            log.warning(
                "%d running %s machine workflow(s) of machines BMDB does not manage: %s",
                len(strays),
                input.provider,
                ", ".join(strays[:_DISAGREEMENTS_SHOWN]),
            )

        async def start(machine: ProvidedMachine) -> str | None:
            activity.heartbeat(machine.provider_id)
            # Visibility lags behind starts, so "not listed" may still be running:
            # start_machine_workflow tells the two apart.
            if not await start_machine_workflow(
                self.deps.client, self.deps.settings, input.provider, machine.provider_id, str(machine.machine_id)
            ):
                return None
            log.info("started the missing workflow of %s machine %s", input.provider, machine.provider_id)
            return machine.provider_id

        missing = [m for workflow_id, m in expected.items() if workflow_id not in running]
        started = [p for p in await each_at_most(missing, TEMPORAL_CALLS_IN_FLIGHT, start) if p is not None]
        return EnsureWorkflowsResult(machines=len(in_bmdb), started=started, listed=True)


def _told_lately(machine: SilentMachine, as_of: datetime, heartbeat_within: float) -> bool:
    """Whether a look leaves the silent machine's workflow untold: told within a heartbeat timeout, or its recovery
    under way (it confirmed the silence) since less than CONFIRMED_SILENCE_TOLD_AGAIN_AFTER.

    Told once is enough while the workflow recovers or coalesces the news into the recovery it runs: telling it at
    every look until the recovery forgets the agent cost a rack's recovery a signal a machine a look. Unconfirmed a
    heartbeat timeout on, it is told again, in case the signal was lost (its workflow reset or restarted).
    """
    if machine.confirmed_at is not None and machine.confirmed_at >= as_of - CONFIRMED_SILENCE_TOLD_AGAIN_AFTER:
        return True
    return machine.signalled_at is not None and machine.signalled_at >= as_of - timedelta(seconds=heartbeat_within)


def _spared(
    provider: str, rule: RecoveryHoldRule, silent: list[SilentMachine], ended: datetime | None, as_of: datetime
) -> list[SilentMachine]:
    """The silent machines that fell silent before a hold of the provider's recoveries ended, within its grace."""
    spared = [m for m in silent if spared_after_hold(rule, last_seen=m.last_seen, hold_ended=ended, as_of=as_of)]
    if spared and ended is not None:
        log.info(
            "%d %s machine(s) silent since before the hold ended at %s: left to come back until %s",
            len(spared),
            provider,
            ended.isoformat(timespec="seconds"),
            (ended + timedelta(seconds=rule.grace_after_hold)).isoformat(timespec="seconds"),
        )
    return spared


def _hold_payload(held: HeldRecoveries) -> RecoveryHold:
    return RecoveryHold(
        provider=held.provider,
        since=held.held_since.isoformat(),
        reason=held.reason,
        silent_count=held.silent_count,
        threshold=held.threshold,
        sample=held.sample,
        released_at=held.released_at.isoformat() if held.released_at else None,
        released_by=held.released_by,
        release_reason=held.release_reason,
    )
