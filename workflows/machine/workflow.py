"""MachineWorkflow: one machine's lifecycle, one workflow per machine.

PROVISIONING -> AGENT_STARTING -> WATCHING -> RECOVERING -> AGENT_STARTING ...
and, past the recovery budget, WATCHING -> QUARANTINED -> (an operator's release) RECOVERING;
an operator's maintenance pauses any stage at its next safe point, and a decommission ends the workflow there:
... -> DECOMMISSIONING -> DECOMMISSIONED, the one way a machine's workflow completes.

Signals: ``force_recover`` (an operator), ``heartbeat_lost`` (the fleet watchdog) and ``retry_now`` (an operator
who fixed what made a step fail); updates: ``recover`` and ``retry`` (force_recover and retry_now with the operator
API's proof checked, recorded verified), ``release`` (of a quarantined machine), ``set_maintenance``,
``decommission``, ``restart_agent`` (a new agent without a reboot: WATCHING -> AGENT_STARTING); query:
``status``. Each takes one dataclass of lifecycle.contracts. The workflow id ``machine-<provider>-<provider_id>``
makes Temporal the per-machine lock: no two workers ever act on the same machine at once.

The steps and their back-off are workflows.machine.run's, the flows besides the bring-up
workflows.machine.flows'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NoReturn

from temporalio import workflow
from temporalio.common import RawValue

from workflows.machine import activities
from workflows.machine.flows import MachineFlows
from workflows.machine.requests import ActionLog, check_proof_in_validator, given
from workflows.machine.run import ContinueStep, DecommissionNow

with workflow.unsafe.imports_passed_through():
    from lifecycle.contracts import (
        DECOMMISSION_UPDATE,
        FORCE_RECOVER_SIGNAL,
        HEARTBEAT_LOST_SIGNAL,
        RECOVER_UPDATE,
        RELEASE_UPDATE,
        RESTART_AGENT_UPDATE,
        RETRY_NOW_SIGNAL,
        RETRY_UPDATE,
        SET_MAINTENANCE_UPDATE,
        STATUS_QUERY,
        Decommission,
        Decommissioned,
        HeartbeatLost,
        MachineInput,
        MachineStage,
        MachineStatus,
        Maintenance,
        MaintenanceRequest,
        OperatorRequest,
        RecoveryKind,
        RecoveryRequest,
        credited,
    )

# Recoveries recorded before the rebooted machine was taken over in the recovery's own run continued as new right
# after the boot wait, and took it over in the next run.
_TAKEOVER_IN_RECOVERY_RUN = "takeover-in-the-recovery-run"


@workflow.defn(name="MachineWorkflow")
class MachineWorkflow(MachineFlows, ActionLog):
    """One machine's lifecycle: each step tried until it succeeds, then WATCHING until a recovery is asked for."""

    # The status exists before the first signal handler runs: a signal that
    # arrives with the start (signal-with-start, or just sent right after it)
    # is applied, not dropped.
    @workflow.init
    def __init__(self, input: MachineInput) -> None:
        super().__init__(input)

    @workflow.run
    async def run(self, input: MachineInput) -> Decommissioned | None:
        """None when the machine's life goes on in a new run (continue-as-new); what was done once decommissioned."""
        try:
            await self._live(input)
        except DecommissionNow:
            return await self._decommission(input)

    async def _live(self, input: MachineInput) -> NoReturn:
        """The machine's stages up to its next recovery cycle, which continues as new once the machine is taken over
        again; DecommissionNow at a safe point once a decommission was asked for."""
        status = self._status
        if input.search_attributes_carried and self._shows_stage(status.stage):
            self._show_details()
        else:
            self._set_stage(status.stage)
        await self._bring_up_or_continue(input)

        # A healthy machine waits here at no cost; heartbeats go to BMDB, not to
        # this workflow, and the fleet watchdog signals only silent machines.
        await workflow.wait_condition(
            lambda: (
                status.recovery_requested is not None
                or self._maintenance_asked is not None
                or self._decommission_asked is not None
                or self._restart_asked is not None
                or workflow.info().is_continue_as_new_suggested()
            )
        )
        self._stop_if_decommissioned()
        take_over_again = recovered = False
        if self._maintenance_asked is not None:
            take_over_again = await self._maintenance_from_watching()
        handed = status.handed_on(status.stage)
        if take_over_again:
            handed.stage, handed.agent = MachineStage.AGENT_STARTING, None
        elif await self._recovery_goes_ahead():
            assert status.recovery_requested is not None
            await self._recovery_cycle(input, status.recovery_requested, handed)
            recovered = True
        # Asked while the machine rebooted: the next run would not know of it.
        self._stop_if_decommissioned()
        if self._maintenance_asked is not None:
            await self._in_maintenance()
        if recovered and self._recovery_patched(_TAKEOVER_IN_RECOVERY_RUN):
            handed = await self._take_over_after_recovery(input, handed)
        # Each recovery cycle ends with a fresh history, so a machine that
        # recovers a hundred times keeps a short one.
        await workflow.wait_condition(workflow.all_handlers_finished)
        # The operators' actions up to this moment, those of the handlers just finished among them.
        handed.actions = list(self._status.actions)
        next_run = self._next_run(input, handed)
        if self._restart_asked is not None and handed.stage is MachineStage.WATCHING:
            # Checked last, so a restart accepted while this run was on its way out is not lost. As at the end of
            # a maintenance, minus the reboot: no recovery counted, no budget spent. The old agent keeps
            # heartbeating, and stays on record, until the new one's takeover replaces it.
            by, why = self._restart_asked
            workflow.logger.info("agent restart asked by %s: %s", by, why, extra=self._log_fields)
            next_run.replace_agent = handed.agent.key_fingerprint if handed.agent else None
            handed.stage, handed.agent = MachineStage.AGENT_STARTING, None
        self._carry_requests_accepted_on_the_way_out(next_run)
        workflow.continue_as_new(next_run)

    async def _take_over_after_recovery(self, input: MachineInput, handed: MachineStatus) -> MachineStatus:
        """Take the rebooted machine over in the recovery's own run, with the status the recovery handed on; the
        status the next run begins WATCHING with.

        Rather than in the next run: a new run's first task waits in the queue every worker polls, where the
        recovery's next task goes to the worker that has the workflow cached, so the machine is watched sooner
        after a rack's reboots, and its agent is heard from before the run ends.
        """
        handed.actions = list(self._status.actions)
        handed.stage_since = self._now()
        self._status, self._attempts_before_this_run = handed, 0
        # An agent restart asked before the recovery began: the takeover starts a new agent anyway.
        self._restart_asked = None
        self._set_stage(MachineStage.AGENT_STARTING)
        await self._bring_up_or_continue(input)
        watching = self._status.handed_on(MachineStage.WATCHING)
        # An operator's recovery asked during the takeover goes ahead in the next run, once it waits in WATCHING.
        watching.recovery_requested = self._status.recovery_requested
        return watching

    async def _bring_up_or_continue(self, input: MachineInput) -> None:
        """The bring-up from where the machine stands; a step that failed too often in this run goes on failing in
        a new one, which continues as new."""
        try:
            await self._bring_up(input)
        except ContinueStep:
            await workflow.wait_condition(workflow.all_handlers_finished)
            carried = self._next_run(input, self._status.handed_on(self._status.stage, failing_step=True))
            carried.replace_agent = self._replacing
            self._carry_requests_accepted_on_the_way_out(carried)
            workflow.continue_as_new(carried)

    def _carry_requests_accepted_on_the_way_out(self, next_run: MachineInput) -> None:
        """A maintenance or decommission accepted while this run waited for its handlers before continuing as new
        (the update's caller was told it would happen): the next run begins it at its first safe point.

        Carried in the input rather than begun here, so the commands of histories recorded before stay the same.
        """
        status = self._status
        if self._decommission_pending():
            next_run.decommission = self._decommission_asked
        if self._maintenance_asked is not None and status.maintenance is None:
            next_run.maintenance = self._maintenance_asked

    async def _bring_up(self, input: MachineInput) -> None:
        """PROVISIONING and AGENT_STARTING, from where the machine stands, to WATCHING."""
        status = self._status
        if status.stage is MachineStage.PROVISIONING:
            provisioned = await self._until_success(
                input.policy.provision_backoff,
                lambda: activities.provision(input),
                stuck_after=input.policy.provisioning_deadline,
            )
            status.address = provisioned.address
            self._set_stage(MachineStage.AGENT_STARTING)

        if status.stage is MachineStage.AGENT_STARTING:
            status.agent = await self._until_success(
                input.policy.agent_start_backoff,
                lambda: activities.start_agent(input, self._replacing),
                stuck_after=input.policy.agent_start_deadline,
            )
            self._replacing = None
            self._set_stage(MachineStage.WATCHING)

    @staticmethod
    def _next_run(input: MachineInput, handed: MachineStatus) -> MachineInput:
        """The next run's input: this machine and its policy, and the status handed on."""
        return MachineInput(
            input.provider,
            input.provider_id,
            input.machine_id,
            input.policy,
            status=handed,
            search_attributes_carried=True,
        )

    @workflow.signal(dynamic=True)
    async def force_recover(self, name: str, arguments: Sequence[RawValue]) -> None:
        """``force_recover``: an operator asks for a reboot, ``{"reason": "disk errors", "by": "alice"}``.

        A dynamic handler gets the argument undecoded, so a malformed one still
        means "recover", where a typed handler would make the SDK drop the signal.
        """
        if name != FORCE_RECOVER_SIGNAL:
            workflow.logger.warning("ignoring unknown signal %r", name, extra=self._log_fields)
            return
        sent: object = None
        if arguments:
            try:
                sent = workflow.payload_converter().from_payload(arguments[0].payload)
            except Exception:
                sent = arguments[0].payload.data.decode(errors="replace")
        # Whatever the argument says, an operator sent it, unverified: a signal has no validator to check a proof
        # in before it acts.
        request = RecoveryRequest.from_signal(sent)
        self._request_recovery(request)
        kind = "reimage_forced" if request.reimage else "recovery_forced"
        await self._log_action(FORCE_RECOVER_SIGNAL, request.credited(), request.reason, kind)

    @workflow.update(name=RECOVER_UPDATE)
    async def recover(self, request: RecoveryRequest | None = None) -> str:
        """``recover``: force_recover as an update, ``{"reason": ..., "by": ..., "reimage": false}``, so the operator
        API's proof is checked before it acts and the caller hears what follows, told by the stage it is in."""
        asked = dataclasses.replace(request or RecoveryRequest(), kind=RecoveryKind.FORCED)
        answer = asked.answer(workflow.info().workflow_id, self._status.stage)
        self._request_recovery(asked)
        kind = "reimage_forced" if asked.reimage else "recovery_forced"
        await self._log_action(RECOVER_UPDATE, asked.credited(), asked.reason, kind)
        return answer

    @recover.validator
    def _recover_allowed(self, request: RecoveryRequest | None = None) -> None:
        sent = request or RecoveryRequest(reason="")
        check_proof_in_validator(RECOVER_UPDATE, sent)
        self._refuse_if_decommissioned()
        sent.require_reason()

    @workflow.signal(name=HEARTBEAT_LOST_SIGNAL)
    def heartbeat_lost(self, lost: HeartbeatLost | None = None) -> None:
        """The fleet watchdog found the agent silent."""
        lost = lost or HeartbeatLost()
        agent = lost.agent_key_fingerprint
        current = self._status.agent.key_fingerprint if self._status.agent else None
        if agent is not None and agent != current:
            # The watchdog read BMDB before a recovery finished: that agent is gone, the new one has its own watch.
            workflow.logger.info(
                "heartbeat_lost about agent %s ignored: the machine's agent is %s now",
                agent,
                current or "not started yet",
                extra=self._log_fields,
            )
            return
        self._request_recovery(RecoveryRequest(lost.cause, "the watchdog", RecoveryKind.HEARTBEAT_LOST))

    @workflow.signal(name=RETRY_NOW_SIGNAL)
    async def retry_now(self, request: OperatorRequest | None = None) -> None:
        """An operator fixed what made the step fail (reset a host key pin, say): end the back-off now.

        ``{"reason": ..., "by": ...}``, or the reason alone.
        """
        if self._status.attempts == 0:
            workflow.logger.info("retry_now ignored: no step is failing", extra=self._log_fields)
            return
        self._retry_now = True
        request = request or OperatorRequest()
        reason, by = request.reason or "asked by an operator", credited(request.by, None)
        workflow.logger.info("retrying now, asked by %s: %s", by, reason, extra=self._log_fields)
        await self._log_action(RETRY_NOW_SIGNAL, by, reason, "retry_asked")

    @workflow.update(name=RETRY_UPDATE)
    async def retry(self, request: OperatorRequest | None = None) -> str:
        """``retry``: retry_now as an update, ``{"reason": ..., "by": ...}``: the failing step's back-off ends now,
        and the caller hears which step it is, or, from the validator, that none is failing."""
        reason, by = given(request).reason or "asked by an operator", given(request).credited()
        status = self._status
        # Said before the event is logged: meanwhile the next attempt begins, and counts.
        answer = f"retrying now ({reason}): it is {status.stage}, failed {status.attempts} time(s)"
        self._retry_now = True
        workflow.logger.info("retrying now, asked by %s: %s", by, reason, extra=self._log_fields)
        await self._log_action(RETRY_UPDATE, by, reason, "retry_asked")
        return answer

    @retry.validator
    def _retry_allowed(self, request: OperatorRequest | None = None) -> None:
        check_proof_in_validator(RETRY_UPDATE, given(request))
        self._refuse_if_decommissioned()
        if self._status.attempts == 0:
            raise ValueError(f"no step is failing: it is {self._status.stage}")

    @workflow.update(name=RELEASE_UPDATE)
    def release(self, request: OperatorRequest | None = None) -> str:
        """``release``: an operator lets a quarantined machine be recovered again, ``{"reason": ..., "by": ...}``.

        An update, not a signal, so the caller hears whether it was quarantined at all.
        """
        reason, by = given(request).reason, given(request).credited()
        self._release = (by, reason)
        self._note_action(RELEASE_UPDATE, by, reason)
        workflow.logger.info("released by %s: %s", by, reason, extra=self._log_fields)
        return f"released by {by} ({reason}): the held recovery reboots it now, and its budget starts afresh"

    @release.validator
    def _release_allowed(self, request: OperatorRequest | None = None) -> None:
        check_proof_in_validator(RELEASE_UPDATE, given(request))
        if self._status.stage is not MachineStage.QUARANTINED or self._release is not None:
            raise ValueError(f"not quarantined: it is {self._status.stage}")
        self._refuse_if_decommissioned()
        given(request).require_reason("the machine may be recovered again")

    @workflow.update(name=SET_MAINTENANCE_UPDATE)
    def set_maintenance(self, request: MaintenanceRequest | None = None) -> str:
        """``set_maintenance``: ``{"on": true, "reason": ..., "by": ...}`` takes the machine out of automation,
        ``{"on": false, "recover": false}`` ends it. An update, so the caller hears what happens, or why not."""
        checked = (request or MaintenanceRequest()).check()
        on, reason, recover = bool(checked.on), checked.reason, bool(checked.recover)
        by = checked.credited()
        status = self._status
        self._note_action(SET_MAINTENANCE_UPDATE, by, f"{'on' if on else 'off'}: {reason}")
        if on:
            self._maintenance_asked = Maintenance(since=self._now(), reason=reason, by=by, left=status.stage)
            workflow.logger.info("maintenance asked by %s: %s", by, reason, extra=self._log_fields)
            if status.stage is MachineStage.WATCHING:
                return f"in maintenance ({reason}): never rebooted or taken over until it ends"
            return f"maintenance asked ({reason}): it is {status.stage}, and stops once the current attempt ends"
        if status.maintenance is None:
            self._maintenance_asked = None
            return "the maintenance asked for is cancelled: it had not begun"
        self._maintenance_off = (by, reason, recover)
        workflow.logger.info("maintenance ended by %s: %s", by, reason, extra=self._log_fields)
        if recover:
            return f"maintenance over ({reason}): it is rebooted and taken over again"
        return f"maintenance over ({reason}): watched again if its agent still calls, else taken over again"

    @set_maintenance.validator
    def _maintenance_allowed(self, request: MaintenanceRequest | None = None) -> None:
        sent = request or MaintenanceRequest()
        check_proof_in_validator(SET_MAINTENANCE_UPDATE, sent)
        on = sent.check().on
        self._refuse_if_decommissioned()
        status = self._status
        asked = self._maintenance_asked
        if on and asked is not None:
            raise ValueError(f"already in maintenance, asked by {asked.by} at {asked.since}: {asked.reason}")
        if on and status.stage is MachineStage.QUARANTINED:
            raise ValueError("it is QUARANTINED, which leaves it alone already; `shepherd release` it once mended")
        if not on and asked is None:
            raise ValueError(f"not in maintenance: it is {status.stage}")
        if not on and self._maintenance_off is not None:
            raise ValueError("its maintenance is ending already")

    @workflow.update(name=DECOMMISSION_UPDATE)
    def decommission(self, request: OperatorRequest | None = None) -> str:
        """``decommission``: ``{"reason": ..., "by": ...}`` retires the machine for good at the next safe point.

        An update, so the caller hears whether it was taken and when it begins.
        """
        reason, by = given(request).reason, given(request).credited()
        self._decommission_asked = Decommission(since=self._now(), reason=reason, by=by)
        self._note_action(DECOMMISSION_UPDATE, by, reason)
        workflow.logger.info("decommission asked by %s: %s", by, reason, extra=self._log_fields)
        self._show_details()
        stage = self._status.stage
        then = f"its agent is stopped, then provider {self._status.provider} releases or powers it off"
        if stage is MachineStage.RECOVERING:
            return f"decommission asked ({reason}): once its reboot is done, {then}"
        if stage in (MachineStage.PROVISIONING, MachineStage.AGENT_STARTING):
            return f"decommission asked ({reason}): it is {stage}; once the current attempt ends, {then}"
        return f"decommissioning ({reason}): {then}"

    @decommission.validator
    def _decommission_allowed(self, request: OperatorRequest | None = None) -> None:
        check_proof_in_validator(DECOMMISSION_UPDATE, given(request))
        self._refuse_if_decommissioned()
        given(request).require_reason("the machine is decommissioned")
        asked = self._maintenance_asked
        in_maintenance = asked is not None or self._status.stage is MachineStage.MAINTENANCE
        own = asked is not None and asked.by == given(request).credited()
        if in_maintenance and self._maintenance_off is None and not given(request).force and not own:
            # Another operator holds it out of automation, maybe for work under way: ending that is said, not done.
            who = f", asked by {asked.by} at {asked.since}: {asked.reason}" if asked is not None else ""
            raise ValueError(f'it is in maintenance{who}; decommission it anyway with --force ({{"force": true}})')

    @workflow.update(name=RESTART_AGENT_UPDATE)
    async def restart_agent(self, request: OperatorRequest | None = None) -> str:
        """``restart_agent``: ``{"reason": ..., "by": ...}`` takes a WATCHING machine over again without a reboot:
        a new agent (the executable and CA bundle the workers have now) replaces the running one, which stops.

        An update, so the caller hears whether a takeover follows, or why not.
        """
        reason, by = given(request).reason, given(request).credited()
        status = self._status
        stage = status.stage
        if self._restart_asked is not None:
            earlier_by, earlier_why = self._restart_asked
            answer = f"its agent's restart, asked by {earlier_by} ({earlier_why}), is under way; recorded with it"
        elif stage is MachineStage.RECOVERING or status.recovery_requested is not None:
            answer = f"it is {stage} with a recovery asked: the takeover after its reboot starts a new agent"
        elif stage is MachineStage.WATCHING:
            self._restart_asked = (by, reason)
            answer = f"agent restart asked ({reason}): a new agent takes over without a reboot, the old one stops"
        else:
            # Each takeover runs the executable, and hands over the CA bundle, the worker that runs it has now.
            answer = f"it is {stage}: the agent its takeover starts is new already; nothing more to do"
        await self._log_action(RESTART_AGENT_UPDATE, by, reason, "agent_restart_asked")
        return answer

    @restart_agent.validator
    def _restart_allowed(self, request: OperatorRequest | None = None) -> None:
        check_proof_in_validator(RESTART_AGENT_UPDATE, given(request))
        self._refuse_if_decommissioned()
        status = self._status
        if status.stage is MachineStage.QUARANTINED:
            raise ValueError(
                "it is QUARANTINED, held for an operator: `shepherd release` it once mended, which reboots it "
                "and takes it over"
            )
        asked = self._maintenance_asked
        if asked is not None or status.stage is MachineStage.MAINTENANCE:
            who = f", asked by {asked.by} at {asked.since}: {asked.reason}" if asked is not None else ""
            raise ValueError(
                f"it is in maintenance{who}; nothing takes it over until `shepherd maintenance --off`, after which "
                "a silent agent is taken over again"
            )
        given(request).require_reason("the agent is restarted")

    def _refuse_if_decommissioned(self) -> None:
        asked = self._decommission_asked
        if asked is not None:
            raise ValueError(f"it is being decommissioned, asked by {asked.by} at {asked.since}: {asked.reason}")

    def _request_recovery(self, request: RecoveryRequest) -> None:
        status = self._status
        reason = request.describe()
        if self._decommission_asked is not None:
            workflow.logger.info("being decommissioned; recovery not done: %s", reason, extra=self._log_fields)
            return
        if status.stage is MachineStage.QUARANTINED and request.by_an_operator and self._release is None:
            # An operator who forces a recovery of a quarantined machine means it: that is a release.
            self._release = (request.credited(), reason)
            self._reimage_on_release = request.reimage
            workflow.logger.info("quarantine ended by a forced recovery: %s", reason, extra=self._log_fields)
            return
        pending = status.recovery_requested
        under_way = status.stage in (MachineStage.RECOVERING, MachineStage.REIMAGING)
        if request.by_an_operator and pending is not None and not pending.by_an_operator and not under_way:
            # The watchdog's request goes ahead only if BMDB confirms the silence (asked before the stage turns
            # RECOVERING); an operator's always does. Both can come in one workflow task, the watchdog's first.
            status.recovery_requested = request
            workflow.logger.info(
                "recovery requested, in place of the watchdog's not yet confirmed: %s", reason, extra=self._log_fields
            )
            return
        if pending is not None or under_way:
            status.recovery_requests_coalesced += 1
            workflow.logger.info("recovery already under way; coalesced: %s", reason, extra=self._log_fields)
            return
        status.recovery_requested = request
        workflow.logger.info("recovery requested: %s", reason, extra=self._log_fields)
        self._show_details()

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> MachineStatus:
        """The ``status`` query: the machine's stage, attempts, errors, recoveries and operator holds."""
        return self._status
