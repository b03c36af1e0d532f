"""Recovery holds: a provider whose recoveries the watchdog's circuit breaker holds, and an operator's release."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update

from bmdb.base import StoreBase
from bmdb.records import HeldRecoveries
from bmdb.schema import events, recovery_holds


class RecoveryHolds(StoreBase):
    """Holding, releasing and ending a provider's recoveries."""

    async def hold_recoveries(
        self, provider: str, *, reason: str, silent_count: int, threshold: int, sample: Sequence[str]
    ) -> tuple[HeldRecoveries, bool]:
        """Hold the provider's recoveries, or bring a standing hold's numbers up to date; True when newly held.

        A new hold is a ``recoveries_held`` fleet event; a standing one keeps its start and its release.
        """
        values = {"reason": reason, "silent_count": silent_count, "threshold": threshold, "sample": ", ".join(sample)}
        fresh = {"held_since": func.now(), "released_at": None, "released_by": None, "release_reason": None}
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    select(recovery_holds).where(recovery_holds.c.provider == provider).with_for_update()
                )
            ).first()
            began = row is None or row.ended_at is not None
            if row is None:
                statement: Any = insert(recovery_holds).values(provider=provider, **fresh, **values)
            else:
                # An ended hold's row is where the next one begins.
                statement = (
                    update(recovery_holds)
                    .where(recovery_holds.c.provider == provider)
                    .values(updated_at=func.now(), **values, **({**fresh, "ended_at": None} if began else {}))
                )
            if began:
                detail = f"provider {provider}: {reason}; silent: {values['sample']}"
                await conn.execute(insert(events).values(machine_id=None, kind="recoveries_held", detail=detail))
            row = (await conn.execute(statement.returning(*recovery_holds.c))).one()
            return _held(row), began

    async def release_recoveries(self, provider: str, *, by: str, reason: str) -> tuple[HeldRecoveries | None, bool]:
        """An operator lets the held recoveries go ahead until the silence ends: (the hold, True when released now).

        (None, False) when the provider's recoveries are not held; an earlier release is kept as it was.
        """
        standing = (recovery_holds.c.provider == provider, recovery_holds.c.ended_at.is_(None))
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    update(recovery_holds)
                    .where(*standing, recovery_holds.c.released_at.is_(None))
                    .values(released_at=func.now(), released_by=by, release_reason=reason, updated_at=func.now())
                    .returning(*recovery_holds.c)
                )
            ).first()
            if row is not None:
                detail = f"provider {provider}: held recoveries released by {by}: {reason}"
                await conn.execute(insert(events).values(machine_id=None, kind="recoveries_released", detail=detail))
                return _held(row), True
            row = (await conn.execute(select(recovery_holds).where(*standing))).first()
            return (None if row is None else _held(row)), False

    async def end_recovery_hold(self, provider: str, detail: str) -> HeldRecoveries | None:
        """The silence is over: end the provider's hold with a ``recoveries_resumed`` event; the hold there was.

        The row stays with its end, which the watchdog's grace after a hold counts from.
        """
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    update(recovery_holds)
                    .where(recovery_holds.c.provider == provider, recovery_holds.c.ended_at.is_(None))
                    .values(ended_at=func.now(), updated_at=func.now())
                    .returning(*recovery_holds.c)
                )
            ).first()
            if row is not None:
                await conn.execute(
                    insert(events).values(
                        machine_id=None, kind="recoveries_resumed", detail=f"provider {provider}: {detail}"
                    )
                )
            return None if row is None else _held(row)

    async def recovery_hold_state(self, provider: str) -> tuple[bool, datetime | None]:
        """Whether the provider's recoveries are held now and not released by an operator; else when its last hold
        ended (None: there was none, or it still stands, released)."""
        query = select(recovery_holds.c.ended_at, recovery_holds.c.released_at).where(
            recovery_holds.c.provider == provider
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        if row is None:
            return False, None
        return row.ended_at is None and row.released_at is None, row.ended_at

    async def held_recoveries(self) -> list[HeldRecoveries]:
        """Every provider whose recoveries are held now, by provider name."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(recovery_holds).where(recovery_holds.c.ended_at.is_(None)).order_by(recovery_holds.c.provider)
            )
            return [_held(row) for row in rows]


def _held(row: Any) -> HeldRecoveries:
    return HeldRecoveries(
        provider=row.provider,
        held_since=row.held_since,
        reason=row.reason,
        silent_count=row.silent_count,
        threshold=row.threshold,
        sample=[p for p in row.sample.split(", ") if p],
        released_at=row.released_at,
        released_by=row.released_by,
        release_reason=row.release_reason,
    )
