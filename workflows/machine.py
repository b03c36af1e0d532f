"""MachineWorkflow: one machine's lifecycle, one workflow per machine.

PROVISIONING -> AGENT_STARTING -> WATCHING -> RECOVERING -> AGENT_STARTING ...
and, past the recovery budget, WATCHING -> QUARANTINED -> (an operator's release) RECOVERING;
an operator's maintenance pauses any stage at its next safe point, and a decommission ends the workflow there:
... -> DECOMMISSIONING -> DECOMMISSIONED, the one way a machine's workflow completes.
Signals: ``force_recover`` (an operator), ``heartbeat_lost`` (the fleet
watchdog) and ``retry_now`` (an operator who fixed what made a step fail);
updates: ``release`` (of a quarantined machine), ``set_maintenance``, ``decommission``, ``restart_agent``
(a new agent without a reboot: WATCHING -> AGENT_STARTING); query: ``status``.
The workflow id
``machine-<provider>-<provider_id>`` makes Temporal the per-machine lock: no
two workers ever act on the same machine at once.

Each step is one activity attempt at a time, spaced by the step's back-off
with a durable timer here, rather than by the activity's retry policy: that
way the ``status`` query knows the attempt count and the last error, and the
Temporal UI shows every failed attempt in the history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, NoReturn, TypeVar

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError

from workflows.failures import describe_failure, failure_type

with workflow.unsafe.imports_passed_through():
    from activities.decommission import DecommissionActivities
    from activities.provisioning import ProvisioningActivities
    from activities.recovery import RecoveryActivities
    from activities.takeover import TakeoverActivities
    from lifecycle.contracts import (
        DECOMMISSION_UPDATE,
        FORCE_RECOVER_SIGNAL,
        HEARTBEAT_LOST_SIGNAL,
        RELEASE_UPDATE,
        RESTART_AGENT_UPDATE,
        RETRY_NOW_SIGNAL,
        SET_MAINTENANCE_UPDATE,
        STATUS_QUERY,
        AgentCheckInput,
        AgentFacts,
        Backoff,
        BootWaitInput,
        BootWaitResult,
        Decommission,
        Decommissioned,
        DecommissionInput,
        LifecyclePolicy,
        MachineInput,
        MachineStage,
        MachineStatus,
        Maintenance,
        MaintenanceInput,
        OperatorAction,
        OperatorActionInput,
        ProvisionInput,
        ProvisionResult,
        Quarantine,
        QuarantineInput,
        RebootInput,
        RebootResult,
        RecoveryRecord,
        RetireInput,
        RetireResult,
        StartAgentInput,
        StepProgress,
        Stuck,
        StuckInput,
        machine_search_attributes,
        provider_task_queue,
    )

T = TypeVar("T")

# Quick retries inside one attempt, for blips (a dropped BMDB connection);
# failures that say something about the machine are non-retryable there and
# go straight to the step's back-off.
_BLIP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
# BMDB marks of what an operator must see: tried until BMDB answers, as the stage's own steps need it too.
_UNTIL_BMDB_ANSWERS = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=5))
# Recoveries recorded before a cycle rebooted once, recorded apart and waited for the boot ran reboot_machine.
_REBOOT_ONCE = "reboot-once-then-wait-for-boot"
# Recoveries recorded before the recovery budget never quarantined.
_RECOVERY_BUDGET = "recovery-budget"
# Back-offs recorded before a stage that outlasts its deadline was flagged stuck were one timer each.
_STUCK_FLAG = "stuck-flag"
# Signals recorded before operator actions were logged in BMDB recorded nothing.
_ACTIONS_LOGGED = "operator-actions-logged"
# How many operator actions the status keeps.
_ACTIONS_KEPT = 10
# Step attempts recorded before a failing step continued as new made one long history.
_SHORT_STEP_HISTORY = "failing-step-continues-as-new"
# Attempts of a failing step in one run, before it continues as new: a machine that fails for months keeps a
# history of a few hundred events.
STEP_ATTEMPTS_PER_RUN = 50
# Failures a retry soon cannot mend: the step waits its longest back-off, or an operator's retry_now.
_WAITS_FOR_AN_OPERATOR = frozenset({"MACHINE_UNSUPPORTED"})
# Bounds the boot wait of a workflow whose policy predates the boot deadline (the worker's setting decides).
_BOOT_WAIT_BOUND = timedelta(hours=4)


def requested_by(request: Any) -> str:
    """Who a signal's argument says asked: its "by", else "unknown"."""
    return operator_of(request.get("by") if isinstance(request, dict) else None)


