"""A design option measured by bench.bringup, not what the product does: provisioning and the agent start merged
into ONE activity, so a bring-up is two workflow tasks and one activity instead of three and two.

MergedBringUpBench does what MachineWorkflow's successful bring-up does, minus that step: it upserts the stage
search attributes as MachineWorkflow does with PROVISIONING, runs the one activity on the provider's task queue,
upserts them with WATCHING (AGENT_STARTING is skipped: no workflow task falls between the two steps any more, so
nothing could show it; two upserts, not three), then waits as MachineWorkflow waits in WATCHING (it never
completes, so its history holds no completion event that MachineWorkflow's lacks). The activity runs the
product's own ProvisioningActivities.provision_machine and then TakeoverActivities.start_agent, on the worker's
ActivityDeps.

Left out, as the option would lose them: a back-off and a stuck deadline of each step (here one back-off, the agent
start's, for both, and no deadline), and the AGENT_STARTING stage; a failed SSH attempt calls the provider's create
again.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.deps import ActivityDeps
    from activities.provisioning import ProvisioningActivities
    from activities.takeover import TakeoverActivities
    from lifecycle.contracts import (
        AgentFacts,
        MachineInput,
        MachineStage,
        ProvisionInput,
        StartAgentInput,
        machine_search_attributes,
        provider_task_queue,
    )

# MachineWorkflow's retries within one attempt, for blips.
MERGED_BRINGUP_WORKFLOW_TYPE = "MergedBringUpBench"
_BLIP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)


class MergedBringUpActivities:
    """The one activity of the merged bring-up, on the provider's task queue."""

    def __init__(self, deps: ActivityDeps) -> None:
        self.provisioning = ProvisioningActivities(deps)
        self.takeover = TakeoverActivities(deps)

    @activity.defn(name="bench_provision_and_start_agent")
    async def provision_and_start_agent(self, input: ProvisionInput) -> AgentFacts:
        await self.provisioning.provision_machine(input)
        return await self.takeover.start_agent(StartAgentInput(input.provider, input.provider_id, input.machine_id))


@workflow.defn(name=MERGED_BRINGUP_WORKFLOW_TYPE)
class MergedBringUpWorkflow:
    """A machine's bring-up with provisioning and the agent start as one activity; a benchmark's, not the product's."""

    @workflow.run
    async def run(self, input: MachineInput) -> None:
        self._set_stage(input, MachineStage.PROVISIONING)
        failed = 0
        while True:
            try:
                await workflow.execute_activity_method(
                    MergedBringUpActivities.provision_and_start_agent,
                    ProvisionInput(input.provider, input.provider_id, input.machine_id, workflow.info().workflow_id),
                    summary=f"create {input.provider_id} at provider {input.provider} and start its agent over SSH",
                    start_to_close_timeout=timedelta(
                        seconds=input.policy.provision_timeout + input.policy.agent_start_timeout
                    ),
                    retry_policy=_BLIP_RETRY,
                    task_queue=provider_task_queue(workflow.info().task_queue, input.provider),
                )
                break
            except ActivityError:
                failed += 1
                await workflow.sleep(input.policy.agent_start_backoff.delay(failed))
        self._set_stage(input, MachineStage.WATCHING)
        await workflow.wait_condition(lambda: False)

    @staticmethod
    def _set_stage(input: MachineInput, stage: MachineStage) -> None:
        workflow.upsert_search_attributes(
            machine_search_attributes(input.provider, input.provider_id, input.machine_id, stage)
        )
