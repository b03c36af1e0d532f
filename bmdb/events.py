"""BMDB's event log: what happened to each machine and to the fleet, and who of the operators asked for it."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import insert, select

from bmdb.base import StoreBase
from bmdb.records import OPERATOR_ACTION_KINDS, Event
from bmdb.schema import events, machine_provided


class EventLog(StoreBase):
    """Appending to the event log and reading it."""

    async def add_event(
        self, machine_id: uuid.UUID | None, kind: str, detail: str = "", *, at: datetime | None = None
    ) -> bool:
        """Append an event, at now or at `at`; with `at`, False and nothing added when that event is there already
        (a retried write whose first answer was lost)."""
        async with self.engine.begin() as conn:
            if at is not None:
                same = select(events.c.event_id).where(
                    events.c.machine_id.is_(None) if machine_id is None else events.c.machine_id == machine_id,
                    events.c.kind == kind,
                    events.c.at == at,
                    events.c.detail == detail,
                )
                if await conn.scalar(same) is not None:
                    return False
            values = {"machine_id": machine_id, "kind": kind, "detail": detail}
            await conn.execute(insert(events).values(**values, **({"at": at} if at is not None else {})))
            return True

    async def list_events(self, machine_id: uuid.UUID | None, limit: int = 100) -> list[Event]:
        """Newest first; machine_id None lists fleet-wide events."""
        condition = events.c.machine_id.is_(None) if machine_id is None else events.c.machine_id == machine_id
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(events).where(condition).order_by(events.c.at.desc(), events.c.event_id.desc()).limit(limit)
            )
            return [Event(r.machine_id, r.at, r.kind, r.detail) for r in rows]

    async def list_actions(self, machine_id: uuid.UUID | None, limit: int = 100) -> list[Event]:
        """The operator actions (OPERATOR_ACTION_KINDS) of one machine, or of every machine and the fleet when
        machine_id is None; newest first, each with its machine's provider id."""
        query = (
            select(events, machine_provided.c.provider_id)
            .select_from(events.outerjoin(machine_provided, machine_provided.c.machine_id == events.c.machine_id))
            .where(events.c.kind.in_(OPERATOR_ACTION_KINDS))
            .order_by(events.c.at.desc(), events.c.event_id.desc())
            .limit(limit)
        )
        if machine_id is not None:
            query = query.where(events.c.machine_id == machine_id)
        async with self.engine.connect() as conn:
            return [Event(r.machine_id, r.at, r.kind, r.detail, r.provider_id) for r in await conn.execute(query)]