def recovery_reason(request: Any) -> str:
    """The reason in a force_recover argument, whatever shape it arrived in."""
    if request is None:
        return "no reason given"
    if isinstance(request, dict) and isinstance(request.get("reason"), str) and request["reason"].strip():
        return str(request["reason"]).strip()
    if isinstance(request, str) and request.strip():
        return request.strip()
    return f"unreadable reason {str(request)[:100]!r}"


def operator_of(by: Any) -> str:
    """Who asked for an operator action, as its request says; "unknown" when it does not."""
    return by.strip()[:100] if isinstance(by, str) and by.strip() else "unknown"


def operator_request(request: Any, why: str) -> tuple[str, str]:
    """(reason, who) of an operator's update argument; ValueError, asking why, when it gives no reason."""
    reason, by = request, None
    if isinstance(request, dict):
        reason, by = request.get("reason"), request.get("by")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f'say why {why}: {{"reason": "...", "by": "..."}}')
    return reason.strip()[:500], operator_of(by)


class _DecommissionNow(Exception):
    """Leaves a step's retries, a maintenance or a quarantine for the decommission an operator asked for."""


class _ContinueStep(Exception):
    """Leaves a step that has failed STEP_ATTEMPTS_PER_RUN times in this run, to go on in a new one."""


def maintenance_request(request: Any) -> tuple[bool, str, str, bool]:
    """(on, reason, who, reboot after) of a set_maintenance argument; ValueError naming what is wrong."""
    if not isinstance(request, dict) or not isinstance(request.get("on"), bool):
        raise ValueError('give {"on": true, "reason": "...", "by": "..."} or {"on": false, "recover": false}')
    on, reason, by, recover = request["on"], request.get("reason"), request.get("by"), request.get("recover", False)
    if not isinstance(recover, bool) or (recover and on):
        raise ValueError('"recover" (a reboot once maintenance ends) goes with "on": false, as true or false')
    if not isinstance(reason, str) or not reason.strip():
        if on:
            raise ValueError("say why the machine goes into maintenance: a reason")
        reason = "maintenance done"
    return on, reason.strip()[:500], operator_of(by), recover


