"""The operator API's machine requests that are more than an update sent as asked: a recovery or a reimage (the
recover update, answered by the stage the workflow is in), a retry of a failing step, and a host-key reset (BMDB's
pin forgotten, then the retry update). Each is the operator client's, as the commands do it."""

from __future__ import annotations

from bmdb.store import MachineRecord
from lifecycle.contracts import OperatorRequest, RecoveryRequest, machine_workflow_id
from operations.client import OperatorClient
from operations.machine_actions import HostKeyError, OperatorRefused
from operations.machine_names import MachineNotFound
from operations.policy_file import RECOVER, REIMAGE, RESET_HOST_KEY, RETRY
from processes.operator_api_errors import ApiError

# The policy actions served by machine_action.
MACHINE_ACTIONS = (RECOVER, REIMAGE, RETRY, RESET_HOST_KEY)


async def machine_action(
    operators: OperatorClient, action: str, record: MachineRecord, reason: str, expect: str | None = None
) -> str:
    """Do action to the machine for the operator operators attest (a host-key reset: pinning next only a key with
    the fingerprint expect, when given); the answer line `shepherd` prints, or ApiError 409 with the workflow's
    reason (or what stopped a host-key reset) when it is refused."""
    workflow_id = machine_workflow_id(record.provider, record.provider_id)
    # Who asked is the attestation's to say; the name here is what an unattested client would record.
    by = operators.attestation.subject if operators.attestation is not None else "unknown"
    try:
        if action in (RECOVER, REIMAGE):
            return await operators.recover(workflow_id, RecoveryRequest(reason, by, reimage=action == REIMAGE))
        if action == RETRY:
            return await operators.retry(workflow_id, OperatorRequest(reason, by))
        if action == RESET_HOST_KEY:
            return await operators.reset_host_key(str(record.machine_id), reason, by, expect)
    except (OperatorRefused, HostKeyError, MachineNotFound) as error:
        raise ApiError(409, str(error)) from None
    raise ValueError(f"{action} is no machine action of {MACHINE_ACTIONS}")
