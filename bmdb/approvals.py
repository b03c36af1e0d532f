"""Operator approvals: requests that wait for a second operator, and each one's decision, taken once."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, update

from bmdb.base import StoreBase
from bmdb.schema import events, operator_approvals

APPROVED = "approved"
REFUSED = "refused"


@dataclass(frozen=True)
class Approval:
    """A request that needs a second operator: what (the action and its target, the request as asked), who asked
    and how they were verified, until when it waits, and once decided, who decided what and what came of it."""

    approval_id: uuid.UUID
    action: str
    target: str
    request: dict[str, Any]
    asked_by: str
    asked_via: str
    asked_at: datetime
    expires_at: datetime
    decision: str | None = None
    decided_by: str | None = None
    decided_at: datetime | None = None
    outcome: str | None = None


class ApprovalRecords(StoreBase):
    """Asking for, listing and deciding operator approvals; each step in the event log too."""

    async def ask_approval(
        self,
        *,
        action: str,
        target: str,
        request: dict[str, Any],
        asked_by: str,
        asked_via: str,
        waits: timedelta,
        machine_id: uuid.UUID | None = None,
    ) -> Approval:
        """Keep a request for a second operator's decision, for waits; an ``approval_asked`` event."""
        approval_id = uuid.uuid4()
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    insert(operator_approvals)
                    .values(
                        approval_id=approval_id,
                        action=action,
                        target=target,
                        request=request,
                        asked_by=asked_by,
                        asked_via=asked_via,
                        expires_at=func.now() + waits,
                    )
                    .returning(*operator_approvals.c)
                )
            ).one()
            detail = f"{action} of {target} asked by {asked_by} (verified: {asked_via}), waits for a second operator"
            await conn.execute(
                insert(events).values(machine_id=machine_id, kind="approval_asked", detail=f"{detail}: {approval_id}")
            )
        return Approval(**row._asdict())

    async def approval(self, approval_id: uuid.UUID) -> Approval | None:
        """The approval of that id, decided or not; None when there is none."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(select(operator_approvals).where(operator_approvals.c.approval_id == approval_id))
            ).first()
        return None if row is None else Approval(**row._asdict())

    async def open_approvals(self) -> list[Approval]:
        """The approvals waiting for a decision and not expired, oldest first."""
        query = (
            select(operator_approvals)
            .where(operator_approvals.c.decision.is_(None), operator_approvals.c.expires_at > func.now())
            .order_by(operator_approvals.c.asked_at)
        )
        async with self.engine.connect() as conn:
            return [Approval(**row._asdict()) for row in await conn.execute(query)]

    async def decide_approval(
        self, approval_id: uuid.UUID, *, decision: str, by: str, machine_id: uuid.UUID | None = None
    ) -> Approval | None:
        """Take the decision on an open approval, once: the approval as decided, or None when it is decided
        already, expired or unknown (two operators deciding at once: one of them gets it). An event names it."""
        if decision not in (APPROVED, REFUSED):
            raise ValueError(f"a decision is {APPROVED} or {REFUSED}, got {decision!r}")
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    update(operator_approvals)
                    .where(
                        operator_approvals.c.approval_id == approval_id,
                        operator_approvals.c.decision.is_(None),
                        operator_approvals.c.expires_at > func.now(),
                    )
                    .values(decision=decision, decided_by=by, decided_at=func.now())
                    .returning(*operator_approvals.c)
                )
            ).first()
            if row is None:
                return None
            detail = (
                f"{row.action} of {row.target} asked by {row.asked_by} (verified: {row.asked_via}), {decision} by {by}"
            )
            await conn.execute(
                insert(events).values(
                    machine_id=machine_id, kind=f"approval_{decision}", detail=f"{detail}: {approval_id}"
                )
            )
        return Approval(**row._asdict())

    async def record_approval_outcome(self, approval_id: uuid.UUID, outcome: str) -> None:
        """What came of an approved request: the answer, or why it was not done."""
        async with self.engine.begin() as conn:
            await conn.execute(
                update(operator_approvals)
                .where(operator_approvals.c.approval_id == approval_id)
                .values(outcome=outcome[:2000])
            )
