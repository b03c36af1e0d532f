"""The activities of a machine's workflow, each with its summary, timeout, retry policy and task queue.

Provider calls run on the provider instance's own task queue, whose rate limit Temporal holds across all workers;
the SSH work on its machines (the takeover, the boot wait) on the instance's machine queue, which that limit does
not slow; BMDB writes on the worker's, but for the two a recovery waits on (the silence confirmed, the reboot
recorded), which run as local activities within the workflow task. An activity retries a blip (a dropped
connection) a few times itself; a failure that says something about the machine goes back to the step that ran
it, which waits the stage's back-off.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.decommission import DecommissionActivities
    from activities.provisioning import ProvisioningActivities
    from activities.recovery import RecoveryActivities
    from activities.takeover import TakeoverActivities
    from lifecycle.contracts import (
        AgentCheckInput,
        AgentFacts,
        BootWaitInput,
        BootWaitResult,
        DecommissionInput,
        MachineInput,
        ProvisionInput,
        ProvisionResult,
        RebootInput,
        RebootResult,
        ReimageResult,
        RetireResult,
        SilenceCheck,
        SilenceCheckInput,
        StartAgentInput,
        machine_task_queue,
        provider_task_queue,
    )

# Quick retries inside one attempt, for blips (a dropped BMDB connection); failures that say something about the
# machine are non-retryable there and go straight to the step's back-off.
BLIP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
# BMDB marks of what an operator must see: tried until BMDB answers, as the stage's own steps need it too.
UNTIL_BMDB_ANSWERS = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=5))
# How long an attempt of the SSH work may go unheard before it is tried again: a task lost on its way to a worker
# (the server handed it to a poll whose answer never arrived) or a worker that died waits this long, not the whole
# start-to-close (a takeover's minute, a boot's deadline): the server times it from the attempt's start, heartbeat
# or none. A takeover heartbeats from 3 s in, so most record none; a boot wait records one at its start and then one
# per most of this, one per 24 s of the boot.
TAKEOVER_HEARTBEAT_TIMEOUT = timedelta(seconds=20)
BOOT_WAIT_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# Bounds the boot wait of a workflow whose policy predates the boot deadline (the worker's setting decides).
BOOT_WAIT_BOUND = timedelta(hours=4)


def _at_the_provider(machine: MachineInput, seconds: float) -> dict[str, Any]:
    """Options of an activity that calls the machine's provider: the provider instance's rate-limited task queue."""
    return _attempts_on(provider_task_queue(workflow.info().task_queue, machine.provider), seconds)


def _on_the_machine(machine: MachineInput, seconds: float) -> dict[str, Any]:
    """Options of an activity that works on the machine over SSH: the provider instance's machine queue, which the
    API's rate limit does not slow (the activity's one read of the machine's address is not worth a dispatch of
    that limit)."""
    return _attempts_on(machine_task_queue(workflow.info().task_queue, machine.provider), seconds)


def _attempts_on(task_queue: str, seconds: float) -> dict[str, Any]:
    """Blips retried, at most seconds an attempt, on task_queue."""
    return {
        "start_to_close_timeout": timedelta(seconds=seconds),
        "retry_policy": BLIP_RETRY,
        "task_queue": task_queue,
    }


async def provision(machine: MachineInput) -> ProvisionResult:
    """Create the machine at its provider (idempotent through the workflow id) and record it in BMDB."""
    return await workflow.execute_activity_method(
        ProvisioningActivities.provision_machine,
        ProvisionInput(
            provider=machine.provider,
            provider_id=machine.provider_id,
            machine_id=machine.machine_id,
            idempotency_key=workflow.info().workflow_id,
        ),
        summary=f"create {machine.provider_id} at provider {machine.provider} and record it in BMDB",
        **_at_the_provider(machine, machine.policy.provision_timeout),
    )


async def start_agent(machine: MachineInput, replacing: str | None) -> AgentFacts:
    """Take the machine over: upload and start the agent over SSH."""
    return await workflow.execute_activity_method(
        TakeoverActivities.start_agent,
        StartAgentInput(
            provider=machine.provider,
            provider_id=machine.provider_id,
            machine_id=machine.machine_id,
            replaces=replacing,
        ),
        summary=f"start the agent on {machine.provider_id} over SSH",
        **_on_the_machine(machine, machine.policy.agent_start_timeout),
        heartbeat_timeout=TAKEOVER_HEARTBEAT_TIMEOUT,
    )


async def reboot_through_provider(machine: MachineInput, reboot: RebootInput) -> RebootResult:
    """Power-cycle the machine, unless its recovery cycle did already."""
    return await workflow.execute_activity_method(
        RecoveryActivities.reboot_through_provider,
        reboot,
        summary=f"reboot {machine.provider_id} through provider {machine.provider}: {reboot.cause}"[:200],
        **_at_the_provider(machine, machine.policy.recovery_timeout),
    )


async def reimage_through_provider(machine: MachineInput, reimage: RebootInput) -> ReimageResult:
    """Reimage the machine, unless its recovery cycle did already; reimaged False when its provider cannot."""
    return await workflow.execute_activity_method(
        RecoveryActivities.reimage_through_provider,
        reimage,
        summary=f"reimage {machine.provider_id} through provider {machine.provider}: {reimage.cause}"[:200],
        **_at_the_provider(machine, machine.policy.recovery_timeout),
    )


async def record_reboot(reboot: RebootInput, *, local: bool) -> None:
    """Record the reboot (or reimage) in BMDB, which forgets the old agent (and, after a reimage, the host key)."""
    summary = (
        "record the reimage in BMDB and forget the old agent and host key"
        if reboot.reimage
        else "record the reboot in BMDB and forget the old agent"
    )
    await _bmdb_step(RecoveryActivities.record_reboot, reboot, summary, BLIP_RETRY, local=local)


async def wait_for_boot(machine: MachineInput, went_down: bool) -> BootWaitResult:
    """Wait until the rebooted machine answers SSH, at most its policy's boot deadline."""
    deadline = machine.policy.boot_deadline
    return await workflow.execute_activity_method(
        RecoveryActivities.wait_for_boot,
        BootWaitInput(
            provider=machine.provider,
            provider_id=machine.provider_id,
            machine_id=machine.machine_id,
            went_down=went_down,
            deadline=deadline,
        ),
        summary=f"wait for {machine.provider_id} to answer SSH after the reboot",
        **_on_the_machine(machine, deadline + 60 if deadline else BOOT_WAIT_BOUND.total_seconds()),
        heartbeat_timeout=BOOT_WAIT_HEARTBEAT_TIMEOUT,
    )


