"""FleetWorkflow: one reconcile pass, run by the fleet schedule (overlap: skip).

A pass decides from provider and BMDB listings which free capacity to bring
under management (refusing when the two disagree), admits those machines at
the device-creation rate a chunk at a time, chunk after chunk while a whole
one was admitted, makes sure every managed machine has its MachineWorkflow
running, and tells the workflows of machines whose agent went silent (the
watchdog: one BMDB query a look, no per-machine polling), unless so many are
silent at once that the fault is more likely ours: then it holds every
recovery of the provider (lifecycle.watchdog). The workers look for silent
machines more often between passes (processes.watchdog), at no cost to
Temporal; the pass's look is the one that needs no worker loop to run.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.failures import describe_failure

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from lifecycle.contracts import (
        AdmitInput,
        EnsureWorkflowsInput,
        FleetInput,
        FleetPassResult,
        ReconcilePassInput,
        ReconcilePassPlan,
        WatchdogInput,
        provider_task_queue,
    )

_LISTING_TIMEOUT = timedelta(minutes=5)
# Passes recorded before the watchdog's circuit breaker called signal_silent_machines.
_CIRCUIT_BREAKER = "recovery-circuit-breaker"
# Passes recorded before a pass went on after a whole chunk, chunk after chunk, ended after the first.
_CHUNK_AFTER_CHUNK = "chunk-after-chunk"
_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=30), maximum_attempts=5)


@workflow.defn(name="FleetWorkflow")
class FleetWorkflow:
    """One fleet reconcile pass: plan, admit, make sure every machine's workflow runs, signal the silent."""

    def __init__(self) -> None:
        self._result: FleetPassResult | None = None

    @workflow.run
    async def run(self, input: FleetInput) -> FleetPassResult:
        """Run one reconcile pass of the provider: plan, admit, ensure the workflows, find the silent; its result."""
        self._result = result = FleetPassResult(started_at=workflow.now().isoformat())
        try:
            result.plan = plan = await self._plan(input)
            while True:
                for index, provider_id in enumerate(plan.to_create):
                    if index:
                        await workflow.sleep(input.device_creation_interval)
                    await workflow.execute_activity_method(
                        FleetActivities.admit_machine,
                        AdmitInput(provider=input.provider, provider_id=provider_id),
                        summary=f"admit {provider_id} to BMDB and start its workflow",
                        start_to_close_timeout=timedelta(minutes=1),
                        retry_policy=_RETRY,
                    )
                    result.admitted.append(provider_id)
                if (
                    len(plan.to_create) < input.chunk_size
                    or not self._time_for_another_chunk()
                    or not workflow.patched(_CHUNK_AFTER_CHUNK)
                ):
                    break
                # A whole chunk admitted: more free capacity may wait, and its next chunk goes now, not a reconcile
                # interval later. Each chunk is planned afresh, so a disagreement found meanwhile still stops it.
                await workflow.sleep(input.device_creation_interval)
                result.plan = plan = await self._plan(input)
            # Machines already managed keep their workflows even in a refused pass.
            ensured = await workflow.execute_activity_method(
                FleetActivities.ensure_machine_workflows,
                EnsureWorkflowsInput(provider=input.provider),
                summary="start the workflow of every managed machine that has none running",
                start_to_close_timeout=_LISTING_TIMEOUT,
                retry_policy=_RETRY,
            )
            result.workflows_started = len(ensured.started)
            watchdog = WatchdogInput(
                provider=input.provider,
                as_of=workflow.now().isoformat(),
                first_heartbeat_within=input.first_heartbeat_within,
                heartbeat_within=input.heartbeat_within,
                hold_rule=input.recovery_hold,
            )
            if workflow.patched(_CIRCUIT_BREAKER):
                watched = await workflow.execute_activity_method(
                    FleetActivities.watch_silent_machines,
                    watchdog,
                    summary="find machines whose agent went silent and signal heartbeat_lost, unless too many are",
                    start_to_close_timeout=_LISTING_TIMEOUT,
                    retry_policy=_RETRY,
                )
                result.silent = watched.signalled
                result.recoveries_held = watched.hold
                result.spared_after_hold = watched.spared
            else:
                result.silent = await workflow.execute_activity_method(
                    FleetActivities.signal_silent_machines,
                    watchdog,
                    summary="find machines whose agent went silent and signal heartbeat_lost to them",
                    start_to_close_timeout=_LISTING_TIMEOUT,
                    retry_policy=_RETRY,
                )
        except ActivityError as error:
            result.error = describe_failure(error)
            self._count_pass("failed")
            # The pass result rides along as the failure's detail, for `shepherd fleet`.
            raise ApplicationError(f"reconcile pass failed: {result.error}", result, non_retryable=True) from error
        if plan.refused:
            # Failing the run makes the refusal stand out in the UI's list; the
            # next scheduled pass looks again.
            result.error = plan.note
            self._count_pass("refused")
            raise ApplicationError(
                f"{plan.note}: {'; '.join(plan.disagreements)}", result, type="ReconcileRefused", non_retryable=True
            )
        self._count_pass("completed")
        return result

    def _time_for_another_chunk(self) -> bool:
        """Whether the pass may admit another chunk: within half its execution timeout, so the rest of the pass
        (the workflows, the look) still has time, and with a history Temporal does not ask to end."""
        info = workflow.info()
        if info.is_continue_as_new_suggested():
            return False
        timeout = info.execution_timeout
        return timeout is None or workflow.now() - info.workflow_start_time < timeout / 2

    async def _plan(self, input: FleetInput) -> ReconcilePassPlan:
        return await workflow.execute_activity_method(
            FleetActivities.plan_reconcile_pass,
            ReconcilePassInput(provider=input.provider, max_machines=input.max_machines, chunk_size=input.chunk_size),
            summary=f"list provider {input.provider} and BMDB, decide what to bring under management",
            start_to_close_timeout=_LISTING_TIMEOUT,
            retry_policy=_RETRY,
            task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
        )

    def _count_pass(self, outcome: str) -> None:
        # The SDK's workflow meter records nothing while a history replays.
        meter = workflow.metric_meter()
        meter.create_counter("shepherd_reconcile_passes_total", "Fleet reconcile passes, by outcome").add(
            1, {"outcome": outcome}
        )
        if self._result is not None:
            meter.create_counter("shepherd_machines_admitted_total", "Machines brought under management").add(
                len(self._result.admitted)
            )

    @workflow.query
    def status(self) -> FleetPassResult | None:
        """The pass's result so far, or None before it began."""
        return self._result
