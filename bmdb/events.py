"""BMDB's event log: what happened to each machine and to the fleet, and who of the operators asked for it."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Row, func, insert, select
from sqlalchemy.sql import Select

from bmdb.base import StoreBase
from bmdb.records import OPERATOR_ACTION_KINDS, Event
from bmdb.schema import events, machine_provided
from foundation.foreign_text import foreign_text

# The longest an event's detail is kept: it may quote a machine, a BMC or a provider, and the log keeps it for good.
DETAIL_LIMIT = 2000


class EventLog(StoreBase):
    """Appending to the event log and reading it."""

    async def add_event(
        self, machine_id: uuid.UUID | None, kind: str, detail: str = "", *, at: datetime | None = None
    ) -> bool:
        """Append an event, at now or at `at`; with `at`, False and nothing added when that event is there already
        (a retried write whose first answer was lost). The detail is kept on one line of at most DETAIL_LIMIT
        characters, its control characters escaped."""
        detail = foreign_text(detail, DETAIL_LIMIT)
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

    async def list_fleet_log(
        self, *, provider: str | None, since: datetime | None, limit: int, actions: bool = False
    ) -> list[Event]:
        """Every machine's events and the fleet's own, newest first, each with its id, machine and provider:
        provider keeps that instance's machines (and so leaves out the fleet's own events, which have none), since
        the events at or after it, actions the operator actions (OPERATOR_ACTION_KINDS)."""
        query = _logged().order_by(events.c.at.desc(), events.c.event_id.desc()).limit(limit)
        if provider is not None:
            query = query.where(machine_provided.c.provider == provider)
        if since is not None:
            query = query.where(events.c.at >= since)
        if actions:
            query = query.where(events.c.kind.in_(OPERATOR_ACTION_KINDS))
        async with self.engine.connect() as conn:
            return [_logged_event(r) for r in await conn.execute(query)]

    async def events_after(self, event_id: int, limit: int) -> list[Event]:
        """The events whose id is above event_id, oldest first (by id), each with its machine and provider."""
        query = _logged().where(events.c.event_id > event_id).order_by(events.c.event_id).limit(limit)
        async with self.engine.connect() as conn:
            return [_logged_event(r) for r in await conn.execute(query)]

    async def last_event_id(self) -> int:
        """The highest event id so far; 0 for an empty log."""
        async with self.engine.connect() as conn:
            return int(await conn.scalar(select(func.coalesce(func.max(events.c.event_id), 0))) or 0)


def _logged() -> Select[Any]:
    return select(events, machine_provided.c.provider, machine_provided.c.provider_id).select_from(
        events.outerjoin(machine_provided, machine_provided.c.machine_id == events.c.machine_id)
    )


def _logged_event(r: Row[Any]) -> Event:
    return Event(r.machine_id, r.at, r.kind, r.detail, r.provider_id, r.event_id, r.provider)