async def reboot_and_record(machine: MachineInput, reboot: RebootInput) -> None:
    """Reboot and record in one activity, as recoveries begun before the two were split run it."""
    await workflow.execute_activity_method(
        RecoveryActivities.reboot_machine,
        reboot,
        summary=f"reboot {machine.provider_id} through provider {machine.provider}: {reboot.cause}"[:200],
        **_at_the_provider(machine, machine.policy.recovery_timeout),
    )


async def agent_alive(check: AgentCheckInput, provider_id: str) -> bool:
    """Whether BMDB has heard from the machine's agent lately."""
    alive: bool = await workflow.execute_activity_method(
        RecoveryActivities.check_agent_after_maintenance,
        check,
        summary=f"is the agent of {provider_id} still calling after its maintenance?",
        start_to_close_timeout=timedelta(minutes=1),
        retry_policy=UNTIL_BMDB_ANSWERS,
    )
    return alive


async def confirm_silence(check: SilenceCheckInput, provider_id: str, *, local: bool) -> SilenceCheck:
    """Whether BMDB still finds the agent silent, as the heartbeat_lost that asked for the recovery said."""
    summary = f"is the agent of {provider_id} still silent, with no hold on its provider?"
    confirmed: SilenceCheck = await _bmdb_step(
        RecoveryActivities.confirm_silence, check, summary, UNTIL_BMDB_ANSWERS, local=local
    )
    return confirmed


async def _bmdb_step(
    activity: Callable[[Any, Any], Awaitable[Any]], arg: Any, summary: str, retry: RetryPolicy, *, local: bool
) -> Any:
    """A step of one BMDB transaction: local, a local activity within the workflow task that needs it; else an
    ordinary activity on the worker's queue, as recoveries recorded before ran it."""
    options: dict[str, Any] = {
        "summary": summary,
        "start_to_close_timeout": timedelta(minutes=1),
        "retry_policy": retry,
    }
    if not local:
        return await workflow.execute_activity_method(activity, arg, **options)
    try:
        return await workflow.execute_local_activity_method(activity, arg, **options)
    except FailureError as failure:
        # A local activity's last failure is raised bare, where an activity's comes wrapped: wrapped here, so the
        # steps' back-off takes it as any step's failure rather than the run failing with it.
        raise ActivityError(
            f"local activity {activity.__name__} failed",
            scheduled_event_id=0,
            started_event_id=0,
            identity="",
            activity_type=activity.__name__,
            activity_id="",
            retry_state=None,
        ) from failure


async def stop_agent(machine: MachineInput, request: DecommissionInput) -> str:
    """Stop the machine's agent over SSH; what became of it."""
    stopped: str = await workflow.execute_activity_method(
        TakeoverActivities.stop_agent,
        request,
        summary=f"stop the agent on {machine.provider_id} over SSH",
        **_on_the_machine(machine, machine.policy.agent_start_timeout),
    )
    return stopped


async def retire_through_provider(machine: MachineInput, request: DecommissionInput) -> RetireResult:
    """Release the machine, or power it off, through its provider."""
    return await workflow.execute_activity_method(
        DecommissionActivities.retire_through_provider,
        request,
        summary=f"release or power off {machine.provider_id} through provider {machine.provider}",
        **_at_the_provider(machine, machine.policy.recovery_timeout),
    )


async def mark(activity: Callable[[Any, Any], Awaitable[None]], marked: Any, summary: str) -> None:
    """Record in BMDB what an operator must see (quarantine, stuck, maintenance, an action), until BMDB answers."""
    await workflow.execute_activity_method(
        activity,
        marked,
        summary=summary,
        start_to_close_timeout=timedelta(minutes=1),
        retry_policy=UNTIL_BMDB_ANSWERS,
    )
