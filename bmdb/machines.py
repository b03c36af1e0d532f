"""The machines BMDB holds: their admission before the provider creates them, what the provider says of them, and
the records the commands and the fleet read."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import String, cast, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from bmdb.base import StoreBase
from bmdb.records import MachineRecord, ProvidedMachine
from bmdb.schema import (
    PROVIDED_STATUS_CREATING,
    PROVIDED_STATUS_PROVIDED,
    events,
    machine_agent_heartbeat,
    machine_agent_started,
    machine_provided,
    machines,
)


class MachineRecords(StoreBase):
    """Machine admission, provider state and the machine records."""

    async def admit_machine(self, provider: str, provider_id: str) -> tuple[uuid.UUID, bool]:
        """Record that Shepherd is about to bring (provider, provider_id) under management.

        Returns the machine id and whether this call created the record; a
        second call for the same machine returns the first call's id.
        """
        async with self.engine.begin() as conn:
            existing = await self._machine_id_for(conn, provider, provider_id)
            if existing is not None:
                return existing, False
            machine_id = uuid.uuid4()
            await conn.execute(insert(machines).values(machine_id=machine_id))
            inserted = await conn.execute(
                pg_insert(machine_provided)
                .values(
                    machine_id=machine_id, provider=provider, provider_id=provider_id, status=PROVIDED_STATUS_CREATING
                )
                .on_conflict_do_nothing(constraint="machine_provided_provider_key")
                .returning(machine_provided.c.machine_id)
            )
            if inserted.first() is None:
                # Another admission won the race; drop our machine row with the transaction.
                await conn.rollback()
            else:
                await conn.execute(
                    insert(events).values(
                        machine_id=machine_id,
                        kind="admitted",
                        detail=f"{provider} machine {provider_id} taken under management",
                    )
                )
                return machine_id, True
        async with self.engine.connect() as conn:
            existing = await self._machine_id_for(conn, provider, provider_id)
        if existing is None:
            raise RuntimeError(f"admission of {provider}/{provider_id} lost a race and found no record")
        return existing, False

    @staticmethod
    async def _machine_id_for(conn: Any, provider: str, provider_id: str) -> uuid.UUID | None:
        row = (
            await conn.execute(
                select(machine_provided.c.machine_id).where(
                    machine_provided.c.provider == provider, machine_provided.c.provider_id == provider_id
                )
            )
        ).first()
        return None if row is None else row.machine_id

    async def record_provided(
        self, machine_id: uuid.UUID, *, address: str | None, ssh_port: int | None, location: str | None
    ) -> bool:
        """Mark the machine as created by its provider; True the first time, which is logged."""
        async with self.engine.begin() as conn:
            previous = (
                await conn.execute(
                    select(machine_provided.c.status, machine_provided.c.provider, machine_provided.c.provider_id)
                    .where(machine_provided.c.machine_id == machine_id)
                    .with_for_update()
                )
            ).first()
            if previous is None:
                raise KeyError(f"BMDB has no provided record for machine {machine_id}")
            await conn.execute(
                update(machine_provided)
                .where(machine_provided.c.machine_id == machine_id)
                .values(
                    status=PROVIDED_STATUS_PROVIDED,
                    address=address,
                    ssh_port=ssh_port,
                    location=location,
                    updated_at=func.now(),
                )
            )
            first_time = previous.status != PROVIDED_STATUS_PROVIDED
            if first_time:
                await conn.execute(
                    insert(events).values(
                        machine_id=machine_id,
                        kind="provided",
                        detail=f"{previous.provider} created {previous.provider_id} at {address}:{ssh_port}"
                        f" in {location or 'an unknown location'}",
                    )
                )
            return first_time

    async def list_provided(self, provider: str) -> list[ProvidedMachine]:
        """Every machine BMDB has of that provider, by provider id, missing and retired ones too."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(
                    machine_provided.c.machine_id,
                    machine_provided.c.provider,
                    machine_provided.c.provider_id,
                    machine_provided.c.status,
                    machine_provided.c.missing_since,
                    machine_provided.c.retired_at,
                )
                .where(machine_provided.c.provider == provider)
                .order_by(machine_provided.c.provider_id)
            )
            return [
                ProvidedMachine(
                    r.machine_id,
                    r.provider,
                    r.provider_id,
                    r.status,
                    missing=r.missing_since is not None,
                    retired=r.retired_at is not None,
                )
                for r in rows
            ]

    async def record_provider_listing(
        self, provider: str, missing: Sequence[str], back: Sequence[str]
    ) -> tuple[list[str], list[str]]:
        """Mark the provider's machines it no longer lists, unmark those it lists again, with an event each change.

        Returns (newly missing, back again); a machine already marked is neither, so a pass repeats nothing.
        """
        changes: tuple[list[str], list[str]] = ([], [])
        async with self.engine.begin() as conn:
            for provider_ids, marking, kind, said in (
                (missing, True, "missing_at_provider", "no longer lists it"),
                (back, False, "back_at_provider", "lists it again"),
            ):
                if not provider_ids:
                    continue
                rows = await conn.execute(
                    update(machine_provided)
                    .where(
                        machine_provided.c.provider == provider,
                        machine_provided.c.provider_id.in_(list(provider_ids)),
                        machine_provided.c.missing_since.is_(None)
                        if marking
                        else machine_provided.c.missing_since.is_not(None),
                    )
                    .values(missing_since=func.now() if marking else None, updated_at=func.now())
                    .returning(machine_provided.c.machine_id, machine_provided.c.provider_id)
                )
                changed = rows.all()
                for row in changed:
                    await conn.execute(
                        insert(events).values(
                            machine_id=row.machine_id, kind=kind, detail=f"provider {provider} {said}"
                        )
                    )
                (changes[0] if marking else changes[1]).extend(sorted(row.provider_id for row in changed))
        return changes

    async def get_machine(self, machine_id: uuid.UUID) -> MachineRecord | None:
        """The machine's record with its agent's start and last heartbeat, or None when BMDB has none."""
        rows = await self._machine_records(machine_provided.c.machine_id == machine_id)
        return rows[0] if rows else None

    async def list_machines(self) -> list[MachineRecord]:
        """Every machine's record with its agent's start and last heartbeat, by provider and provider id."""
        return await self._machine_records(None)

    async def machines_with_provider_id(self, provider_id: str) -> list[MachineRecord]:
        """Every provider's machine of that id (one, unless two providers reuse ids)."""
        return await self._machine_records(machine_provided.c.provider_id == provider_id)

    async def machines_with_id_prefix(self, prefix: str, limit: int) -> list[MachineRecord]:
        """Machines whose id, as text, starts with prefix: at most limit of them."""
        return await self._machine_records(
            cast(machine_provided.c.machine_id, String).startswith(prefix, autoescape=True), limit=limit
        )

    async def _machine_records(self, condition: Any, limit: int | None = None) -> list[MachineRecord]:
        query = (
            select(
                machine_provided,
                machine_agent_started.c.agent_started_at,
                machine_agent_started.c.agent_public_key,
                machine_agent_heartbeat.c.agent_heartbeat_at,
            )
            .select_from(
                machine_provided.outerjoin(
                    machine_agent_started, machine_agent_started.c.machine_id == machine_provided.c.machine_id
                ).outerjoin(
                    machine_agent_heartbeat, machine_agent_heartbeat.c.machine_id == machine_provided.c.machine_id
                )
            )
            .order_by(machine_provided.c.provider, machine_provided.c.provider_id)
        )
        if condition is not None:
            query = query.where(condition)
        if limit is not None:
            query = query.limit(limit)
        async with self.engine.connect() as conn:
            return [
                MachineRecord(
                    machine_id=r.machine_id,
                    provider=r.provider,
                    provider_id=r.provider_id,
                    status=r.status,
                    address=r.address,
                    ssh_port=r.ssh_port,
                    location=r.location,
                    ssh_host_key=r.ssh_host_key,
                    agent_started_at=r.agent_started_at,
                    agent_public_key=r.agent_public_key,
                    agent_heartbeat_at=r.agent_heartbeat_at,
                    missing_since=r.missing_since,
                    stuck_since=r.stuck_since,
                    retired_at=r.retired_at,
                    retired_reason=r.retired_reason,
                    expected_host_key_fingerprint=r.expected_host_key_fingerprint,
                )
                for r in await conn.execute(query)
            ]

    async def count_by_status(self) -> dict[str, int]:
        """Machines by provided status, and as agent_started and heartbeating those with an agent start, a heartbeat."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(machine_provided.c.status, func.count()).group_by(machine_provided.c.status)
            )
            counts: dict[str, int] = {str(status): int(n) for status, n in rows}
            started = await conn.scalar(select(func.count()).select_from(machine_agent_started))
            counts["agent_started"] = int(started or 0)
            heartbeating = await conn.scalar(select(func.count()).select_from(machine_agent_heartbeat))
            counts["heartbeating"] = int(heartbeating or 0)
            return counts
