"""The Temporal UI's "current details" of a machine's workflow: who the machine is and how it is doing."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lifecycle.contracts import Decommission, MachineStage, MachineStatus


def current_details(status: MachineStatus, decommission_asked: Decommission | None) -> str:
    """Markdown for the workflow page: the machine, its stage, what fails or waits, and its recoveries."""
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
        lines.append(f"recovery requested: {status.recovery_requested.describe()}")
    if status.maintenance:
        m = status.maintenance
        lines.append(f"**maintenance** since {m.since}, asked by {m.by}: {m.reason} (left {m.left})")
    if status.stuck:
        lines.append(f"**stuck** since {status.stuck.since}: {status.stuck.reason}")
    decommission = status.decommission or decommission_asked
    if decommission is not None:
        lines.append(f"**decommission** asked by {decommission.by} at {decommission.since}: {decommission.reason}")
        if decommission.agent:
            lines.append(f"agent: {decommission.agent}")
        if decommission.provider_action:
            lines.append(f"provider: {decommission.provider_action} ({decommission.provider_detail})")
    if status.quarantine:
        lines.append(f"**quarantined** since {status.quarantine.since}: {status.quarantine.reason}")
        lines.append("release: `shepherd release` or the `release` update with a reason")
    if status.waiting_for_boot_since:
        done = "reimaged" if status.stage is MachineStage.REIMAGING else "rebooted"
        lines.append(f"{done}; waiting since {status.waiting_for_boot_since} for SSH to answer")
    lines.append(
        f"recoveries: {status.recovery_count}"
        + (f", last: {status.last_recovery_reason}" if status.last_recovery_reason else "")
    )
    return "\n\n".join(lines)
