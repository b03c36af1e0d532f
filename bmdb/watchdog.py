"""What the fleet watchdog reads: which machines it watches, which of them fell silent, and the log of each silence."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, delete, func, insert, literal, or_, select, update
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from bmdb.base import StoreBase
from bmdb.records import SilentMachine, WatchdogLook, WatchedMachines
from bmdb.schema import (
    events,
    machine_agent_heartbeat,
    machine_agent_started,
    machine_provided,
    recovery_holds,
    silence_signals,
    watchdog_looks,
)

# The look time of a provider's row before its first look ends.
_NEVER = datetime(1970, 1, 1, tzinfo=UTC)


class WatchdogQueries(StoreBase):
    """The watchdog's rule, its counts and its turns."""

    @asynccontextmanager
    async def watchdog_turn(self, provider: str, *, by: str, unless_within: float | None = None) -> AsyncIterator[bool]:
        """Whether the caller looks for the provider's silent machines now: False when another look ended less than
        unless_within seconds ago (by BMDB's clock); with None, it looks whatever the last look was.

        Looks of one provider never overlap, whichever worker or fleet pass makes them: a look holds the lock of the
        provider's row until it ends (a row lock, not an advisory one, so the schema keeps to what CockroachDB's
        dialect has), and a look that ends without an error is recorded as the provider's last, with by (the
        process that made it).
        """
        async with self.engine.connect() as conn, conn.begin():
            # A provider's first look makes its row, with a time that counts as long ago.
            await conn.execute(
                pg_insert(watchdog_looks)
                .values(provider=provider, looked_at=_NEVER, looked_by="")
                .on_conflict_do_nothing(index_elements=[watchdog_looks.c.provider])
            )
            last = (
                await conn.execute(
                    select(watchdog_looks.c.looked_at, func.clock_timestamp().label("now"))
                    .where(watchdog_looks.c.provider == provider)
                    .with_for_update()
                )
            ).one()
            if unless_within is not None and last.looked_at > last.now - timedelta(seconds=unless_within):
                yield False
                return
            yield True
            await conn.execute(
                update(watchdog_looks)
                .where(watchdog_looks.c.provider == provider)
                .values(looked_at=func.clock_timestamp(), looked_by=by)
            )

    async def watchdog_looks(self) -> list[WatchdogLook]:
        """The last look of every provider the watchdog has looked at, by provider."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(watchdog_looks).where(watchdog_looks.c.looked_by != "").order_by(watchdog_looks.c.provider)
            )
            return [WatchdogLook(r.provider, r.looked_at, r.looked_by) for r in rows]

    async def silent_machines(
        self,
        provider: str,
        *,
        as_of: datetime,
        first_heartbeat_within: float,
        heartbeat_within: float,
        machine_id: uuid.UUID | None = None,
    ) -> list[SilentMachine]:
        """Machines whose agent needs recovery, in one set-based query (the seed's rule); with machine_id, that
        machine alone, as a recovery confirms the silence it was asked for.

        Silent: the agent started more than first_heartbeat_within seconds
        before as_of and never sent a heartbeat, or its last heartbeat is more
        than heartbeat_within seconds old.
        """
        never = machine_agent_heartbeat.c.machine_id.is_(None) & (
            machine_agent_started.c.agent_started_at < as_of - timedelta(seconds=first_heartbeat_within)
        )
        stopped = machine_agent_heartbeat.c.agent_heartbeat_at < as_of - timedelta(seconds=heartbeat_within)
        query = (
            select(
                machine_provided.c.machine_id,
                machine_provided.c.provider_id,
                machine_agent_started.c.agent_started_at,
                machine_agent_started.c.agent_public_key,
                machine_agent_heartbeat.c.agent_heartbeat_at,
                silence_signals.c.signalled_at,
                silence_signals.c.confirmed_at,
            )
            .select_from(
                machine_provided.join(
                    machine_agent_started, machine_agent_started.c.machine_id == machine_provided.c.machine_id
                )
                .outerjoin(
                    machine_agent_heartbeat, machine_agent_heartbeat.c.machine_id == machine_provided.c.machine_id
                )
                .outerjoin(
                    silence_signals,
                    (silence_signals.c.machine_id == machine_provided.c.machine_id)
                    & (silence_signals.c.agent_started_at == machine_agent_started.c.agent_started_at),
                )
            )
            .where(*_watched(provider), or_(never, stopped))
            .order_by(machine_provided.c.provider_id)
        )
        if machine_id is not None:
            query = query.where(machine_provided.c.machine_id == machine_id)
        async with self.engine.connect() as conn:
            return [
                SilentMachine(
                    r.machine_id,
                    r.provider_id,
                    r.agent_started_at,
                    r.agent_heartbeat_at,
                    bytes(r.agent_public_key),
                    r.signalled_at,
                    r.confirmed_at,
                )
                for r in await conn.execute(query)
            ]

    async def watched_machines(self, provider: str) -> WatchedMachines:
        """How many of the provider's machines have an agent to watch, when BMDB last accepted a heartbeat, and
        when the provider's last hold of recoveries ended."""
        watched = (
            select(func.count())
            .select_from(
                machine_provided.join(
                    machine_agent_started, machine_agent_started.c.machine_id == machine_provided.c.machine_id
                )
            )
            .where(*_watched(provider))
        )
        hold = select(recovery_holds.c.ended_at).where(recovery_holds.c.provider == provider)
        async with self.engine.connect() as conn:
            count = int(await conn.scalar(watched) or 0)
            newest = await conn.scalar(select(func.max(machine_agent_heartbeat.c.agent_heartbeat_at)))
            row = (await conn.execute(hold)).first()
            ended = None if row is None else row.ended_at
            return WatchedMachines(count, newest, row is not None and ended is None, ended)

    async def record_silence_signalled(self, machines: Sequence[SilentMachine]) -> None:
        """Note that the watchdog signalled these silent agents' machines now, in one statement."""
        if machines:
            now = func.clock_timestamp()
            told = [
                {"machine_id": m.machine_id, "agent_started_at": m.agent_started_at, "signalled_at": now}
                for m in machines
            ]
            await self._note_silences(told, confirming=False)

    async def record_silence_confirmed(self, machine: SilentMachine) -> None:
        """Note that the machine's workflow confirmed its agent's silence now, as its recovery began: the watchdog
        then leaves it to that recovery."""
        now = func.clock_timestamp()
        confirmed = {
            "machine_id": machine.machine_id,
            "agent_started_at": machine.agent_started_at,
            "signalled_at": now,
            "confirmed_at": now,
        }
        await self._note_silences([confirmed], confirming=True)

    async def _note_silences(self, rows: list[dict[str, Any]], *, confirming: bool) -> None:
        """Write rows of silence_signals, one a machine; confirming: they set confirmed_at, else it is kept for the
        same agent."""
        statement = pg_insert(silence_signals).values(rows)
        excluded = statement.excluded
        same_agent = silence_signals.c.agent_started_at == excluded.agent_started_at
        # A confirmation was of the agent it named; a new agent's silence is unconfirmed.
        kept = case((same_agent, silence_signals.c.confirmed_at), else_=None)
        async with self.engine.begin() as conn:
            await conn.execute(
                statement.on_conflict_do_update(
                    index_elements=[silence_signals.c.machine_id],
                    set_={
                        "agent_started_at": excluded.agent_started_at,
                        "signalled_at": excluded.signalled_at,
                        "confirmed_at": excluded.confirmed_at if confirming else kept,
                    },
                )
            )

    async def forget_silence_signalled(self, machine_id: uuid.UUID) -> None:
        """The machine's recovery did not go ahead (its silence was not confirmed): its next silence is news."""
        async with self.engine.begin() as conn:
            await conn.execute(delete(silence_signals).where(silence_signals.c.machine_id == machine_id))

    async def record_heartbeats_lost(self, machines: Sequence[SilentMachine]) -> int:
        """A ``heartbeat_lost`` event for each machine, once per agent: a machine the watchdog finds silent again
        in the next pass, before its recovery, gets none. Returns how many were written."""
        written = 0
        async with self.engine.begin() as conn:
            for machine in machines:
                logged = (
                    select(events.c.event_id)
                    .where(
                        events.c.machine_id == machine.machine_id,
                        events.c.kind == "heartbeat_lost",
                        events.c.at >= machine.agent_started_at,
                    )
                    .exists()
                )
                row = select(
                    literal(machine.machine_id, UUID(as_uuid=True)),
                    literal("heartbeat_lost"),
                    literal(f"{machine.cause()}: the watchdog asks for a recovery"),
                ).where(~logged)
                inserted = await conn.execute(
                    insert(events).from_select(["machine_id", "kind", "detail"], row).returning(events.c.event_id)
                )
                written += len(inserted.all())
        return written


def _watched(provider: str) -> tuple[Any, ...]:
    """The watchdog's rule of which of the provider's machines it watches: those with an agent started (the
    queries join it), except a machine its provider no longer lists (it cannot be rebooted through it: it is
    reported, not recovered), a quarantined one (it waits for an operator; its silence is known and counts for no
    hold), one in maintenance, and a retired one."""
    return (
        machine_provided.c.provider == provider,
        machine_provided.c.missing_since.is_(None),
        machine_provided.c.quarantined_since.is_(None),
        machine_provided.c.maintenance_since.is_(None),
        machine_provided.c.retired_at.is_(None),
    )
