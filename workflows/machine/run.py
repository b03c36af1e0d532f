"""One run of a machine's workflow: what it knows (the machine's status, the operators' requests not yet carried
out) and how it runs a step: one activity attempt at a time, spaced by the stage's back-off with a durable timer,
paused for a maintenance, left for a decommission, flagged stuck past the stage's deadline, and continued in a new
run once its history holds enough attempts.

The back-off lives here rather than in the activity's retry policy: the ``status`` query then knows the attempt
count and the last error, and the Temporal UI shows every failed attempt in the history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.failures import describe_failure, failure_type
from workflows.machine import activities
from workflows.machine.details import current_details

with workflow.unsafe.imports_passed_through():
    from activities.recovery import RecoveryActivities
    from lifecycle.contracts import (
        MACHINE_STAGE,
        Backoff,
        Decommission,
        MachineInput,
        MachineStage,
        MachineStatus,
        Maintenance,
        MaintenanceInput,
        QuarantineInput,
        RecoveryKind,
        RecoveryRequest,
        Stuck,
        StuckInput,
        machine_search_attributes,
    )

T = TypeVar("T")

# Back-offs recorded before a stage that outlasts its deadline was flagged stuck were one timer each.
_STUCK_FLAG = "stuck-flag"
# Step attempts recorded before a failing step continued as new made one long history.
_SHORT_STEP_HISTORY = "failing-step-continues-as-new"
# Attempts of a failing step in one run, before it continues as new: a machine that fails for months keeps a
# history of a few hundred events.
STEP_ATTEMPTS_PER_RUN = 50
# Failures a retry soon cannot mend: the step waits its longest back-off, or an operator's retry_now.
_WAITS_FOR_AN_OPERATOR = frozenset({"MACHINE_UNSUPPORTED", "MaintenanceHold"})


class DecommissionNow(Exception):
    """Leaves a step's retries, a maintenance or a quarantine for the decommission an operator asked for."""


class ContinueStep(Exception):
    """Leaves a step that has failed STEP_ATTEMPTS_PER_RUN times in this run, to go on in a new one."""


