"""Second-person approvals: a request the policy gives to two people is kept in BMDB as it was asked (202), listed
for the operators who may approve it, and done as asked once a second operator allowed the same action approves
it, or dropped when one refuses it or it expires. Each step is in the event log, and the machine's record names
both operators."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from bmdb.approvals import APPROVED, REFUSED, Approval
from bmdb.store import BMDB
from lifecycle.contracts import credited
from operations.policy import ReloadedPolicy
from processes.operator_api_errors import ApiError
from processes.operator_api_requests import Asked, NeedsApproval, requester, target_from_json, target_json

# The decision each approval route takes, by the last part of its path.
DECISIONS = {"approve": APPROVED, "refuse": REFUSED}


class Approvals:
    """The approvals of one API: kept in BMDB (opened by bmdb()), decided as the policy allows."""

    def __init__(self, bmdb: Callable[[], Awaitable[BMDB]], policy: ReloadedPolicy, waits: timedelta) -> None:
        self.bmdb, self.policy, self.waits = bmdb, policy, waits

    async def ask(self, asked: Asked, needs: NeedsApproval) -> web.Response:
        """Keep the request for a second operator; 202 with the approval and what happens next."""
        identity = asked.identity
        approval = await (await self.bmdb()).ask_approval(
            action=needs.action,
            target=needs.what,
            request={"asked": asked.to_json(), "target": target_json(needs.target), "machine_id": needs.machine_id},
            asked_by=identity.subject,
            asked_via=identity.verified_by,
            waits=self.waits,
            machine_id=None if needs.machine_id is None else uuid.UUID(needs.machine_id),
        )
        answer = (
            f"{needs.what} waits for a second operator allowed to {needs.action}: approval {approval.approval_id}, "
            f"until {approval.expires_at.isoformat(timespec='seconds')} (shepherd approvals --approve "
            f"{approval.approval_id})"
        )
        return web.json_response({"answer": answer, "approval": approval_json(approval)}, status=202)

    async def open(self) -> list[dict[str, Any]]:
        """The approvals waiting for a decision, as the API lists them."""
        return [approval_json(approval) for approval in await (await self.bmdb()).open_approvals()]

    async def decide(self, asked: Asked, perform: Callable[[Asked], Awaitable[web.StreamResponse]]) -> web.Response:
        """Approve (and do the request as it was asked, answering what it answers) or refuse an approval."""
        verb = asked.route.path.rsplit("/", 1)[-1]
        decision = DECISIONS[verb]
        approval = await self._open_approval(asked.params["approval"])
        approver = asked.identity
        if approver.subject == approval.asked_by:
            raise ApiError(403, f"{approval.target} was asked by {approver.subject}: a second operator decides it")
        allowed = self.policy.decide(requester(approver), approval.action, target_from_json(approval.request["target"]))
        if not allowed.allowed:
            raise ApiError(403, allowed.refusal or f"{approver.subject} may not {approval.action}")
        machine_id = approval.request.get("machine_id")
        bmdb = await self.bmdb()
        decided = await bmdb.decide_approval(
            approval.approval_id,
            decision=decision,
            by=credited(approver.subject, approver.verified_by),
            machine_id=None if machine_id is None else uuid.UUID(machine_id),
        )
        if decided is None:
            raise ApiError(
                409, f"approval {approval.approval_id} was decided by another operator, or expired, meanwhile"
            )
        if decision == REFUSED:
            await bmdb.record_approval_outcome(approval.approval_id, f"refused by {approver.subject}")
            return web.json_response({"answer": f"{approval.target}: refused by {approver.subject}, nothing done"})
        try:
            replay = Asked.from_json(approval.request["asked"], approved_by=approver)
            response = await perform(replay)
        except ApiError as error:
            await bmdb.record_approval_outcome(approval.approval_id, f"not done: {error.text}")
            raise
        await bmdb.record_approval_outcome(approval.approval_id, _outcome(response))
        assert isinstance(response, web.Response)
        return response

    async def _open_approval(self, text: str) -> Approval:
        try:
            approval_id = uuid.UUID(text)
        except ValueError:
            raise ApiError(404, f"no approval {text!r}: an approval is named by its UUID") from None
        approval = await (await self.bmdb()).approval(approval_id)
        if approval is None:
            raise ApiError(404, f"no approval {approval_id}")
        if approval.decision is not None:
            raise ApiError(409, f"approval {approval_id} was {approval.decision} by {approval.decided_by} already")
        if approval.expires_at <= datetime.now(UTC):
            raise ApiError(
                409, f"approval {approval_id} expired at {approval.expires_at.isoformat(timespec='seconds')}"
            )
        return approval


def approval_json(approval: Approval) -> dict[str, Any]:
    """An approval as the API shows it: what, who asked and how they were verified, until when, how it ended."""
    return {
        "approval_id": str(approval.approval_id),
        "action": approval.action,
        "target": approval.target,
        "asked_by": credited(approval.asked_by, approval.asked_via),
        "asked_at": approval.asked_at.isoformat(),
        "expires_at": approval.expires_at.isoformat(),
        "body": approval.request.get("asked", {}).get("body", ""),
        "decision": approval.decision,
        "decided_by": approval.decided_by,
        "outcome": approval.outcome,
    }


def _outcome(response: web.StreamResponse) -> str:
    """What an approved request answered, for the approval's record."""
    body = getattr(response, "text", None) or "{}"
    try:
        answer = json.loads(body)
    except ValueError:
        return f"HTTP {response.status}"
    if isinstance(answer, dict):
        return str(answer.get("answer") or answer.get("summary") or f"HTTP {response.status}")
    return f"HTTP {response.status}"
