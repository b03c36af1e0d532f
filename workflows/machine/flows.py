"""What a machine goes through besides its bring-up: a recovery cycle (reboot once, record it, wait for the boot),
a reimage once recoveries exceed the budget, a quarantine when that did not help, a maintenance of a WATCHING
machine, and a decommission."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.failures import describe_failure
from workflows.machine import activities
from workflows.machine.run import MachineRun

with workflow.unsafe.imports_passed_through():
    from activities.decommission import DecommissionActivities
    from lifecycle.contracts import (
        AgentCheckInput,
        Decommissioned,
        DecommissionInput,
        LifecyclePolicy,
        MachineInput,
        MachineStage,
        MachineStatus,
        Quarantine,
        RebootInput,
        RecoveryKind,
        RecoveryRecord,
        RecoveryRequest,
        RetireInput,
        RetireResult,
        SilenceCheckInput,
    )


# Recoveries asked by heartbeat_lost before BMDB confirmed the silence at the recovery's start went ahead at once.
_SILENCE_CONFIRMED = "silence-confirmed-before-recovery"
# Recoveries recorded before a cycle rebooted once, recorded apart and waited for the boot ran reboot_machine.
_REBOOT_ONCE = "reboot-once-then-wait-for-boot"
# Recoveries recorded before the recovery budget never quarantined.
_RECOVERY_BUDGET = "recovery-budget"
# Recoveries past the budget recorded before reimaging existed quarantined at once.
_REIMAGE = "reimage-before-quarantine"
# Recoveries recorded before the silence's confirmation and the reboot's record ran as local activities scheduled
# them on the task queue, each a dispatch and a workflow task more.
_BMDB_STEPS_LOCAL = "recovery-bmdb-steps-local"
# Recoveries recorded before this one marker stood for every change above and for the takeover in the recovery's
# own run (workflows.machine.workflow) marked each: a marker and, from the SDK, a TemporalChangeVersion upsert,
# which is a visibility write; five a recovery.
RECOVERY_OF_TODAY = "recovery-one-marker-takeover-in-its-run"


class MachineFlows(MachineRun):
    """The recovery, quarantine, maintenance and decommission flows of a machine's run."""

    async def _maintenance_from_watching(self) -> bool:
        """Maintenance of a WATCHING machine; True when its agent fell silent meanwhile and must be taken over again.

        The watchdog's requests made before or during it are about an agent the maintenance may have stopped: the
        agent's heartbeat decides instead. An operator's forced recovery stands.
        """
        status = self._status
        if await self._in_maintenance():
            return False
        if status.recovery_requested is not None and not status.recovery_requested.by_an_operator:
            status.recovery_requested = None
        if status.recovery_requested is not None:
            return False
        check = AgentCheckInput(machine_id=status.machine_id, why="after maintenance")
        alive = await activities.agent_alive(check, status.provider_id)
        if not alive:
            workflow.logger.info("agent silent after maintenance: taking over again", extra=self._log_fields)
        return not alive

    async def _recovery_goes_ahead(self) -> bool:
        """Whether the recovery asked for goes ahead: an operator's always; the watchdog's only when BMDB still finds
        the agent silent, with its provider's recoveries not held, so a forged or stale heartbeat_lost (anyone who
        can signal the workflow can send one) reboots nothing. An unconfirmed one is dropped, and logged in BMDB."""
        status = self._status
        requested = status.recovery_requested
        if requested is None:
            return False
        self._recovery_of_today = workflow.patched(RECOVERY_OF_TODAY)
        if requested.by_an_operator or not self._recovery_patched(_SILENCE_CONFIRMED):
            return True
        agent = status.agent.key_fingerprint if status.agent is not None else None
        # An operator's recovery asked meanwhile takes the watchdog's place (_request_recovery), and goes ahead.
        check = await activities.confirm_silence(
            SilenceCheckInput(status.machine_id, status.provider, agent),
            status.provider_id,
            local=self._recovery_patched(_BMDB_STEPS_LOCAL),
        )
        requested = status.recovery_requested
        if check.confirmed or (requested is not None and requested.by_an_operator):
            return requested is not None
        workflow.logger.warning("heartbeat_lost %s", check.detail, extra=self._log_fields)
        status.recovery_requested = None
        return False

    def _recovery_patched(self, patch: str) -> bool:
        """Whether this recovery takes the branch patch added: every recovery begun since RECOVERY_OF_TODAY does,
        without a marker of its own; one begun before, as its history says."""
        return self._recovery_of_today or workflow.patched(patch)

    def _within_budget_window(self, policy: LifecyclePolicy) -> list[RecoveryRecord]:
        """The recent recoveries the budget still counts; all of them when there is no window."""
        recent = self._status.recent_recoveries
        if policy.recovery_budget_window is None:
            return recent[-10:]
        since = workflow.now() - timedelta(seconds=policy.recovery_budget_window)
        return [r for r in recent if datetime.fromisoformat(r.at) >= since]

    def _budget_spent(self, policy: LifecyclePolicy, requested: RecoveryRequest) -> bool:
        """Whether this recovery would be one more than the budget allows; an operator's forced one never is."""
        if policy.recovery_budget is None or requested.by_an_operator:
            return False
        return len(self._within_budget_window(policy)) >= policy.recovery_budget

    async def _quarantine(self, input: MachineInput, reason: str) -> str:
        """Hold the recovery until an operator releases the machine; the reason to recover with then."""
        status = self._status
        recent = self._within_budget_window(input.policy)
        window = timedelta(seconds=input.policy.recovery_budget_window or 0)
        why = f"{len(recent)} recoveries within {window}, its budget; not rebooted again for: {reason}"
        status.quarantine = Quarantine(since=self._now(), reason=why, recoveries=recent)
        self._set_stage(MachineStage.QUARANTINED)
        workflow.logger.warning("quarantined: %s", why, extra=self._log_fields)
        await self._record_quarantine(True, why)
        await workflow.wait_condition(lambda: self._release is not None or self._decommission_pending())
        self._stop_if_decommissioned()
        assert self._release is not None
        by, released_why = self._release
        await self._record_quarantine(False, f"released by {by}: {released_why}")
        self._release = None
        status.quarantine = None
        status.recent_recoveries = []
        return f"{reason} (released by {by}: {released_why})"

    async def _recovery_cycle(self, input: MachineInput, requested: RecoveryRequest, handed: MachineStatus) -> None:
        """Recover the machine as asked: a reboot, or a reimage (asked for, or the budget's last resort), or a
        quarantine until an operator releases it; handed, the next run's status, records what was done."""
        reason = requested.describe()
        spent = self._recovery_patched(_RECOVERY_BUDGET) and self._budget_spent(input.policy, requested)
        # Past the budget, a fresh OS once before a person is called; a second time past it, the person.
        instead_of_quarantine = spent and self._may_reimage(input.policy)
        reimage = requested.reimage or instead_of_quarantine
        if spent and not instead_of_quarantine:
            reason = await self._quarantine(input, reason)
            reimage = self._reimage_on_release
        last_resort = f"{reason}; its recovery budget is spent: reimaged before a quarantine"
        reimaged = reimage and await self._reimage(
            input, last_resort if instead_of_quarantine else reason, requested.kind
        )
        if reimaged and instead_of_quarantine:
            reason = last_resort
        elif instead_of_quarantine:
            reason = await self._quarantine(input, reason)
        if not reimaged:
            self._set_stage(MachineStage.RECOVERING)
            if self._recovery_patched(_REBOOT_ONCE):
                await self._recover(input, reason, requested.kind)
            else:
                await self._until_success(
                    input.policy.recovery_backoff, lambda: self._reboot(input, reason, requested.kind)
                )
        # Requests that arrived during the reboot are answered by it.
        handed.stage, handed.agent = MachineStage.AGENT_STARTING, None
        handed.recovery_count += 1
        handed.last_recovery_reason = reason
        handed.recent_recoveries = [
            *self._within_budget_window(input.policy),
            RecoveryRecord(self._now(), reason, reimaged=reimaged),
        ]

    def _may_reimage(self, policy: LifecyclePolicy) -> bool:
        """Whether a recovery past the budget may reimage the machine: none the budget still counts did."""
        return self._recovery_patched(_REIMAGE) and not any(r.reimaged for r in self._within_budget_window(policy))

    async def _recover(self, input: MachineInput, reason: str, kind: RecoveryKind) -> None:
        """Reboot once in this recovery cycle, record it, then wait for the machine to answer SSH again.

        Each is a step of its own, so a failed record never repeats the reboot; the boot wait keeps the first
        takeover from hitting a booting machine and waiting out the agent-start back-off.
        """
        backoff = input.policy.recovery_backoff
        reboot = self._cycle_input(input, reason, kind, reimage=False)
        rebooted = await self._until_success(backoff, lambda: activities.reboot_through_provider(input, reboot))
        local = self._recovery_patched(_BMDB_STEPS_LOCAL)
        await self._until_success(backoff, lambda: activities.record_reboot(reboot, local=local))
        await self._wait_for_boot(input, rebooted.went_down)

    async def _reimage(self, input: MachineInput, reason: str, kind: RecoveryKind) -> bool:
        """Reimage once in this recovery cycle, record it (which forgets the pinned host key), then wait for the new
        OS to answer SSH; False, with nothing done, when the provider cannot reimage or the worker's setting is off.
        """
        backoff = input.policy.recovery_backoff
        reimage = self._cycle_input(input, reason, kind, reimage=True)
        self._set_stage(MachineStage.REIMAGING)
        result = await self._until_success(backoff, lambda: activities.reimage_through_provider(input, reimage))
        if not result.reimaged:
            workflow.logger.warning("not reimaged: %s", result.detail, extra=self._log_fields)
            return False
        local = self._recovery_patched(_BMDB_STEPS_LOCAL)
        await self._until_success(backoff, lambda: activities.record_reboot(reimage, local=local))
        # Whatever the provider saw, SSH must first go away: the old OS may answer a while before the new one.
        await self._wait_for_boot(input, went_down=False)
        return True

    def _cycle_input(self, input: MachineInput, reason: str, kind: RecoveryKind, *, reimage: bool) -> RebootInput:
        """The input of this recovery cycle's reboot or reimage steps."""
        return RebootInput(
            provider=input.provider,
            provider_id=input.provider_id,
            machine_id=input.machine_id,
            cause=reason,
            cycle=workflow.info().run_id,
            kind=kind,
            reimage=reimage,
        )

    async def _wait_for_boot(self, input: MachineInput, went_down: bool) -> None:
        """Wait for the machine to answer SSH after its reboot or reimage; a takeover follows either way."""
        self._status.waiting_for_boot_since = self._now()
        self._show_details()
        try:
            booted = await activities.wait_for_boot(input, went_down)
            if booted.came_back:
                workflow.logger.info("back after %.0fs: %s", booted.waited, booted.detail, extra=self._log_fields)
            else:
                workflow.logger.warning("%s; taking over anyway", booted.detail, extra=self._log_fields)
        except ActivityError as error:
            # The takeover's own attempts and back-off cover a machine whose boot could not be watched.
            workflow.logger.warning(
                "cannot watch the boot (%s); taking over anyway", describe_failure(error), extra=self._log_fields
            )
        self._status.waiting_for_boot_since = None

    async def _reboot(self, input: MachineInput, reason: str, kind: RecoveryKind) -> None:
        """The recovery's reboot as recoveries begun before a cycle rebooted once ran it: one step."""
        reboot = RebootInput(input.provider, input.provider_id, input.machine_id, cause=reason, kind=kind)
        await activities.reboot_and_record(input, reboot)

    async def _decommission(self, input: MachineInput) -> Decommissioned:
        """Forget the agent in BMDB, stop it over SSH where it answers, retire the machine through its provider
        (tried until the provider does it), mark it retired in BMDB; the workflow then completes with the record."""
        status = self._status
        asked = self._decommission_asked
        assert asked is not None
        status.decommission = asked
        status.recovery_requested = status.maintenance = status.quarantine = status.stuck = None
        self._maintenance_asked = self._maintenance_off = self._release = None
        status.attempts, status.last_error, status.next_attempt_at = 0, None, None
        self._set_stage(MachineStage.DECOMMISSIONING)
        request = DecommissionInput(
            provider=input.provider,
            provider_id=input.provider_id,
            machine_id=input.machine_id,
            reason=asked.reason,
            by=asked.by,
        )
        await activities.mark(
            DecommissionActivities.forget_decommissioned_agent,
            request,
            f"forget the agent of {input.provider_id} in BMDB, so its heartbeats are refused",
        )
        try:
            asked.agent = await activities.stop_agent(input, request)
        except ActivityError as error:
            asked.agent = f"not stopped ({describe_failure(error)}); its heartbeats are refused from now on"
        self._show_details()
        retired: RetireResult = await self._until_success(
            input.policy.recovery_backoff,
            lambda: activities.retire_through_provider(input, request),
            # A provider that does not retire the machine for as long as provisioning may take is flagged.
            stuck_after=input.policy.provisioning_deadline,
        )
        asked.provider_action, asked.provider_detail = retired.action, retired.detail
        detail = (
            f"asked by {asked.by}: {asked.reason}; agent: {asked.agent}; "
            f"provider {input.provider}: {retired.action} ({retired.detail})"
        )
        await activities.mark(
            DecommissionActivities.record_retired,
            RetireInput(machine_id=input.machine_id, detail=detail[:2000]),
            f"mark {input.provider_id} retired in BMDB",
        )
        self._set_stage(MachineStage.DECOMMISSIONED)
        workflow.logger.info("decommissioned: %s", detail, extra=self._log_fields)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return Decommissioned(
            machine_id=input.machine_id,
            provider=input.provider,
            provider_id=input.provider_id,
            decommissioned_at=status.stage_since,
            reason=asked.reason,
            by=asked.by,
            agent=asked.agent,
            provider_action=retired.action,
            provider_detail=retired.detail,
        )
