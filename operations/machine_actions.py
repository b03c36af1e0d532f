"""What an operator asks of machines: an update or a recovery of one machine or of each a query selects, and a
host-key pin forgotten after a reinstall. Every request carries who asked and why."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from foundation.ssh_sessions import host_key_fingerprint
from lifecycle.contracts import (
    FORCE_RECOVER_SIGNAL,
    MACHINE_STAGE,
    PROVIDER,
    PROVIDER_ID,
    RECOVER_UPDATE,
    RETRY_NOW_SIGNAL,
    RETRY_UPDATE,
    RUNNING_MACHINES,
    MaintenanceRequest,
    OperatorRequest,
    RecoveryRequest,
    machine_workflow_id,
)
from operations.connections import Connections, OperatorError
from operations.machine_names import describe_workflow, resolve_machine, running_machine_workflow
from operations.machine_reads import machine_status
from operations.policy_file import query_problem

# Long enough for any operator's note, short enough for a status line.
MAX_REASON_LENGTH = 500
# A SHA-256 digest in unpadded base64, as OpenSSH writes a host key's fingerprint.
_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")


class OperatorRefused(OperatorError):
    """The machine's workflow refused the request, and said why."""


class InvalidQuery(OperatorError):
    """A visibility query Temporal does not accept; the message quotes Temporal's reason."""


class HostKeyError(OperatorError):
    """The pin could not be reset, or the workflow not told; the message says what happened and what to do."""


@dataclass(frozen=True)
class Target:
    """One machine a query selected: its workflow, provider id and stage at the time of the listing."""

    workflow_id: str
    provider_id: str
    stage: str
    provider: str | None = None  # its provider instance, for the policy's check of each machine of a bulk request


def check_reason(text: str) -> str:
    """An operator's reason, stripped; ValueError when it is empty or too long to keep."""
    reason = text.strip()
    if not reason:
        raise ValueError("the reason is empty; say why it is asked")
    if len(reason) > MAX_REASON_LENGTH:
        raise ValueError(f"the reason is {len(reason)} characters long, at most {MAX_REASON_LENGTH} are kept")
    return reason


def check_fingerprint(text: str) -> str:
    """A host key's SHA256 fingerprint as OpenSSH prints it (`ssh-keygen -lf`), stripped; ValueError naming the
    shape when it is not one."""
    fingerprint = text.strip()
    if _FINGERPRINT.fullmatch(fingerprint) is None:
        raise ValueError(
            f"{fingerprint[:80]!r} is no SHA256 host key fingerprint: expected SHA256: and 43 base64 characters, "
            "as `ssh-keygen -lf` prints it for the machine's host key"
        )
    return fingerprint


def refusal_text(error: BaseException) -> str:
    """One line of why a request to one machine did not happen."""
    if isinstance(error, WorkflowUpdateFailedError):
        return str(getattr(error.cause, "message", None) or error.cause or error)
    if isinstance(error, RPCError):
        return error.message or error.status.name
    return " ".join(str(error).split()) or type(error).__name__


