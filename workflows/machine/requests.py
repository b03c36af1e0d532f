"""What an operator's update or signal brings a machine's workflow: the request as given, its proof checked in the
update's validator, and the action kept in the status and BMDB's event log with who asked."""

from __future__ import annotations

from temporalio import workflow

from workflows.machine import activities
from workflows.machine.run import MachineRun

with workflow.unsafe.imports_passed_through():
    from activities.recovery import RecoveryActivities
    from lifecycle.contracts import (
        MaintenanceRequest,
        OperatorAction,
        OperatorActionInput,
        OperatorRequest,
        RecoveryRequest,
        check_proof,
    )

# Signals recorded before operator actions were logged in BMDB recorded nothing.
_ACTIONS_LOGGED = "operator-actions-logged"
# How many operator actions the status keeps.
_ACTIONS_KEPT = 10


def given(request: OperatorRequest | None) -> OperatorRequest:
    """An update's request, or the empty one its validator refuses when none was sent."""
    return request or OperatorRequest()


def check_proof_in_validator(action: str, request: OperatorRequest | MaintenanceRequest | RecoveryRequest) -> None:
    """ValueError when the request's proof does not check, or it has none and this worker refuses the action
    unverified; called in the update's validator, the one place a workflow may refuse what it is sent."""
    info = workflow.info()
    check_proof(action, request, workflow_id=info.workflow_id, task_queue=info.task_queue, now=workflow.now())


class ActionLog(MachineRun):
    """The operators' requests a run keeps: the last few in its status, each also an event in BMDB's log."""

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
            await activities.mark(RecoveryActivities.record_operator_action, logged, f"log {action} by {by} in BMDB")
