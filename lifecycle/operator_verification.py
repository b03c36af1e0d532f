"""Whether an operator's request to a machine's workflow is verified: its update validator's check of the operator
API's proof against the keys the worker trusts, and the refusal of unverified destructive requests.

lifecycle.contracts re-exports check_proof for the workflow, which passes its own id and clock.
"""

from datetime import datetime

from foundation.operator_proof import current_trust
from lifecycle.messages import MaintenanceRequest, OperatorRequest, RecoveryRequest


def check_proof(
    action: str,
    request: OperatorRequest | MaintenanceRequest | RecoveryRequest,
    *,
    workflow_id: str,
    task_queue: str,
    now: datetime,
) -> None:
    """ValueError when the request's proof does not check against the operator API keys this worker trusts, or when
    it has none and this worker refuses the action unverified (SHEPHERD_UNVERIFIED_OPERATOR_ACTIONS).

    The trust is that of the worker of the workflow's task queue, read from memory: a validator runs once, as the
    update arrives, and never when a history is replayed, so what it reads is not part of the history.
    """
    trust = current_trust(task_queue)
    if request.proof is None:
        if action in trust.refuse_unverified:
            raise ValueError(
                f"{action} is refused unless it comes through the operator API, which verifies who asks "
                "(this deployment's SHEPHERD_UNVERIFIED_OPERATOR_ACTIONS)"
            )
        return
    trust.keys.check(
        request.proof,
        workflow_id=workflow_id,
        action=action,
        by=request.by,
        request=request.signed(),
        now=now,
        max_age=trust.max_age,
    )