class MachineRun:
    """A run's state, and the step engine the lifecycle and the operators' flows share."""

    def __init__(self, input: MachineInput) -> None:
        self._log_fields = {
            "machine_id": input.machine_id,
            "provider": input.provider,
            "provider_id": input.provider_id,
        }
        self._status = status = input.status or MachineStatus(
            machine_id=input.machine_id,
            provider=input.provider,
            provider_id=input.provider_id,
            stage=MachineStage.PROVISIONING,
            stage_since="",
        )
        status.stage_since = status.stage_since or self._now()
        self._attempts_before_this_run = status.attempts
        self._retry_now = False
        # (who, why) of the operator who released the quarantined machine, and whether they asked for a reimage.
        self._release: tuple[str, str] | None = None
        self._reimage_on_release = False
        # An operator's maintenance, asked for and not yet ended; and (who, why, reboot?) of its end.
        self._maintenance_asked: Maintenance | None = input.maintenance
        self._maintenance_off: tuple[str, str, bool] | None = None
        # An operator's decommission, asked for; it begins at the next safe point.
        self._decommission_asked: Decommission | None = input.decommission
        # (who, why) of an operator's restart of the agent of this WATCHING machine; the next run takes it over.
        self._restart_asked: tuple[str, str] | None = None
        # The running agent this run's takeover replaces, if a restart continued the workflow as new.
        self._replacing = input.replace_agent
        # Whether this run's recovery was begun with workflows.machine.flows.RECOVERY_OF_TODAY's marker.
        self._recovery_of_today = False

    def _decommission_pending(self) -> bool:
        return self._decommission_asked is not None and self._status.stage is not MachineStage.DECOMMISSIONING

    def _stop_if_decommissioned(self) -> None:
        """At a safe point (no activity under way): leave for the decommission, if one was asked for."""
        if self._decommission_pending():
            raise DecommissionNow()

    async def _until_success(
        self, backoff: Backoff, attempt: Callable[[], Awaitable[T]], *, stuck_after: float | None = None
    ) -> T:
        """Run attempt until it succeeds, waiting backoff between failures.

        stuck_after: seconds in the stage after which the machine is flagged stuck (not failed): it keeps trying.
        """
        status = self._status
        while True:
            self._stop_if_decommissioned()
            if self._maintenance_asked is not None:
                await self._in_maintenance()
            if self._history_full_of_attempts():
                raise ContinueStep()
            status.attempts += 1
            try:
                result = await attempt()
            except ActivityError as error:
                status.last_error = describe_failure(error)
                delay = backoff.delay(status.attempts)
                if failure_type(error) in _WAITS_FOR_AN_OPERATOR:
                    # No retry soon can change the machine's architecture or lift the provider's maintenance: try
                    # again after the longest back-off, or at once on retry_now (an agent for it configured, the
                    # machine replaced, the maintenance lifted).
                    delay = backoff.maximum
                status.next_attempt_at = (workflow.now() + timedelta(seconds=delay)).isoformat()
                self._show_details()
                workflow.logger.warning(
                    "%s attempt %d failed, next in %.0fs: %s",
                    status.stage,
                    status.attempts,
                    delay,
                    status.last_error,
                    extra=self._log_fields,
                )
                await self._back_off(delay, stuck_after)
                continue
            self._retry_now = False
            status.attempts = 0
            status.next_attempt_at = None
            status.last_error = None
            if status.stuck is not None:
                await self._record_stuck(False, f"{status.stage} done after {self._in_stage()}")
                status.stuck = None
            return result

    async def _back_off(self, delay: float, stuck_after: float | None) -> None:
        """Wait delay seconds or until retry_now, flagging the machine stuck when its stage outlasts stuck_after.

        A retry_now that came during the attempt counts: the fix may have come too late for it.
        """
        summary = f"back-off after {self._status.stage} attempt {self._status.attempts}"
        if stuck_after is None or not workflow.patched(_STUCK_FLAG):
            try:
                await workflow.wait_condition(self._wake_from_back_off, timeout=delay, timeout_summary=summary)
            except TimeoutError:
                pass
            self._retry_now = False
            return
        until = workflow.now() + timedelta(seconds=delay)
        while not self._wake_from_back_off() and workflow.now() < until:
            wake = until
            if self._status.stuck is None:
                stuck_at = datetime.fromisoformat(self._status.stage_since) + timedelta(seconds=stuck_after)
                if stuck_at <= workflow.now():
                    await self._flag_stuck(stuck_after)
                    continue
                wake = min(until, stuck_at)
            try:
                await workflow.wait_condition(
                    self._wake_from_back_off, timeout=wake - workflow.now(), timeout_summary=summary
                )
            except TimeoutError:
                pass
        self._retry_now = False

    def _history_full_of_attempts(self) -> bool:
        """Whether a step that can resume in a new run has failed STEP_ATTEMPTS_PER_RUN times in this one."""
        if self._status.stage not in (MachineStage.PROVISIONING, MachineStage.AGENT_STARTING):
            return False
        if self._status.attempts - self._attempts_before_this_run < STEP_ATTEMPTS_PER_RUN:
            return False
        return workflow.patched(_SHORT_STEP_HISTORY)

    def _wake_from_back_off(self) -> bool:
        # An operator's retry_now, or maintenance or a decommission to begin before the next attempt.
        return self._retry_now or self._maintenance_asked is not None or self._decommission_pending()

    async def _flag_stuck(self, stuck_after: float) -> None:
        status = self._status
        why = f"{status.stage} for {self._in_stage()}, longer than its {timedelta(seconds=stuck_after)} deadline"
        status.stuck = Stuck(since=self._now(), reason=why, last_error=status.last_error)
        workflow.logger.warning("stuck: %s; still trying: %s", why, status.last_error, extra=self._log_fields)
        self._show_details()
        await self._record_stuck(True, f"{why}; last error: {status.last_error}")

    async def _in_maintenance(self) -> bool:
        """Stay in MAINTENANCE until an operator ends it, then go back to the stage left; True if a reboot was asked."""
        status = self._status
        asked = self._maintenance_asked
        assert asked is not None
        asked.left, asked.since = status.stage, self._now()
        status.maintenance = asked
        self._set_stage(MachineStage.MAINTENANCE)
        await self._record_maintenance(True, f"by {asked.by}: {asked.reason} (it was {asked.left})")
        await workflow.wait_condition(lambda: self._maintenance_off is not None or self._decommission_pending())
        self._stop_if_decommissioned()
        assert self._maintenance_off is not None
        by, reason, recover = self._maintenance_off
        await self._record_maintenance(False, f"by {by}: {reason}" + ("; reboot asked" if recover else ""))
        status.maintenance, self._maintenance_asked, self._maintenance_off = None, None, None
        self._set_stage(asked.left)
        if recover and status.stage is not MachineStage.RECOVERING:
            # The operator's reboot stands in for whatever the watchdog asked during the maintenance.
            status.recovery_requested = RecoveryRequest(reason, by, RecoveryKind.MAINTENANCE_OVER)
            self._show_details()
        return recover

    async def _record_quarantine(self, quarantined: bool, detail: str) -> None:
        mark = QuarantineInput(machine_id=self._status.machine_id, quarantined=quarantined, detail=detail[:1000])
        verb = "quarantine" if quarantined else "release"
        await activities.mark(RecoveryActivities.record_quarantine, mark, f"{verb} {self._status.provider_id} in BMDB")

    async def _record_stuck(self, stuck: bool, detail: str) -> None:
        mark = StuckInput(machine_id=self._status.machine_id, stuck=stuck, detail=detail[:1000])
        verb = "flag" if stuck else "clear"
        await activities.mark(
            RecoveryActivities.record_stuck, mark, f"{verb} {self._status.provider_id} as stuck in BMDB"
        )

    async def _record_maintenance(self, on: bool, detail: str) -> None:
        mark = MaintenanceInput(machine_id=self._status.machine_id, on=on, detail=detail[:1000])
        verb = "on" if on else "off"
        await activities.mark(
            RecoveryActivities.record_maintenance, mark, f"maintenance {verb} for {self._status.provider_id}"
        )

    def _in_stage(self) -> timedelta:
        elapsed = workflow.now() - datetime.fromisoformat(self._status.stage_since)
        return timedelta(seconds=round(elapsed.total_seconds()))

    def _set_stage(self, stage: MachineStage) -> None:
        if stage is not self._status.stage:
            self._status.stage = stage
            self._status.stage_since = self._now()
            self._status.last_error = None
        status = self._status
        workflow.upsert_search_attributes(
            machine_search_attributes(status.provider, status.provider_id, status.machine_id, stage)
        )
        self._show_details()

    @staticmethod
    def _shows_stage(stage: MachineStage) -> bool:
        """Whether the run's search attributes show the stage already (the UI's list filters on it)."""
        return workflow.info().typed_search_attributes.get(MACHINE_STAGE) == stage.value

    def _show_details(self) -> None:
        """The Temporal UI's "current details" of this machine: who it is and how it is doing."""
        workflow.set_current_details(current_details(self._status, self._decommission_asked))

    @staticmethod
    def _now() -> str:
        return workflow.now().isoformat()