class MachineActions(Connections):
    """The requests operators send to machines' workflows."""

    async def ask(self, name: str, update: str, request: OperatorRequest | MaintenanceRequest, *, then: str) -> str:
        """Send the update to the running workflow of the machine of that name; its answer, or OperatorRefused
        with its reason. then: what the operator should do once a workflow that does not run runs again."""
        workflow_id = await running_machine_workflow(await self.temporal(), self.bmdb, name, then=then)
        try:
            return await self.ask_workflow(workflow_id, update, request)
        except WorkflowUpdateFailedError as error:
            raise OperatorRefused(f"{workflow_id}: {refusal_text(error)}") from None

    async def ask_workflow(self, workflow_id: str, update: str, request: OperatorRequest | MaintenanceRequest) -> str:
        """Send the update to one machine workflow, with the API's proof when the operator is a verified one; its
        answer, as a line naming the workflow."""
        sent = request if self.attestation is None else self.attestation.attest(workflow_id, update, request)
        handle = (await self.temporal()).get_workflow_handle(workflow_id)
        return f"{workflow_id}: {await handle.execute_update(update, sent, result_type=str)}"

    async def recover(self, name: str, request: RecoveryRequest) -> str:
        """Ask the machine of that name for a recovery reboot (or a reimage); what happens, told by the stage it
        was in. A verified operator's request is the recover update, whose answer the workflow gives and whose
        refusal is OperatorRefused; one by hand is the force_recover signal, told by the stage queried before."""
        request = dataclasses.replace(request, reason=check_reason(request.reason))
        workflow_id = await running_machine_workflow(await self.temporal(), self.bmdb, name, then="recover it again")
        if self.attestation is not None:
            attested = self.attestation.attest(workflow_id, RECOVER_UPDATE, request)
            handle = (await self.temporal()).get_workflow_handle(workflow_id)
            try:
                return await handle.execute_update(RECOVER_UPDATE, attested, result_type=str)
            except WorkflowUpdateFailedError as error:
                raise OperatorRefused(f"{workflow_id}: {refusal_text(error)}") from None
        before = await self._stage_of(workflow_id)
        await self.signal_recovery(workflow_id, request)
        return request.answer(workflow_id, before)

    async def retry(self, name: str, request: OperatorRequest) -> str:
        """Ask the machine of that name to end its failing step's back-off now (the retry update); its answer, or
        OperatorRefused saying why (no step is failing)."""
        return await self.ask(name, RETRY_UPDATE, request, then="ask again once it runs")

    async def signal_recovery(self, workflow_id: str, request: RecoveryRequest) -> None:
        """Signal force_recover to one machine workflow."""
        await (await self.temporal()).get_workflow_handle(workflow_id).signal(FORCE_RECOVER_SIGNAL, request)

    async def _stage_of(self, workflow_id: str) -> str:
        # The status query needs a worker; without one the signal still waits in the history.
        try:
            return str((await machine_status(await self.temporal(), workflow_id)).stage)
        except Exception:
            return "in an unknown stage (no worker answered the status query)"

    async def select(self, where: str) -> list[Target]:
        """The running machine workflows a visibility query selects, by workflow id; InvalidQuery when the query
        could reach past the running machines it is ANDed with, or Temporal refuses it."""
        problem = query_problem(where)
        if problem:
            # Checked here, not left to Temporal: "x) OR (y" is a query it accepts, selecting beyond machines.
            raise InvalidQuery(f"--where {where!r} {problem}: nothing selected")
        query = f"{RUNNING_MACHINES} AND ({where})"
        targets = []
        try:
            async for execution in (await self.temporal()).list_workflows(query):
                attributes = execution.typed_search_attributes
                targets.append(
                    Target(
                        execution.id,
                        attributes.get(PROVIDER_ID) or execution.id,
                        attributes.get(MACHINE_STAGE) or "unknown",
                        attributes.get(PROVIDER),
                    )
                )
        except RPCError as error:
            if error.status == RPCStatusCode.INVALID_ARGUMENT:
                raise InvalidQuery(f"--where {where!r} is not a query Temporal accepts: {error.message}") from None
            raise
        return sorted(targets, key=lambda t: t.workflow_id)

    async def reset_host_key(self, name: str, reason: str, by: str = "unknown", expect: str | None = None) -> str:
        """Forget the pinned host key of the machine of that name and ask its workflow to retry now; what
        happened. With expect (a SHA256 fingerprint), only a key with it is pinned next. Temporal is reached
        first: a pin is not reset when the workflow cannot be told."""
        client = await self.temporal()
        bmdb = await self.bmdb()
        record = await resolve_machine(bmdb, name)
        machine = record.provider_id
        pinning = _next_pin(expect)
        if record.ssh_host_key is None and record.expected_host_key_fingerprint is None and expect is None:
            return f"{machine} has no pinned host key; {pinning}"
        was = "none pinned" if record.ssh_host_key is None else host_key_fingerprint(record.ssh_host_key)
        if record.expected_host_key_fingerprint is not None:
            was += f", expecting {record.expected_host_key_fingerprint}"
        why = f"by {self.credited(by)}: {reason}; was {was}" + (f"; expecting {expect}" if expect else "")
        if not await bmdb.reset_host_key(record.machine_id, record.ssh_host_key, why, expected=expect):
            raise HostKeyError(
                f"the host key pin of {machine} changed while it was being reset; nothing was reset, "
                f"see `shepherd events {machine}` and try again"
            )
        pin = "no host key pinned; the expectation" if record.ssh_host_key is None else f"host key pin {was}"
        done = f"{machine}: {pin} reset ({reason})"
        workflow_id = machine_workflow_id(record.provider, record.provider_id)
        try:
            description = await describe_workflow(client, workflow_id)
            if description is None:
                return f"{done}; {workflow_id} has not started yet: {pinning}"
            if description.status != WorkflowExecutionStatus.RUNNING:
                return f"{done}; {workflow_id} is not running, at its next run {pinning}"
            retry = OperatorRequest(f"host key pin reset: {reason}", by)
            if self.attestation is not None:
                return await self._retry_verified(done, workflow_id, retry, pinning)
            await client.get_workflow_handle(workflow_id).signal(RETRY_NOW_SIGNAL, retry)
        except RPCError as error:
            raise HostKeyError(
                f"{done}, but {workflow_id} could not be asked to retry now ({error.message}); "
                f"it retries at the end of its back-off, or send it the retry_now signal; {pinning}"
            ) from None
        return f"{done}; {workflow_id} was asked to retry now: {pinning}"

    async def _retry_verified(self, done: str, workflow_id: str, retry: OperatorRequest, pinning: str) -> str:
        """The retry after a verified operator's host-key reset, as the retry update: the pin is reset whether or
        not a step is failing, so the workflow's refusal is told, not raised."""
        try:
            await self.ask_workflow(workflow_id, RETRY_UPDATE, retry)
        except WorkflowUpdateFailedError as error:
            refused = refusal_text(error)
            return f"{done}; {workflow_id} did not retry ({refused}), at its next takeover {pinning}"
        return f"{done}; {workflow_id} was asked to retry now: {pinning}"


def _next_pin(expect: str | None) -> str:
    """Which host key the next takeover pins, as the operator reads it."""
    if expect is None:
        return "the first host key to answer will be pinned, and a host_key_pinned event will name it"
    return f"only a host key with fingerprint {expect} will be pinned"
