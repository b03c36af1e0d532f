"""MachineWorkflow back-offs on the time-skipping test server.

The seed's back-offs are minutes to hours; the test server skips the waits.
The activities here are stand-ins registered under the real activity names,
because the point is the workflow's timing, not the I/O.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from workflows.machine import MachineWorkflow
from workflows.types import (
    AgentFacts,
    Backoff,
    LifecyclePolicy,
    MachineInput,
    MachineStage,
    ProvisionInput,
    ProvisionResult,
    StartAgentInput,
)

SEED_AGENT_BACKOFF = Backoff(initial=300.0, maximum=4 * 3600.0, multiplier=1.2)


class FakeMachineActivities:
    """Stand-ins that fail agent starts a set number of times, recording when."""

    def __init__(self, agent_failures: int) -> None:
        self.agent_failures = agent_failures
        self.agent_attempt_times: list[float] = []

    @activity.defn(name="provision_machine")
    async def provision_machine(self, input: ProvisionInput) -> ProvisionResult:
        return ProvisionResult(address="192.0.2.1", ssh_port=22, location="test")

    @activity.defn(name="start_agent")
    async def start_agent(self, input: StartAgentInput) -> AgentFacts:
        self.agent_attempt_times.append(activity.info().current_attempt_scheduled_time.timestamp())
        if len(self.agent_attempt_times) <= self.agent_failures:
            raise ApplicationError("agent said: disk on fire", type="AGENT_ERROR", non_retryable=True)
        return AgentFacts(started_at="2026-01-01T00:00:00+00:00", key_fingerprint="SHA256:x")


async def test_agent_start_waits_the_seed_backoff_between_attempts(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=4)
    queue = f"backoff-{uuid.uuid4()}"
    policy = LifecyclePolicy(provision_backoff=Backoff(60, 3600, 1.2), agent_start_backoff=SEED_AGENT_BACKOFF)
    async with Worker(
        env.client,
        task_queue=queue,
        workflows=[MachineWorkflow],
        activities=[fakes.provision_machine, fakes.start_agent],
    ):
        handle = await env.client.start_workflow(
            MachineWorkflow.run,
            MachineInput("sim", "node-0001", str(uuid.uuid4()), policy),
            id=f"machine-sim-{uuid.uuid4()}",
            task_queue=queue,
        )
        # Each failed attempt is followed by a wait of 300 s x 1.2^n.
        for failures in range(1, 5):
            await env.sleep(timedelta(seconds=1))
            status = await handle.query(MachineWorkflow.status)
            assert status.stage is MachineStage.AGENT_STARTING
            assert status.attempts == failures
            assert status.last_error == "AGENT_ERROR: agent said: disk on fire"
            await env.sleep(timedelta(seconds=SEED_AGENT_BACKOFF.delay(failures)))
        await env.sleep(timedelta(seconds=1))
        status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING
        assert status.attempts == 0 and status.agent is not None
        gaps = [round(b - a) for a, b in zip(fakes.agent_attempt_times, fakes.agent_attempt_times[1:], strict=False)]
        assert gaps == [300, 360, 432, 518]
        await handle.terminate()
