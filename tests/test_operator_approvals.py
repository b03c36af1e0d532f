"""Operator approvals: a request the policy gives to two people waits in BMDB for a second operator, whose decision
is taken once, however many decide at the same moment, and never after the request has expired."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest

from bmdb.approvals import APPROVED, REFUSED


async def ask(bmdb, waits: timedelta = timedelta(minutes=5)):
    return await bmdb.ask_approval(
        action="decommission",
        target="machine-sim-node-0001",
        request={"operation": "decommission", "name": "node-0001", "body": {"reason": "end of lease"}},
        asked_by="alice",
        asked_via="oidc",
        waits=waits,
    )


async def test_an_approval_is_decided_once_by_whoever_comes_first(bmdb):
    asked = await ask(bmdb)
    assert asked in await bmdb.open_approvals()
    assert asked.request["body"] == {"reason": "end of lease"} and asked.expires_at > asked.asked_at
    decisions = await asyncio.gather(
        *(bmdb.decide_approval(asked.approval_id, decision=APPROVED, by=f"operator-{n}") for n in range(5))
    )
    taken = [d for d in decisions if d is not None]
    assert len(taken) == 1 and taken[0].decision == APPROVED and taken[0].decided_at is not None
    assert asked.approval_id not in {a.approval_id for a in await bmdb.open_approvals()}
    assert await bmdb.decide_approval(asked.approval_id, decision=REFUSED, by="carol") is None
    await bmdb.record_approval_outcome(asked.approval_id, "machine-sim-node-0001: decommissioning (end of lease)")
    kept = await bmdb.approval(asked.approval_id)
    assert kept is not None and kept.decided_by == taken[0].decided_by and kept.outcome.endswith("(end of lease)")
    kinds = [e.kind for e in await bmdb.list_events(None, limit=50)]
    assert "approval_asked" in kinds and "approval_approved" in kinds


async def test_an_expired_or_unknown_approval_is_not_decided(bmdb):
    expired = await ask(bmdb, waits=timedelta(seconds=-1))
    assert expired.approval_id not in {a.approval_id for a in await bmdb.open_approvals()}
    assert await bmdb.decide_approval(expired.approval_id, decision=APPROVED, by="bob") is None
    assert await bmdb.decide_approval(uuid.uuid4(), decision=APPROVED, by="bob") is None
    with pytest.raises(ValueError, match="a decision is approved or refused"):
        await bmdb.decide_approval(expired.approval_id, decision="maybe", by="bob")