@workflow.defn(name="MachineWorkflow")
class MachineWorkflow:
    """One machine's lifecycle: each step tried until it succeeds, then WATCHING until a recovery is asked for."""

    # The status exists before the first signal handler runs: a signal that
    # arrives with the start (signal-with-start, or just sent right after it)
    # is applied, not dropped.
    @workflow.init
    def __init__(self, input: MachineInput) -> None:
        self._log_fields = {
            "machine_id": input.machine_id,
            "provider": input.provider,
            "provider_id": input.provider_id,
        }
        self._status = status = MachineStatus(
            machine_id=input.machine_id,
            provider=input.provider,
            provider_id=input.provider_id,
            stage=input.resume_stage or MachineStage.PROVISIONING,
            stage_since=self._now(),
            address=input.address,
            agent=input.agent,
            recovery_count=input.recovery_count,
            last_recovery_reason=input.last_recovery_reason,
            recent_recoveries=list(input.recent_recoveries),
            actions=list(input.recent_actions),
            recovery_requested=input.recovery_requested,
        )
        if input.step is not None:
            status.attempts, status.stage_since = input.step.attempts, input.step.stage_since
            status.last_error, status.stuck = input.step.last_error, input.step.stuck
        self._attempts_before_this_run = status.attempts
        self._retry_now = False
        # (who, why) of the operator who released the quarantined machine.
        self._release: tuple[str, str] | None = None
        # An operator's maintenance, asked for and not yet ended; and (who, why, reboot?) of its end.
        self._maintenance_asked: Maintenance | None = input.maintenance
        self._maintenance_off: tuple[str, str, bool] | None = None
        # An operator's decommission, asked for; it begins at the next safe point.
        self._decommission_asked: Decommission | None = input.decommission
        # (who, why) of an operator's restart of the agent of this WATCHING machine; the next run takes it over.
        self._restart_asked: tuple[str, str] | None = None
        # The running agent this run's takeover replaces, if a restart continued the workflow as new.
        self._replacing = input.replace_agent

    @workflow.run
    async def run(self, input: MachineInput) -> Decommissioned | None:
        """None when the machine's life goes on in a new run (continue-as-new); what was done once decommissioned."""
        try:
            await self._live(input)
        except _DecommissionNow:
            return await self._decommission(input)

    async def _live(self, input: MachineInput) -> NoReturn:
        """The machine's stages up to its next recovery cycle, which continues as new; _DecommissionNow at a safe
        point once a decommission was asked for."""
        status = self._status
        self._set_stage(status.stage)
        try:
            await self._bring_up(input)
        except _ContinueStep:
            await workflow.wait_condition(workflow.all_handlers_finished)
            carried = self._carried(input)
            carried.step = StepProgress(status.attempts, status.stage_since, status.last_error, status.stuck)
            carried.recovery_requested = status.recovery_requested
            carried.replace_agent = self._replacing
            self._carry_requests_accepted_on_the_way_out(carried)
            workflow.continue_as_new(carried)

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
        take_over_again = False
        if self._maintenance_asked is not None:
            take_over_again = await self._maintenance_from_watching()
        next_run = self._carried(input)
        if take_over_again:
            next_run.resume_stage = MachineStage.AGENT_STARTING
            next_run.agent = None
        elif status.recovery_requested is not None:
            reason = status.recovery_requested
            if workflow.patched(_RECOVERY_BUDGET) and self._budget_spent(input.policy, reason):
                reason = await self._quarantine(input, reason)
            self._set_stage(MachineStage.RECOVERING)
            if workflow.patched(_REBOOT_ONCE):
                await self._recover(input, reason)
            else:
                await self._until_success(input.policy.recovery_backoff, lambda: self._reboot(input, reason))
            # Requests that arrived during the reboot are answered by it.
            next_run.resume_stage = MachineStage.AGENT_STARTING
            next_run.agent = None
            next_run.recovery_count += 1
            next_run.last_recovery_reason = reason
            next_run.recent_recoveries = [
                *self._within_budget_window(input.policy),
                RecoveryRecord(self._now(), reason),
            ]
        # Asked while the machine rebooted: the next run would not know of it.
        self._stop_if_decommissioned()
        if self._maintenance_asked is not None:
            await self._in_maintenance()
        # Each recovery cycle starts a fresh history, so a machine that recovers
        # a hundred times keeps a short one.
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._restart_asked is not None and next_run.resume_stage is MachineStage.WATCHING:
            # Checked last, so a restart accepted while this run was on its way out is not lost. As at the end of
            # a maintenance, minus the reboot: no recovery counted, no budget spent. The old agent keeps
            # heartbeating, and stays on record, until the new one's takeover replaces it.
            by, why = self._restart_asked
            workflow.logger.info("agent restart asked by %s: %s", by, why, extra=self._log_fields)
            next_run.resume_stage = MachineStage.AGENT_STARTING
            next_run.replace_agent = next_run.agent.key_fingerprint if next_run.agent else None
            next_run.agent = None
        self._carry_requests_accepted_on_the_way_out(next_run)
        workflow.continue_as_new(next_run)

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
                lambda: self._provision(input),
                stuck_after=input.policy.provisioning_deadline,
            )
            status.address = provisioned.address
            self._set_stage(MachineStage.AGENT_STARTING)

        if status.stage is MachineStage.AGENT_STARTING:
            status.agent = await self._until_success(
                input.policy.agent_start_backoff,
                lambda: self._start_agent(input),
                stuck_after=input.policy.agent_start_deadline,
            )
            self._replacing = None
            self._set_stage(MachineStage.WATCHING)

    def _carried(self, input: MachineInput) -> MachineInput:
        """The next run's input: the machine where it stands, with what its status must keep."""
        status = self._status
        return MachineInput(
            provider=input.provider,
            provider_id=input.provider_id,
            machine_id=input.machine_id,
            policy=input.policy,
            resume_stage=status.stage,
            address=status.address,
            agent=status.agent,
            recovery_count=status.recovery_count,
            last_recovery_reason=status.last_recovery_reason,
            recent_recoveries=status.recent_recoveries,
            recent_actions=status.actions,
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
        request: Any = None
        if arguments:
            try:
                request = workflow.payload_converter().from_payload(arguments[0].payload)
            except Exception:
                request = arguments[0].payload.data.decode(errors="replace")
        reason, by = recovery_reason(request), requested_by(request)
        self._request_recovery(f"forced: {reason}" + ("" if by == "unknown" else f" (by {by})"), by)
        await self._log_action(FORCE_RECOVER_SIGNAL, by, reason, "recovery_forced")

    @workflow.signal(name=HEARTBEAT_LOST_SIGNAL)
    def heartbeat_lost(self, lost: Any = None) -> None:
        """The fleet watchdog found the agent silent: a HeartbeatLost (or, from older watchdogs, the cause alone)."""
        cause, agent = lost, None
        if isinstance(lost, dict):
            cause, agent = lost.get("cause"), lost.get("agent_key_fingerprint")
        current = self._status.agent.key_fingerprint if self._status.agent else None
        if isinstance(agent, str) and agent != current:
            # The watchdog read BMDB before a recovery finished: that agent is gone, the new one has its own watch.
            workflow.logger.info(
                "heartbeat_lost about agent %s ignored: the machine's agent is %s now",
                agent,
                current or "not started yet",
                extra=self._log_fields,
            )
            return
        self._request_recovery(f"heartbeat lost: {cause if isinstance(cause, str) and cause else 'no detail'}")

    @workflow.signal(name=RETRY_NOW_SIGNAL)
    async def retry_now(self, request: Any = None) -> None:
        """An operator fixed what made the step fail (reset a host key pin, say): end the back-off now.

        ``{"reason": ..., "by": ...}``, or the reason alone.
        """
        if self._status.attempts == 0:
            workflow.logger.info("retry_now ignored: no step is failing", extra=self._log_fields)
            return
        self._retry_now = True
        reason = request.get("reason") if isinstance(request, dict) else request
        reason = str(reason).strip()[:500] if reason else "asked by an operator"
        by = requested_by(request)
        workflow.logger.info("retrying now, asked by %s: %s", by, reason, extra=self._log_fields)
        await self._log_action(RETRY_NOW_SIGNAL, by, reason, "retry_asked")

    @workflow.update(name=RELEASE_UPDATE)
    def release(self, request: Any = None) -> str:
        """``release``: an operator lets a quarantined machine be recovered again, ``{"reason": ..., "by": ...}``.

        An update, not a signal, so the caller hears whether it was quarantined at all.
        """
        reason, by = operator_request(request, "the machine may be recovered again")
        self._release = (by, reason)
        self._note_action(RELEASE_UPDATE, by, reason)
        workflow.logger.info("released by %s: %s", by, reason, extra=self._log_fields)
        return f"released by {by} ({reason}): the held recovery reboots it now, and its budget starts afresh"

    @release.validator
    def _release_allowed(self, request: Any = None) -> None:
        if self._status.stage is not MachineStage.QUARANTINED or self._release is not None:
            raise ValueError(f"not quarantined: it is {self._status.stage}")
        self._refuse_if_decommissioned()
        operator_request(request, "the machine may be recovered again")

    @workflow.update(name=SET_MAINTENANCE_UPDATE)
    def set_maintenance(self, request: Any = None) -> str:
        """``set_maintenance``: ``{"on": true, "reason": ..., "by": ...}`` takes the machine out of automation,
        ``{"on": false, "recover": false}`` ends it. An update, so the caller hears what happens, or why not."""
        on, reason, by, recover = maintenance_request(request)
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
    def _maintenance_allowed(self, request: Any = None) -> None:
        on, _, _, _ = maintenance_request(request)
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
    def decommission(self, request: Any = None) -> str:
        """``decommission``: ``{"reason": ..., "by": ...}`` retires the machine for good at the next safe point.

        An update, so the caller hears whether it was taken and when it begins.
        """
        reason, by = operator_request(request, "the machine is decommissioned")
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
    def _decommission_allowed(self, request: Any = None) -> None:
        self._refuse_if_decommissioned()
        operator_request(request, "the machine is decommissioned")

    @workflow.update(name=RESTART_AGENT_UPDATE)
    async def restart_agent(self, request: Any = None) -> str:
        """``restart_agent``: ``{"reason": ..., "by": ...}`` takes a WATCHING machine over again without a reboot:
        a new agent (the executable and CA bundle the workers have now) replaces the running one, which stops.

        An update, so the caller hears whether a takeover follows, or why not.
        """
        reason, by = operator_request(request, "the agent is restarted")
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
    def _restart_allowed(self, request: Any = None) -> None:
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
        operator_request(request, "the agent is restarted")

    def _refuse_if_decommissioned(self) -> None:
        asked = self._decommission_asked
        if asked is not None:
            raise ValueError(f"it is being decommissioned, asked by {asked.by} at {asked.since}: {asked.reason}")

    def _decommission_pending(self) -> bool:
        return self._decommission_asked is not None and self._status.stage is not MachineStage.DECOMMISSIONING

    def _stop_if_decommissioned(self) -> None:
        """At a safe point (no activity under way): leave for the decommission, if one was asked for."""
        if self._decommission_pending():
            raise _DecommissionNow()

    def _note_action(self, action: str, by: str, reason: str) -> None:
        """Keep an operator's request in the status, which shows the last few across runs."""
        actions = self._status.actions
        actions.append(OperatorAction(at=self._now(), action=action, by=by, reason=reason))
        del actions[:-_ACTIONS_KEPT]

    async def _log_action(self, action: str, by: str, reason: str, kind: str) -> None:
        """_note_action, and an event of kind in BMDB's log (a signal's caller hears of nothing else)."""
        self._note_action(action, by, reason)
        if workflow.patched(_ACTIONS_LOGGED):
            logged = OperatorActionInput(self._status.machine_id, kind, f"by {by}: {reason}", at=self._now())
            await self._mark(RecoveryActivities.record_operator_action, logged, f"log {action} by {by} in BMDB")

    def _request_recovery(self, reason: str, by: str = "the watchdog") -> None:
        status = self._status
        if self._decommission_asked is not None:
            workflow.logger.info("being decommissioned; recovery not done: %s", reason, extra=self._log_fields)
            return
        if status.stage is MachineStage.QUARANTINED and reason.startswith("forced:") and self._release is None:
            # An operator who forces a recovery of a quarantined machine means it: that is a release.
            self._release = (by, reason)
            workflow.logger.info("quarantine ended by a forced recovery: %s", reason, extra=self._log_fields)
            return
        if status.recovery_requested is not None or status.stage is MachineStage.RECOVERING:
            status.recovery_requests_coalesced += 1
            workflow.logger.info("recovery already under way; coalesced: %s", reason, extra=self._log_fields)
            return
        status.recovery_requested = reason
        workflow.logger.info("recovery requested: %s", reason, extra=self._log_fields)
        self._show_details()

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> MachineStatus:
        return self._status

    async def _provision(self, input: MachineInput) -> ProvisionResult:
        return await workflow.execute_activity_method(
            ProvisioningActivities.provision_machine,
            ProvisionInput(
                provider=input.provider,
                provider_id=input.provider_id,
                machine_id=input.machine_id,
                idempotency_key=workflow.info().workflow_id,
            ),
            summary=f"create {input.provider_id} at provider {input.provider} and record it in BMDB",
            start_to_close_timeout=timedelta(seconds=input.policy.provision_timeout),
            retry_policy=_BLIP_RETRY,
            task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
        )

    async def _start_agent(self, input: MachineInput) -> AgentFacts:
        return await workflow.execute_activity_method(
            TakeoverActivities.start_agent,
            StartAgentInput(
                provider=input.provider,
                provider_id=input.provider_id,
                machine_id=input.machine_id,
                replaces=self._replacing,
            ),
            summary=f"start the agent on {input.provider_id} over SSH",
            start_to_close_timeout=timedelta(seconds=input.policy.agent_start_timeout),
            retry_policy=_BLIP_RETRY,
            task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
        )

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
            status.recovery_requested = f"forced: maintenance over, reboot asked by {by}: {reason}"
            self._show_details()
        return recover

    async def _maintenance_from_watching(self) -> bool:
        """Maintenance of a WATCHING machine; True when its agent fell silent meanwhile and must be taken over again.

        The watchdog's requests made before or during it are about an agent the maintenance may have stopped: the
        agent's heartbeat decides instead. An operator's forced recovery stands.
        """
        status = self._status
        if await self._in_maintenance():
            return False
        if status.recovery_requested is not None and not status.recovery_requested.startswith("forced:"):
            status.recovery_requested = None
        if status.recovery_requested is not None:
            return False
        alive: bool = await workflow.execute_activity_method(
            RecoveryActivities.check_agent_after_maintenance,
            AgentCheckInput(machine_id=status.machine_id, why="after maintenance"),
            summary=f"is the agent of {status.provider_id} still calling after its maintenance?",
            start_to_close_timeout=timedelta(minutes=1),
            retry_policy=_UNTIL_BMDB_ANSWERS,
        )
        if not alive:
            workflow.logger.info("agent silent after maintenance: taking over again", extra=self._log_fields)
        return not alive

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
        provider_queue = provider_task_queue(workflow.info().task_queue, input.provider)
        request = DecommissionInput(
            provider=input.provider,
            provider_id=input.provider_id,
            machine_id=input.machine_id,
            reason=asked.reason,
            by=asked.by,
        )
        await self._mark(
            DecommissionActivities.forget_decommissioned_agent,
            request,
            f"forget the agent of {input.provider_id} in BMDB, so its heartbeats are refused",
        )
        try:
            asked.agent = await workflow.execute_activity_method(
                TakeoverActivities.stop_agent,
                request,
                summary=f"stop the agent on {input.provider_id} over SSH",
                start_to_close_timeout=timedelta(seconds=input.policy.agent_start_timeout),
                retry_policy=_BLIP_RETRY,
                task_queue=provider_queue,
            )
        except ActivityError as error:
            asked.agent = f"not stopped ({describe_failure(error)}); its heartbeats are refused from now on"
        self._show_details()
        retired: RetireResult = await self._until_success(
            input.policy.recovery_backoff,
            lambda: workflow.execute_activity_method(
                DecommissionActivities.retire_through_provider,
                request,
                summary=f"release or power off {input.provider_id} through provider {input.provider}",
                start_to_close_timeout=timedelta(seconds=input.policy.recovery_timeout),
                retry_policy=_BLIP_RETRY,
                task_queue=provider_queue,
            ),
            # A provider that does not retire the machine for as long as provisioning may take is flagged.
            stuck_after=input.policy.provisioning_deadline,
        )
        asked.provider_action, asked.provider_detail = retired.action, retired.detail
        detail = (
            f"asked by {asked.by}: {asked.reason}; agent: {asked.agent}; "
            f"provider {input.provider}: {retired.action} ({retired.detail})"
        )
        await self._mark(
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

    def _within_budget_window(self, policy: LifecyclePolicy) -> list[RecoveryRecord]:
        """The recent recoveries the budget still counts; all of them when there is no window."""
        recent = self._status.recent_recoveries
        if policy.recovery_budget_window is None:
            return recent[-10:]
        since = workflow.now() - timedelta(seconds=policy.recovery_budget_window)
        return [r for r in recent if datetime.fromisoformat(r.at) >= since]

    def _budget_spent(self, policy: LifecyclePolicy, reason: str) -> bool:
        """Whether this recovery would be one more than the budget allows; an operator's forced one never is."""
        if policy.recovery_budget is None or reason.startswith("forced:"):
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

    async def _recover(self, input: MachineInput, reason: str) -> None:
        """Reboot once in this recovery cycle, record it, then wait for the machine to answer SSH again.

        Each is a step of its own, so a failed record never repeats the reboot; the boot wait keeps the first
        takeover from hitting a booting machine and waiting out the agent-start back-off.
        """
        backoff = input.policy.recovery_backoff
        reboot = RebootInput(
            provider=input.provider,
            provider_id=input.provider_id,
            machine_id=input.machine_id,
            cause=reason,
            cycle=workflow.info().run_id,
        )
        rebooted: RebootResult = await self._until_success(
            backoff,
            lambda: workflow.execute_activity_method(
                RecoveryActivities.reboot_through_provider,
                reboot,
                summary=f"reboot {input.provider_id} through provider {input.provider}: {reason}"[:200],
                start_to_close_timeout=timedelta(seconds=input.policy.recovery_timeout),
                retry_policy=_BLIP_RETRY,
                task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
            ),
        )
        await self._until_success(
            backoff,
            lambda: workflow.execute_activity_method(
                RecoveryActivities.record_reboot,
                reboot,
                summary="record the reboot in BMDB and forget the old agent",
                start_to_close_timeout=timedelta(minutes=1),
                retry_policy=_BLIP_RETRY,
            ),
        )
        self._status.waiting_for_boot_since = self._now()
        self._show_details()
        deadline = input.policy.boot_deadline
        try:
            booted: BootWaitResult = await workflow.execute_activity_method(
                RecoveryActivities.wait_for_boot,
                BootWaitInput(
                    provider=input.provider,
                    provider_id=input.provider_id,
                    machine_id=input.machine_id,
                    went_down=rebooted.went_down,
                    deadline=deadline,
                ),
                summary=f"wait for {input.provider_id} to answer SSH after the reboot",
                start_to_close_timeout=timedelta(seconds=deadline + 60) if deadline else _BOOT_WAIT_BOUND,
                heartbeat_timeout=timedelta(minutes=2),
                retry_policy=_BLIP_RETRY,
                task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
            )
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

    async def _reboot(self, input: MachineInput, reason: str) -> None:
        await workflow.execute_activity_method(
            RecoveryActivities.reboot_machine,
            RebootInput(
                provider=input.provider, provider_id=input.provider_id, machine_id=input.machine_id, cause=reason
            ),
            summary=f"reboot {input.provider_id} through provider {input.provider}: {reason}"[:200],
            start_to_close_timeout=timedelta(seconds=input.policy.recovery_timeout),
            retry_policy=_BLIP_RETRY,
            task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
        )

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
                raise _ContinueStep()
            status.attempts += 1
            try:
                result = await attempt()
            except ActivityError as error:
                status.last_error = describe_failure(error)
                delay = backoff.delay(status.attempts)
                if failure_type(error) in _WAITS_FOR_AN_OPERATOR:
                    # No retry soon can change the machine's architecture: try again after the longest back-off,
                    # or at once on retry_now (an agent for it configured, the machine replaced).
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

    async def _record_quarantine(self, quarantined: bool, detail: str) -> None:
        mark = QuarantineInput(machine_id=self._status.machine_id, quarantined=quarantined, detail=detail[:1000])
        verb = "quarantine" if quarantined else "release"
        await self._mark(RecoveryActivities.record_quarantine, mark, f"{verb} {self._status.provider_id} in BMDB")

    async def _record_stuck(self, stuck: bool, detail: str) -> None:
        mark = StuckInput(machine_id=self._status.machine_id, stuck=stuck, detail=detail[:1000])
        verb = "flag" if stuck else "clear"
        await self._mark(RecoveryActivities.record_stuck, mark, f"{verb} {self._status.provider_id} as stuck in BMDB")

    async def _record_maintenance(self, on: bool, detail: str) -> None:
        mark = MaintenanceInput(machine_id=self._status.machine_id, on=on, detail=detail[:1000])
        verb = "on" if on else "off"
        await self._mark(
            RecoveryActivities.record_maintenance, mark, f"maintenance {verb} for {self._status.provider_id}"
        )

    async def _mark(self, activity: Callable[[Any, Any], Awaitable[None]], mark: Any, summary: str) -> None:
        """Record in BMDB what an operator must see (quarantine, stuck, maintenance), tried until BMDB answers."""
        await workflow.execute_activity_method(
            activity,
            mark,
            summary=summary,
            start_to_close_timeout=timedelta(minutes=1),
            retry_policy=_UNTIL_BMDB_ANSWERS,
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

    def _show_details(self) -> None:
        """The Temporal UI's "current details" of this machine: who it is and how it is doing."""
        status = self._status
        lines = [
            f"**{status.provider_id}** at provider {status.provider}, address {status.address or 'not known yet'}",
            f"BMDB machine {status.machine_id}",
            f"**{status.stage}** since {status.stage_since}",
        ]
        if status.agent is not None and status.stage is MachineStage.WATCHING:
            lines.append(f"agent key {status.agent.key_fingerprint}, started {status.agent.started_at}")
        if status.last_error:
            lines.append(f"attempt {status.attempts} failed: {status.last_error}; next at {status.next_attempt_at}")
        if status.recovery_requested:
            lines.append(f"recovery requested: {status.recovery_requested}")
        if status.maintenance:
            m = status.maintenance
            lines.append(f"**maintenance** since {m.since}, asked by {m.by}: {m.reason} (left {m.left})")
        if status.stuck:
            lines.append(f"**stuck** since {status.stuck.since}: {status.stuck.reason}")
        if status.decommission or self._decommission_asked:
            d = status.decommission or self._decommission_asked
            assert d is not None
            lines.append(f"**decommission** asked by {d.by} at {d.since}: {d.reason}")
            if d.agent:
                lines.append(f"agent: {d.agent}")
            if d.provider_action:
                lines.append(f"provider: {d.provider_action} ({d.provider_detail})")
        if status.quarantine:
            lines.append(f"**quarantined** since {status.quarantine.since}: {status.quarantine.reason}")
            lines.append("release: `shepherd release` or the `release` update with a reason")
        if status.waiting_for_boot_since:
            lines.append(f"rebooted; waiting since {status.waiting_for_boot_since} for SSH to answer")
        lines.append(
            f"recoveries: {status.recovery_count}"
            + (f", last: {status.last_recovery_reason}" if status.last_recovery_reason else "")
        )
        workflow.set_current_details("\n\n".join(lines))

    @staticmethod
    def _now() -> str:
        return workflow.now().isoformat()
