"""The machines' agents and SSH host keys: the key pinned at first contact, the agent each takeover starts, and
its end at a reboot or a decommission."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from bmdb.base import StoreBase
from bmdb.records import HostKeyPinned, HostKeyUnexpected
from bmdb.schema import (
    events,
    machine_agent_heartbeat,
    machine_agent_started,
    machine_provided,
    reboot_asks,
    recovery_reboots,
)
from foundation.ssh_sessions import host_key_fingerprint


class AgentRecords(StoreBase):
    """Host-key pins, agents and reboots."""

    async def pin_host_key(self, machine_id: uuid.UUID, host_key: str) -> None:
        """Pin the host key an SSH server showed at first contact, logging a host_key_pinned event naming its
        fingerprint; HostKeyPinned when another one is pinned, HostKeyUnexpected when an operator said to expect
        another fingerprint.

        Called at the handshake, before anything is sent: two takeovers that race to a first contact and meet
        different servers cannot both pass.
        """
        async with self.engine.begin() as conn:
            await self._pin(conn, machine_id, host_key)

    @staticmethod
    async def _pin(conn: Any, machine_id: uuid.UUID, host_key: str) -> None:
        fingerprint = host_key_fingerprint(host_key)
        expected = machine_provided.c.expected_host_key_fingerprint
        # The expectation is checked in the statement that pins: a reset that sets one after the takeover read
        # the record cannot be passed by the key it reads.
        pinned = await conn.execute(
            update(machine_provided)
            .where(
                machine_provided.c.machine_id == machine_id,
                machine_provided.c.ssh_host_key.is_(None),
                or_(expected.is_(None), expected == fingerprint),
            )
            .values(ssh_host_key=host_key, expected_host_key_fingerprint=None)
        )
        if pinned.rowcount == 1:
            detail = f"host key {fingerprint} pinned at first contact"
            await conn.execute(insert(events).values(machine_id=machine_id, kind="host_key_pinned", detail=detail))
            return
        row = (
            await conn.execute(
                select(machine_provided.c.ssh_host_key, expected).where(machine_provided.c.machine_id == machine_id)
            )
        ).first()
        if row is None:
            raise KeyError(f"BMDB has no provided record for machine {machine_id}")
        if row.ssh_host_key is None:
            raise HostKeyUnexpected(machine_id, row.expected_host_key_fingerprint, fingerprint)
        if row.ssh_host_key != host_key:
            raise HostKeyPinned(machine_id, row.ssh_host_key)

    async def reset_host_key(
        self, machine_id: uuid.UUID, pinned: str | None, detail: str, *, expected: str | None = None
    ) -> bool:
        """Forget the pinned SSH host key, if it still is `pinned` (None: none pinned), logging a host_key_reset
        event with detail; with expected, the next key pinned must have that SHA256 fingerprint, in the same
        statement, so no takeover pins another in between.

        False when the pin changed meanwhile: the operator reset a key they did not see.
        """
        async with self.engine.begin() as conn:
            result = await conn.execute(
                update(machine_provided)
                .where(
                    machine_provided.c.machine_id == machine_id,
                    machine_provided.c.ssh_host_key.is_not_distinct_from(pinned),
                )
                .values(ssh_host_key=None, expected_host_key_fingerprint=expected)
            )
            if result.rowcount == 0:
                return False
            await conn.execute(insert(events).values(machine_id=machine_id, kind="host_key_reset", detail=detail))
            return True

    async def record_agent_started(self, machine_id: uuid.UUID, started_at: datetime, public_key: bytes) -> None:
        """Record that the machine's agent started at started_at with that public key, replacing the last one's."""
        async with self.engine.begin() as conn:
            await conn.execute(_agent_started(machine_id, started_at, public_key))

    async def record_takeover(
        self, machine_id: uuid.UUID, started_at: datetime, public_key: bytes, host_key: str, detail: str
    ) -> None:
        """Record a takeover in one transaction: the host key pinned unless one is, the agent, an agent_started event.

        HostKeyPinned, and nothing recorded, when another host key is pinned: a takeover that raced another to
        a different server is refused; HostKeyUnexpected likewise when an operator reset the pin meanwhile and
        expects another fingerprint. One transaction, so an activity that dies on the way leaves all or
        nothing, and its retry, which finds the agent recorded, loses no event. An agent it replaces without a
        reboot (restart_agent) takes its heartbeats along: the watchdog then waits for the new agent's first.
        """
        async with self.engine.begin() as conn:
            await self._pin(conn, machine_id, host_key)
            heartbeats = machine_agent_heartbeat.c.machine_id == machine_id
            await conn.execute(delete(machine_agent_heartbeat).where(heartbeats))
            await conn.execute(_agent_started(machine_id, started_at, public_key))
            await conn.execute(insert(events).values(machine_id=machine_id, kind="agent_started", detail=detail))

    async def agent_public_key(self, machine_id: uuid.UUID) -> bytes | None:
        """The key the machine's running agent reported at takeover, if an agent runs."""
        async with self.engine.connect() as conn:
            key = await conn.scalar(
                select(machine_agent_started.c.agent_public_key).where(machine_agent_started.c.machine_id == machine_id)
            )
            return None if key is None else bytes(key)

    async def agent_public_keys(self, limit: int) -> dict[uuid.UUID, bytes]:
        """The keys of running agents, at most `limit`, those heartbeating most recently first."""
        query = (
            select(machine_agent_started.c.machine_id, machine_agent_started.c.agent_public_key)
            .outerjoin(
                machine_agent_heartbeat, machine_agent_heartbeat.c.machine_id == machine_agent_started.c.machine_id
            )
            .order_by(machine_agent_heartbeat.c.agent_heartbeat_at.desc().nulls_last())
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            return {machine_id: bytes(key) for machine_id, key in await conn.execute(query)}

    async def agent_alive(self, machine_id: uuid.UUID, within: float) -> bool:
        """Whether the machine's agent has had a heartbeat accepted within the last `within` seconds."""
        query = select(machine_agent_heartbeat.c.agent_heartbeat_at).where(
            machine_agent_heartbeat.c.machine_id == machine_id,
            machine_agent_heartbeat.c.agent_heartbeat_at >= func.now() - timedelta(seconds=within),
        )
        async with self.engine.connect() as conn:
            return await conn.scalar(query) is not None

    async def forget_agent(self, machine_id: uuid.UUID, cause: str) -> None:
        """Delete the agent-started and heartbeat records after a reboot, logging the cause."""
        async with self.engine.begin() as conn:
            await _forget_rebooted_agent(conn, machine_id, cause)

    async def forget_silent_agent(self, machine_id: uuid.UUID, detail: str, *, kind: str = "agent_forgotten") -> bool:
        """Forget the machine's agent, so the next takeover starts a new one without a reboot, or none at all (a
        decommission); with an event of kind. False if it had none."""
        async with self.engine.begin() as conn:
            if not await forget_agent_records(conn, machine_id):
                return False
            await conn.execute(insert(events).values(machine_id=machine_id, kind=kind, detail=detail))
            return True

    async def record_reboot(self, machine_id: uuid.UUID, cycle: str, cause: str, *, reimaged: bool = False) -> bool:
        """Record the recovery cycle's reboot and forget the machine's agent, in one transaction; a reimage forgets
        its pinned SSH host key too, since the new OS has a new one, and is logged as reimaged.

        False when the cycle's reboot was recorded before (a retry whose first answer was lost): nothing changes.
        """
        async with self.engine.begin() as conn:
            recorded = await conn.execute(
                pg_insert(recovery_reboots)
                .values(machine_id=machine_id, cycle=cycle, cause=cause)
                .on_conflict_do_nothing()
                .returning(recovery_reboots.c.cycle)
            )
            if recorded.first() is None:
                return False
            await _forget_reboot_ask(conn, machine_id, cycle)
            if reimaged:
                # The one case where Shepherd lets go of a pin by itself: the next takeover pins the new OS's key.
                # An operator's expected fingerprint goes too: it named a key the new OS no longer has.
                await conn.execute(
                    update(machine_provided)
                    .where(machine_provided.c.machine_id == machine_id)
                    .values(ssh_host_key=None, expected_host_key_fingerprint=None)
                )
            await _forget_rebooted_agent(conn, machine_id, cause, "reimaged" if reimaged else "rebooted")
            return True

    async def ask_reboot(self, machine_id: uuid.UUID, cycle: str, at: datetime) -> datetime | None:
        """Note that the recovery cycle asks its provider for the reboot now (at); when an attempt before asked and
        no answer came back (its worker died, or the answer was lost), the time it asked, and nothing changes."""
        async with self.engine.begin() as conn:
            noted = await conn.execute(
                pg_insert(reboot_asks)
                .values(machine_id=machine_id, cycle=cycle, asked_at=at)
                .on_conflict_do_nothing()
                .returning(reboot_asks.c.asked_at)
            )
            if noted.first() is not None:
                return None
            return await conn.scalar(
                select(reboot_asks.c.asked_at).where(
                    reboot_asks.c.machine_id == machine_id, reboot_asks.c.cycle == cycle
                )
            )

    async def reboot_answered(self, machine_id: uuid.UUID, cycle: str) -> None:
        """Forget the cycle's ask: the provider answered it (an error, so a retry asks again as for the first time)."""
        async with self.engine.begin() as conn:
            await _forget_reboot_ask(conn, machine_id, cycle)

    async def reboot_recorded(self, machine_id: uuid.UUID, cycle: str) -> bool:
        """Whether the recovery cycle's reboot was done and recorded."""
        query = select(recovery_reboots.c.cycle).where(
            recovery_reboots.c.machine_id == machine_id, recovery_reboots.c.cycle == cycle
        )
        async with self.engine.connect() as conn:
            return await conn.scalar(query) is not None

    async def recovery_counts(self, machine_id: uuid.UUID | None = None) -> dict[uuid.UUID, int]:
        """Machine id -> how many times a recovery rebooted or reimaged it, for machines recovered at least once.

        Of every machine, or only of the one given.
        """
        query = select(events.c.machine_id, func.count()).where(
            events.c.kind.in_(("rebooted", "reimaged")),
            events.c.machine_id.is_not(None) if machine_id is None else events.c.machine_id == machine_id,
        )
        async with self.engine.connect() as conn:
            rows = await conn.execute(query.group_by(events.c.machine_id))
            return {machine_id: int(n) for machine_id, n in rows}


async def _forget_reboot_ask(conn: Any, machine_id: uuid.UUID, cycle: str) -> None:
    await conn.execute(delete(reboot_asks).where(reboot_asks.c.machine_id == machine_id, reboot_asks.c.cycle == cycle))


async def forget_agent_records(conn: Any, machine_id: uuid.UUID) -> bool:
    """Delete the machine's agent-started and heartbeat records; whether it had an agent."""
    await conn.execute(delete(machine_agent_heartbeat).where(machine_agent_heartbeat.c.machine_id == machine_id))
    forgotten = await conn.execute(
        delete(machine_agent_started)
        .where(machine_agent_started.c.machine_id == machine_id)
        .returning(machine_agent_started.c.machine_id)
    )
    return forgotten.first() is not None


async def _forget_rebooted_agent(conn: Any, machine_id: uuid.UUID, cause: str, kind: str = "rebooted") -> None:
    await forget_agent_records(conn, machine_id)
    await conn.execute(insert(events).values(machine_id=machine_id, kind=kind, detail=cause))


def _agent_started(machine_id: uuid.UUID, started_at: datetime, public_key: bytes) -> Any:
    statement = pg_insert(machine_agent_started).values(
        machine_id=machine_id, agent_started_at=started_at, agent_public_key=public_key
    )
    return statement.on_conflict_do_update(
        index_elements=[machine_agent_started.c.machine_id],
        set_={
            "agent_started_at": statement.excluded.agent_started_at,
            "agent_public_key": statement.excluded.agent_public_key,
        },
    )
