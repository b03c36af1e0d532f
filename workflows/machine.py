"""MachineWorkflow: one machine's lifecycle, one workflow per machine.

PROVISIONING -> AGENT_STARTING -> WATCHING. The workflow id
``machine-<provider>-<provider_id>`` makes Temporal the per-machine lock: no
two workers ever act on the same machine at once.

Each step is one activity attempt at a time, spaced by the step's back-off
with a durable timer here, rather than by the activity's retry policy: that
way the ``status`` query knows the attempt count and the last error, and the
Temporal UI shows every failed attempt in the history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.provisioning import ProvisioningActivities
    from activities.takeover import TakeoverActivities
    from workflows.types import (
        MACHINE_STAGE,
        AgentFacts,
        Backoff,
        MachineInput,
        MachineStage,
        MachineStatus,
        ProvisionInput,
        ProvisionResult,
        StartAgentInput,
    )

T = TypeVar("T")

# Quick retries inside one attempt, for blips (a dropped BMDB connection);
# failures that say something about the machine are non-retryable there and
# go straight to the step's back-off.
_BLIP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)


def describe_failure(error: BaseException) -> str:
    """The innermost message of an activity failure: what went wrong on the machine."""
    while isinstance(error, ActivityError) and error.cause is not None:
        error = error.cause
    if isinstance(error, ApplicationError) and error.type:
        return f"{error.type}: {error.message}"
    return str(error)


@workflow.defn(name="MachineWorkflow")
class MachineWorkflow:
    def __init__(self) -> None:
        self._status: MachineStatus | None = None

    @workflow.run
    async def run(self, input: MachineInput) -> None:
        self._status = MachineStatus(
            machine_id=input.machine_id,
            provider=input.provider,
            provider_id=input.provider_id,
            stage=input.resume_stage or MachineStage.PROVISIONING,
            stage_since=self._now(),
            agent=input.agent,
        )
        self._set_stage(self._status.stage)

        if self._status.stage is MachineStage.PROVISIONING:
            provisioned = await self._until_success(input.policy.provision_backoff, lambda: self._provision(input))
            self._status.address = provisioned.address
            self._set_stage(MachineStage.AGENT_STARTING)

        if self._status.stage is MachineStage.AGENT_STARTING:
            self._status.agent = await self._until_success(
                input.policy.agent_start_backoff, lambda: self._start_agent(input)
            )
            self._set_stage(MachineStage.WATCHING)

        # A healthy machine waits here at no cost; heartbeats go to BMDB, not to
        # this workflow. Histories stay short: continue as new when told to.
        await workflow.wait_condition(lambda: workflow.info().is_continue_as_new_suggested())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            MachineInput(
                provider=input.provider,
                provider_id=input.provider_id,
                machine_id=input.machine_id,
                policy=input.policy,
                resume_stage=self._status.stage,
                agent=self._status.agent,
            )
        )

    @workflow.query
    def status(self) -> MachineStatus:
        if self._status is None:
            raise ApplicationError("the workflow has not started yet")
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
            start_to_close_timeout=timedelta(seconds=input.policy.provision_timeout),
            retry_policy=_BLIP_RETRY,
        )

    async def _start_agent(self, input: MachineInput) -> AgentFacts:
        return await workflow.execute_activity_method(
            TakeoverActivities.start_agent,
            StartAgentInput(provider=input.provider, provider_id=input.provider_id, machine_id=input.machine_id),
            start_to_close_timeout=timedelta(seconds=input.policy.agent_start_timeout),
            retry_policy=_BLIP_RETRY,
        )

    async def _until_success(self, backoff: Backoff, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run attempt until it succeeds, waiting backoff between failures."""
        assert self._status is not None
        while True:
            self._status.attempts += 1
            try:
                result = await attempt()
            except ActivityError as error:
                self._status.last_error = describe_failure(error)
                delay = backoff.delay(self._status.attempts)
                self._status.next_attempt_at = (workflow.now() + timedelta(seconds=delay)).isoformat()
                workflow.logger.warning(
                    "%s attempt %d failed, next in %.0fs: %s",
                    self._status.stage,
                    self._status.attempts,
                    delay,
                    self._status.last_error,
                )
                await workflow.sleep(delay)
                continue
            self._status.attempts = 0
            self._status.next_attempt_at = None
            return result

    def _set_stage(self, stage: MachineStage) -> None:
        assert self._status is not None
        if stage is not self._status.stage:
            self._status.stage = stage
            self._status.stage_since = self._now()
            self._status.last_error = None
        workflow.upsert_search_attributes([MACHINE_STAGE.value_set(stage.value)])

    @staticmethod
    def _now() -> str:
        return workflow.now().isoformat()
