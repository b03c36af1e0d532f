"""The operator API's bulk requests: one machine action on every machine a visibility query selects, as
`shepherd ... --where` does, within what the caller's grants reach.

The caller's where is ANDed with the scope of the grants that allow the action; the machines are counted, a dry run
answers them and does nothing; past the policy's bulk_confirm_over the caller types the count back ("confirm"),
counted again when the request comes; then each machine is checked against the policy on its own and asked, and
answers for itself: done, with its workflow's words, or refused, with why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifecycle.contracts import (
    DECOMMISSION_UPDATE,
    RECOVER_UPDATE,
    RESTART_AGENT_UPDATE,
    SET_MAINTENANCE_UPDATE,
    MaintenanceRequest,
    OperatorRequest,
    RecoveryRequest,
)
from operations.client import OperatorClient
from operations.machine_actions import InvalidQuery, Target, refusal_text
from operations.policy import Confirmation, Decision, OneMachine, ScopeEscape, Selection, restrict
from operations.policy import Target as PolicyTarget
from operations.policy_file import DECOMMISSION, MAINTENANCE, RECOVER, REIMAGE, RESTART_AGENT
from processes.operator_api_errors import ApiError

# The update each bulk action sends, as the commands' --where do; a recovery and a reimage are the recover update.
BULK_UPDATES = {
    RESTART_AGENT: RESTART_AGENT_UPDATE,
    MAINTENANCE: SET_MAINTENANCE_UPDATE,
    DECOMMISSION: DECOMMISSION_UPDATE,
    RECOVER: RECOVER_UPDATE,
    REIMAGE: RECOVER_UPDATE,
}
# Machines asked at once, as the CLI's --where.
IN_FLIGHT = 10

# What the policy decides of the caller doing the action to a target.
Decide = Callable[[PolicyTarget], Decision]


@dataclass(frozen=True)
class BulkRequest:
    """A bulk request's body, checked: the caller's query, what is asked of each machine, dry run, the count typed."""

    action: str
    where: str
    asked: OperatorRequest | MaintenanceRequest | RecoveryRequest
    dry_run: bool
    confirm: int | None


def bulk_request(action: str, body: dict[str, Any], by: str) -> BulkRequest:
    """The request a bulk body asks for; ApiError 400 naming what is wrong."""
    if action not in BULK_UPDATES:
        raise ApiError(400, f"no bulk action {action!r}; bulk takes {', '.join(BULK_UPDATES)}")
    confirm = body.get("confirm")
    if confirm is not None and (isinstance(confirm, bool) or not isinstance(confirm, int)):
        raise ApiError(400, "field 'confirm' must be a whole number: the count of machines the answer named")
    on, recover = body.get("on"), body.get("recover", False)
    if action == MAINTENANCE:
        if on is None:
            raise ApiError(400, "field 'on' is missing: maintenance takes on true or false")
        if recover and on:
            raise ApiError(400, "field 'recover' goes with on false")
    elif on is not None or "recover" in body:
        raise ApiError(400, f"fields 'on' and 'recover' go with maintenance, not {action}")
    if "force" in body and action != DECOMMISSION:
        raise ApiError(400, f"field 'force' goes with decommission, not {action}")
    reason = body.get("reason")
    if reason is None and not (action == MAINTENANCE and not on):
        raise ApiError(400, f"field 'reason' is missing: {action} needs a reason")
    asked: OperatorRequest | MaintenanceRequest | RecoveryRequest
    if action == MAINTENANCE:
        asked = MaintenanceRequest(bool(on), reason or "", by, bool(recover))
    elif action in (RECOVER, REIMAGE):
        asked = RecoveryRequest(reason or "", by, reimage=action == REIMAGE)
    else:
        asked = OperatorRequest(reason or "", by, force=body.get("force") is True)
    return BulkRequest(action, body["where"].strip(), asked, bool(body.get("dry_run", False)), confirm)


async def run_bulk(request: BulkRequest, decide: Decide, operators: OperatorClient) -> dict[str, Any]:
    """Select, count, confirm and act, as the caller's grants allow; the answer's document. ApiError when the
    policy refuses, the query is bad, or the count needs typing (428)."""
    allowed = decide(Selection())
    if not allowed.allowed:
        raise ApiError(403, allowed.refusal or f"may not {request.action}")
    try:
        query = restrict(allowed.scope, request.where)
    except ScopeEscape as error:
        raise ApiError(400, f"field 'where': {error}") from None
    assert query is not None
    try:
        targets = await operators.select(query)
    except InvalidQuery as error:
        raise ApiError(400, str(error).replace("--where", "where", 1)) from None
    count = len(targets)
    confirmation = decide(Selection(count)).confirmation if targets else Confirmation.NONE
    document: dict[str, Any] = {
        "action": request.action,
        "where": request.where,
        "query": query,
        "dry_run": request.dry_run,
        "count": count,
        "confirm_needed": count if confirmation == Confirmation.TYPED else None,
        # Only a dry run gets this far without the second person the policy asks for.
        "approval_needed": confirmation == Confirmation.SECOND_PERSON,
        "machines": [{"workflow_id": t.workflow_id, "provider_id": t.provider_id, "stage": t.stage} for t in targets],
    }
    if request.dry_run:
        return document | {"results": [], "summary": "dry run: nothing done"}
    if confirmation == Confirmation.TYPED and request.confirm != count:
        typed = "" if request.confirm is None else f"; {request.confirm} was typed, which is not the count now"
        raise ApiError(
            428,
            f"{request.action} on {count} machines needs a typed confirmation{typed}: "
            f'send the same request with "confirm": {count}',
        )
    results = await _act_on_all(request, decide, operators, targets)
    refused = sum(1 for r in results if r["outcome"] == "refused")
    summary = f"done: {count - refused} of {count} succeeded" + (f", {refused} did not" if refused else "")
    return document | {"results": results, "summary": summary}


async def _act_on_all(
    request: BulkRequest, decide: Decide, operators: OperatorClient, targets: list[Target]
) -> list[dict[str, Any]]:
    slots = asyncio.Semaphore(IN_FLIGHT)
    update = BULK_UPDATES[request.action]

    async def one(target: Target) -> dict[str, Any]:
        # Each machine is the policy's to allow on its own: the selection's scope is the grants' where, and a
        # provider the grants do not name may still have slipped in through a where of the caller's.
        decision = decide(OneMachine(target.provider or ""))
        if not decision.allowed:
            why = decision.refusal or f"may not {request.action}"
            return _result(target, "refused", f"{target.workflow_id}: not done: {why}")
        async with slots:
            try:
                if isinstance(request.asked, RecoveryRequest):
                    line = await operators.recover(target.workflow_id, request.asked)
                else:
                    line = await operators.ask_workflow(target.workflow_id, update, request.asked)
            except Exception as error:
                return _result(target, "refused", f"{target.workflow_id}: not done: {refusal_text(error)}")
        return _result(target, "done", line)

    return list(await asyncio.gather(*(one(target) for target in targets)))


def _result(target: Target, outcome: str, line: str) -> dict[str, Any]:
    result = {"workflow_id": target.workflow_id, "provider_id": target.provider_id, "outcome": outcome, "line": line}
    # Why a machine was not done, as the command's summary names it.
    return result | ({"why": line.split(": not done: ", 1)[-1]} if outcome == "refused" else {})
