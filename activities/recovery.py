"""RECOVERING: reboot (or reimage) the machine through its provider once per recovery cycle, record it, wait for
the boot; and the BMDB marks of machines an operator looks after (quarantined, stuck, in maintenance)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from temporalio import activity
from temporalio.common import MetricCounter
from temporalio.exceptions import ApplicationError

from activities.deps import ActivityDeps, provider_errors
from lifecycle.boot_evidence import ResetEvidence, ResetSeen, judge_reset, reset_over_ssh
from lifecycle.contracts import (
    AgentCheckInput,
    BootWaitInput,
    BootWaitResult,
    MaintenanceInput,
    OperatorActionInput,
    QuarantineInput,
    RebootInput,
    RebootResult,
    RecoveryKind,
    ReimageResult,
    SilenceCheck,
    SilenceCheckInput,
    StuckInput,
)
from lifecycle.inputs import recovery_hold_rule
from lifecycle.takeover import key_fingerprint, wait_until_booted
from lifecycle.watchdog import spared_after_hold
from providers import KnowsResets, Reimager

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often a rebooted machine's SSH port is tried while it boots.
BOOT_POLL_SECONDS = 2.0


class RecoveryActivities:
    """Side effects of RECOVERING: the provider's reboot, its record in BMDB, and the wait until the machine is back."""

    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn
    async def reboot_through_provider(self, input: RebootInput) -> RebootResult:
        """Power-cycle the machine through its provider, unless this recovery cycle's reboot is recorded already,
        or was asked by an attempt that died before its answer came and the machine shows it was done.

        Nothing is written here after the provider's call, so a BMDB blip cannot make a retry reboot again:
        record_reboot, a step of its own, writes the record.
        """
        machine_id = uuid.UUID(input.machine_id)
        if await self.deps.bmdb.reboot_recorded(machine_id, input.cycle):
            log.info(
                "%s machine %s: recovery cycle %s rebooted it already", input.provider, input.provider_id, input.cycle
            )
            return RebootResult(went_down=True, detail=f"rebooted already in recovery cycle {input.cycle}")
        # A workflow older than recovery cycles names none: its reboots cannot be told apart.
        asked_before = (
            await self.deps.bmdb.ask_reboot(machine_id, input.cycle, datetime.now(UTC)) if input.cycle else None
        )
        if asked_before is not None:
            done = await self._reboot_done_unanswered(input, asked_before)
            if done is not None:
                return done
        try:
            rebooted = await _counted(
                self.deps.metrics.reboots,
                input.kind,
                lambda: self.deps.provider(input.provider).reboot_machine(input.provider_id),
            )
        except Exception:
            # The call ended in this attempt, with the provider's error: a retry asks as for the first time. Only an
            # attempt that died with the call under way leaves its ask behind.
            if input.cycle:
                await self.deps.bmdb.reboot_answered(machine_id, input.cycle)
            raise
        log.info("rebooted %s machine %s: %s (%s)", input.provider, input.provider_id, input.cause, rebooted.detail)
        return RebootResult(went_down=rebooted.went_down, detail=rebooted.detail)

    async def _reboot_done_unanswered(self, input: RebootInput, asked_at: datetime) -> RebootResult | None:
        """The result of the reboot an attempt before asked at asked_at and never heard answered, when the provider
        or the machine shows it done; None when they show it was not, or show nothing within the boot deadline
        from the ask: then the reboot is asked again.

        While nothing shows, the machine may be booting from that reboot: this waits, as the boot wait does, and
        past this attempt's time raises a retryable error for the next attempt to wait on.
        """
        give_up_at = asked_at + timedelta(seconds=self.deps.settings.boot_deadline)
        info = activity.info()
        attempt_ends = info.started_time + (info.start_to_close_timeout or timedelta(0)) - timedelta(seconds=10)
        asked = f"the reboot asked at {asked_at.isoformat(timespec='seconds')} by an attempt that died unanswered"
        while True:
            evidence = await self._reset_evidence(input, asked_at)
            if evidence.seen is ResetSeen.RESET:
                log.info("%s machine %s: %s was done (%s)", input.provider, input.provider_id, asked, evidence.detail)
                return RebootResult(went_down=True, detail=f"{asked} was done: {evidence.detail}")
            if evidence.seen is ResetSeen.NOT_RESET:
                log.info(
                    "%s machine %s: %s never reached it (%s): asking again",
                    input.provider,
                    input.provider_id,
                    asked,
                    evidence.detail,
                )
                return None
            now = datetime.now(UTC)
            if now >= give_up_at:
                log.warning(
                    "%s machine %s: nothing showed %s within the boot deadline (%s): asking again",
                    input.provider,
                    input.provider_id,
                    asked,
                    evidence.detail,
                )
                return None
            if now + timedelta(seconds=BOOT_POLL_SECONDS) >= attempt_ends:
                raise ApplicationError(
                    f"{asked} may still be booting it ({evidence.detail}); not asked again before "
                    f"{give_up_at.isoformat(timespec='seconds')}",
                    type="RebootMayBeUnderWay",
                )
            activity.heartbeat()
            await asyncio.sleep(BOOT_POLL_SECONDS)

    async def _reset_evidence(self, input: RebootInput, asked_at: datetime) -> ResetEvidence:
        """What the provider's record of resets, or else the machine's own uptime, says of a reboot asked at
        asked_at."""
        provider = self.deps.provider(input.provider)
        if isinstance(provider, KnowsResets):
            async with provider_errors():
                reset_at = await provider.last_reset(input.provider_id)
            return judge_reset(reset_at, asked_at, f"provider {input.provider}'s record")
        async with provider_errors():
            machine = await provider.get_machine(input.provider_id)
        if machine.address is None:
            return ResetEvidence(ResetSeen.UNKNOWN, f"{input.provider} lists no address for {input.provider_id}")
        record = await self.deps.bmdb.get_machine(uuid.UUID(input.machine_id))
        target = self.deps.target(input.machine_id, machine, record.ssh_host_key if record is not None else None)
        settings = self.deps.settings
        return await reset_over_ssh(
            target, asked_at, self.deps.ssh_key, settings.ssh_connect_timeout, settings.ssh_exec_timeout
        )

    @activity.defn
    async def reimage_through_provider(self, input: RebootInput) -> ReimageResult:
        """Reimage the machine through its provider, unless this recovery cycle's reimage is recorded already;
        reimaged False, and nothing done, when the provider cannot reimage.

        As for a reboot, nothing is written here: record_reboot, a step of its own, records the reimage.
        """
        provider = self.deps.provider(input.provider)
        if not isinstance(provider, Reimager):
            return ReimageResult(False, f"provider {input.provider} cannot reimage a machine")
        # The worker's setting, read here rather than fixed in a workflow's policy: machines whose workflows began
        # before reimaging existed follow it too.
        if input.kind is RecoveryKind.HEARTBEAT_LOST and not self.deps.settings.reimage_before_quarantine:
            return ReimageResult(False, "reimage_before_quarantine is off")
        if await self.deps.bmdb.reboot_recorded(uuid.UUID(input.machine_id), input.cycle):
            return ReimageResult(True, f"reimaged already in recovery cycle {input.cycle}")
        reimaged = await _counted(
            self.deps.metrics.reimages,
            input.kind,
            lambda: provider.reimage_machine(input.provider_id, self.deps.ssh_public_key),
        )
        log.info("reimaged %s machine %s: %s (%s)", input.provider, input.provider_id, input.cause, reimaged.detail)
        return ReimageResult(True, reimaged.detail)

    @activity.defn
    async def record_reboot(self, input: RebootInput) -> None:
        """Record the cycle's reboot or reimage and forget the machine's agent and heartbeats (and, after a reimage,
        its pinned host key); a repeat changes nothing."""
        what = "reimaged" if input.reimage else "rebooted"
        machine_id = uuid.UUID(input.machine_id)
        if not await self.deps.bmdb.record_reboot(
            machine_id, input.cycle, f"{what}: {input.cause}", reimaged=input.reimage
        ):
            log.info(
                "%s machine %s: %s of cycle %s was recorded already",
                input.provider,
                input.provider_id,
                "reimage" if input.reimage else "reboot",
                input.cycle,
            )

    @activity.defn
    async def wait_for_boot(self, input: BootWaitInput) -> BootWaitResult:
        """Wait until the rebooted machine answers SSH again, at most the boot deadline from the first attempt.

        A machine the provider did not see go down must first stop answering, or its old boot would count.
        Heartbeats carry what was seen, so a retry on another worker goes on where this one stopped.
        """
        info = activity.info()
        deadline = input.deadline if input.deadline is not None else self.deps.settings.boot_deadline
        until = info.scheduled_time + timedelta(seconds=deadline)
        seen_down = input.went_down or bool(info.heartbeat_details and info.heartbeat_details[0])
        # At once (an attempt's first heartbeat is never held back), so the Temporal UI shows the wait under way and
        # what it has seen before the first probe ends. A lost attempt is freed by the heartbeat timeout either way:
        # the server times it from the attempt's start.
        activity.heartbeat(seen_down)
        async with provider_errors():
            machine = await self.deps.provider(input.provider).get_machine(input.provider_id)
        if machine.address is None:
            return BootWaitResult(False, 0.0, f"{input.provider} lists no address for {input.provider_id}")
        started = time.monotonic()
        where = f"{machine.address}:{machine.ssh_port}"
        came_back, seen_down = await wait_until_booted(
            machine.address,
            machine.ssh_port,
            seen_down=seen_down,
            until=until,
            probe_within=self.deps.settings.ssh_connect_timeout,
            poll=BOOT_POLL_SECONDS,
            progress=activity.heartbeat,
        )
        waited = time.monotonic() - started
        if came_back:
            return BootWaitResult(True, waited, f"SSH at {where} answers again")
        said = "did not answer again" if seen_down else "never went away (the reboot was not seen)"
        return BootWaitResult(False, waited, f"SSH at {where} {said} within {deadline:g}s")

    @activity.defn
    async def record_quarantine(self, input: QuarantineInput) -> None:
        """Mark the machine quarantined in BMDB (the watchdog then leaves it out), or released; with an event."""
        if not await self.deps.bmdb.set_quarantined(uuid.UUID(input.machine_id), input.quarantined, input.detail):
            log.info("machine %s was %s already", input.machine_id, "quarantined" if input.quarantined else "released")

    @activity.defn
    async def record_stuck(self, input: StuckInput) -> None:
        """Flag the machine stuck in BMDB (its stage outlasted its deadline), or clear the flag; with an event."""
        await self.deps.bmdb.set_stuck(uuid.UUID(input.machine_id), input.stuck, input.detail)

    @activity.defn
    async def record_maintenance(self, input: MaintenanceInput) -> None:
        """Mark the machine in maintenance in BMDB (the watchdog then leaves it out), or out of it; with an event."""
        await self.deps.bmdb.set_maintenance(uuid.UUID(input.machine_id), input.on, input.detail)

    @activity.defn
    async def check_agent_after_maintenance(self, input: AgentCheckInput) -> bool:
        """True when the machine's agent still heartbeats; else forget it, so a takeover starts a new one."""
        machine_id = uuid.UUID(input.machine_id)
        if await self.deps.bmdb.agent_alive(machine_id, self.deps.settings.heartbeat_timeout):
            return True
        await self.deps.bmdb.forget_silent_agent(
            machine_id, f"silent after maintenance ({input.why}): taken over again"
        )
        return False

    @activity.defn
    async def confirm_silence(self, input: SilenceCheckInput) -> SilenceCheck:
        """Whether BMDB still finds the machine's agent silent, by the watchdog's rule, with its provider's recoveries
        not held: read as the recovery a heartbeat_lost asked for begins, so a forged or stale signal reboots nothing.

        An unconfirmed silence is logged as a ``heartbeat_lost_unconfirmed`` event saying why.
        """
        bmdb, settings = self.deps.bmdb, self.deps.settings
        machine_id = uuid.UUID(input.machine_id)
        as_of = datetime.now(UTC)
        held, hold_ended = await bmdb.recovery_hold_state(input.provider)
        silent = await bmdb.silent_machines(
            input.provider,
            as_of=as_of,
            first_heartbeat_within=settings.first_heartbeat_timeout,
            heartbeat_within=settings.heartbeat_timeout,
            machine_id=machine_id,
        )
        found = silent[0] if silent else None
        if held:
            why = f"the recoveries of provider {input.provider} are held"
        elif found is None:
            why = "its agent heartbeats, or the watchdog does not watch it (quarantined, in maintenance, retired)"
        elif input.agent_key_fingerprint is not None and key_fingerprint(found.agent_public_key) != (
            input.agent_key_fingerprint
        ):
            why = f"the silent agent on record is not the one it watches ({input.agent_key_fingerprint})"
        elif spared_after_hold(
            recovery_hold_rule(settings), last_seen=found.last_seen, hold_ended=hold_ended, as_of=as_of
        ):
            why = "it fell silent while its provider's recoveries were held, and its grace after the hold runs"
        else:
            # The watchdog leaves the silence to this recovery from now on, rather than telling it again.
            await bmdb.record_silence_confirmed(found)
            return SilenceCheck(True, found.cause())
        detail = f"not recovered: {why}"
        # Were the agent to fall silent again, the watchdog tells the workflow at once, not a heartbeat timeout on.
        await bmdb.forget_silence_signalled(machine_id)
        await bmdb.add_event(machine_id, "heartbeat_lost_unconfirmed", detail)
        log.warning("%s machine %s: heartbeat_lost %s", input.provider, input.machine_id, detail)
        return SilenceCheck(False, detail)

    @activity.defn
    async def record_operator_action(self, input: OperatorActionInput) -> None:
        """Log what an operator asked of the machine, at the time it was asked; a repeat adds nothing."""
        at = datetime.fromisoformat(input.at) if input.at else None
        await self.deps.bmdb.add_event(uuid.UUID(input.machine_id), input.kind, input.detail, at=at)

    @activity.defn
    async def reboot_machine(self, input: RebootInput) -> None:
        """Reboot and record in one step, as recoveries begun before the split run it; run twice, it reboots twice."""
        await self.reboot_through_provider(input)
        await self.deps.bmdb.forget_agent(uuid.UUID(input.machine_id), f"rebooted: {input.cause}")


async def _counted(counter: MetricCounter, kind: RecoveryKind | None, call: Callable[[], Awaitable[T]]) -> T:
    """What the provider call answered, counted by the recovery's cause and the outcome (ok or error); a provider
    error that retrying cannot mend becomes a non-retryable activity error."""
    cause = _cause_label(kind)
    try:
        async with provider_errors():
            answer = await call()
    except Exception:
        counter.add(1, {"cause": cause, "outcome": "error"})
        raise
    counter.add(1, {"cause": cause, "outcome": "ok"})
    return answer


def _cause_label(kind: RecoveryKind | None) -> str:
    """The metric label of a recovery's kind: heartbeat_lost or forced (an operator's, however asked)."""
    if kind is None:
        return "unknown"  # a reboot scheduled by a workflow older than the kind
    return "heartbeat_lost" if kind is RecoveryKind.HEARTBEAT_LOST else "forced"
