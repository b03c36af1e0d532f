"""What an operator must see of a machine, as marks with a time: quarantined, stuck, in maintenance, retired."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, insert, select, update

from bmdb.agents import forget_agent_records
from bmdb.base import StoreBase
from bmdb.schema import events, machine_provided


class MachineMarks(StoreBase):
    """Setting and clearing a machine's marks, each with an event."""

    async def set_quarantined(self, machine_id: uuid.UUID, quarantined: bool, detail: str) -> bool:
        """Mark the machine quarantined (event ``quarantined``) or released (``released``); False if it was already."""
        kind = "quarantined" if quarantined else "released"
        return await self._mark(machine_provided.c.quarantined_since, machine_id, quarantined, kind, detail)

    async def set_stuck(self, machine_id: uuid.UUID, stuck: bool, detail: str) -> bool:
        """Flag the machine stuck (event ``stuck``) or clear the flag (``unstuck``); False if it was already."""
        return await self._mark(
            machine_provided.c.stuck_since, machine_id, stuck, "stuck" if stuck else "unstuck", detail
        )

    async def set_maintenance(self, machine_id: uuid.UUID, on: bool, detail: str) -> bool:
        """Mark the machine in maintenance (event ``maintenance_on``) or out of it (``maintenance_off``)."""
        kind = "maintenance_on" if on else "maintenance_off"
        return await self._mark(machine_provided.c.maintenance_since, machine_id, on, kind, detail)

    async def _mark(self, column: Any, machine_id: uuid.UUID, on: bool, kind: str, detail: str) -> bool:
        """Set a since-column of the machine to now (on) or clear it, with an event; False if it was so already."""
        not_yet = column.is_(None) if on else column.is_not(None)
        async with self.engine.begin() as conn:
            changed = await conn.execute(
                update(machine_provided)
                .where(machine_provided.c.machine_id == machine_id, not_yet)
                .values({column.name: func.now() if on else None, "updated_at": func.now()})
                .returning(machine_provided.c.machine_id)
            )
            if changed.first() is None:
                return False
            await conn.execute(insert(events).values(machine_id=machine_id, kind=kind, detail=detail))
            return True

    async def retire(self, machine_id: uuid.UUID, reason: str) -> bool:
        """Mark the machine retired (event ``decommissioned``), clear its other marks and forget its agent, in one
        transaction; False when it was retired already, which changes nothing."""
        async with self.engine.begin() as conn:
            retired = await conn.execute(
                update(machine_provided)
                .where(machine_provided.c.machine_id == machine_id, machine_provided.c.retired_at.is_(None))
                .values(
                    retired_at=func.now(),
                    retired_reason=reason,
                    maintenance_since=None,
                    quarantined_since=None,
                    stuck_since=None,
                    updated_at=func.now(),
                )
                .returning(machine_provided.c.machine_id)
            )
            if retired.first() is None:
                return False
            await forget_agent_records(conn, machine_id)
            await conn.execute(insert(events).values(machine_id=machine_id, kind="decommissioned", detail=reason))
            return True

    async def count_stuck(self) -> dict[str, int]:
        """Provider -> machines flagged stuck, for every provider that has one."""
        query = (
            select(machine_provided.c.provider, func.count())
            .where(machine_provided.c.stuck_since.is_not(None))
            .group_by(machine_provided.c.provider)
        )
        async with self.engine.connect() as conn:
            return {str(provider): int(n) for provider, n in await conn.execute(query)}
