"""BMDB access: every query Shepherd runs against the machine database.

Writes are upserts on natural keys, so an activity that runs twice leaves the
same rows as one that ran once. Listing queries are single set-based
statements: the fleet scale is 100,000 machines.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import String, cast, delete, func, insert, literal, or_, select, update
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bmdb.connection_errors import connection_failure, libpq_url
from bmdb.schema import (
    PROVIDED_STATUS_CREATING,
    PROVIDED_STATUS_PROVIDED,
    events,
    machine_agent_heartbeat,
    machine_agent_started,
    machine_provided,
    machines,
    recovery_holds,
    recovery_reboots,
)


class BMDBUnavailable(Exception):
    """BMDB could not be reached or refused the connection."""


class HostKeyPinned(Exception):
    """The machine has another SSH host key pinned than the one its SSH server showed; nothing was recorded."""

    def __init__(self, machine_id: uuid.UUID, pinned: str) -> None:
        super().__init__(f"machine {machine_id} has another host key pinned")
        self.pinned = pinned


@dataclass(frozen=True)
class Heartbeat:
    """One agent heartbeat to record: whose, signed by which agent key, sent when by the agent's clock."""

    machine_id: uuid.UUID
    agent_public_key: bytes
    sent_at: datetime


class HeartbeatsNotRecorded(Exception):
    """BMDB failed while writing heartbeats; none of the statement's heartbeats was recorded."""


# The conditional upsert of each heartbeat, over arrays: only a row whose agent key still matches is written, and
# only if it is newer. Plain SQL, prepared once on the heartbeat connection: it runs thousands of times a second.
RECORD_HEARTBEATS = """
    INSERT INTO machine_agent_heartbeat AS last (machine_id, agent_heartbeat_at, agent_sent_at)
    SELECT incoming.machine_id, now(), incoming.sent_at
    FROM unnest(%(machine_ids)s::uuid[], %(keys)s::bytea[], %(sent_at)s::timestamptz[])
        AS incoming (machine_id, agent_public_key, sent_at)
    JOIN machine_agent_started AS started
        ON started.machine_id = incoming.machine_id AND started.agent_public_key = incoming.agent_public_key
    ORDER BY incoming.machine_id
    ON CONFLICT (machine_id) DO UPDATE SET agent_heartbeat_at = now(), agent_sent_at = excluded.agent_sent_at
        WHERE last.agent_sent_at IS NULL OR last.agent_sent_at < excluded.agent_sent_at
    RETURNING last.machine_id
"""
# Seconds to wait for the heartbeat connection to open before a heartbeat is answered "unavailable".
HEARTBEAT_CONNECT_TIMEOUT = 10


@dataclass(frozen=True)
class ProvidedMachine:
    """A machine as BMDB knows it: who provides it and how far it got."""

    machine_id: uuid.UUID
    provider: str
    provider_id: str
    status: str
    # Marked when the provider stopped listing it (see record_provider_listing).
    missing: bool = False
    # Decommissioned: never adopted, started or watched again.
    retired: bool = False


@dataclass(frozen=True)
class MachineRecord:
    """One managed machine as BMDB has it: where it is, its pinned host key, its agent and its last heartbeat."""

    machine_id: uuid.UUID
    provider: str
    provider_id: str
    status: str
    address: str | None
    ssh_port: int | None
    location: str | None
    ssh_host_key: str | None
    agent_started_at: datetime | None
    agent_public_key: bytes | None
    agent_heartbeat_at: datetime | None
    # Since when the provider no longer lists it; None while it does.
    missing_since: datetime | None = None
    # Since when its provisioning or agent start has outlasted its deadline; None when not stuck.
    stuck_since: datetime | None = None
    # When it was decommissioned, and why; None while it is managed.
    retired_at: datetime | None = None
    retired_reason: str | None = None


@dataclass(frozen=True)
class SilentMachine:
    """A machine whose agent the watchdog rule finds silent; cause() says why, for the heartbeat_lost signal."""

    machine_id: uuid.UUID
    provider_id: str
    agent_started_at: datetime
    agent_heartbeat_at: datetime | None
    # The silent agent's ed25519 public key: the signal names the agent it is about.
    agent_public_key: bytes = b""

    @property
    def last_seen(self) -> datetime:
        """The agent's last sign of life: its last heartbeat, or its start."""
        return self.agent_heartbeat_at or self.agent_started_at

    def cause(self) -> str:
        if self.agent_heartbeat_at is None:
            return f"no heartbeat since the agent started at {self.agent_started_at.isoformat(timespec='seconds')}"
        return f"last heartbeat at {self.agent_heartbeat_at.isoformat(timespec='seconds')}"


@dataclass(frozen=True)
class WatchedMachines:
    """What the watchdog's circuit breaker weighs a pass's silent machines against."""

    # The provider's machines with an agent started, and still listed by the provider.
    count: int
    # The newest heartbeat accepted from any machine of any provider; None when there is none.
    last_heartbeat_at: datetime | None
    # Whether the provider's recoveries are held now; else when the last hold ended (None: there was none).
    hold_standing: bool = False
    hold_ended_at: datetime | None = None


@dataclass(frozen=True)
class HeldRecoveries:
    """A provider whose recoveries the watchdog holds, as BMDB records it, with the operator's release if any."""

    provider: str
    held_since: datetime
    reason: str
    silent_count: int
    threshold: int
    sample: list[str]
    released_at: datetime | None
    released_by: str | None
    release_reason: str | None


@dataclass(frozen=True)
class Event:
    """One entry of BMDB's event log; machine_id is None for a fleet-wide event."""

    machine_id: uuid.UUID | None
    at: datetime
    kind: str
    detail: str
    # The machine's provider id, where a listing spans machines; None for a fleet-wide event.
    provider_id: str | None = None


# The events that record what an operator asked for, each naming who; and the reboots, whose detail says who
# forced them or why the watchdog did: together they answer "who rebooted node-17 last night".
OPERATOR_ACTION_KINDS = (
    "recovery_forced",
    "retry_asked",
    "host_key_reset",
    "maintenance_on",
    "maintenance_off",
    "released",
    "decommissioning",
    "decommissioned",
    "agent_restart_asked",
    "recoveries_released",
    "fleet_paused",
    "fleet_resumed",
    "fleet_triggered",
    "rebooted",
)


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy URL for a ``postgresql://`` URL, with the psycopg 3 driver."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("postgres://"):
        return "postgresql+psycopg://" + url[len("postgres://") :]
    return url


class BMDB:
    """The machine database. One instance per process; it owns a connection pool."""

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        self.url = url
        # Heartbeats have a connection of their own, outside the pool: in autocommit, a statement is one round trip,
        # with no checkout, ping or transaction block around it.
        self._heartbeat_connection: psycopg.AsyncConnection[Any] | None = None
        self._heartbeat_lock = asyncio.Lock()
        self.engine: AsyncEngine = create_async_engine(
            sqlalchemy_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
        )

    async def close(self) -> None:
        if self._heartbeat_connection is not None:
            await self._heartbeat_connection.close()
            self._heartbeat_connection = None
        await self.engine.dispose()

    async def ping(self) -> None:
        """Raise BMDBUnavailable, naming the URL's host and, for TLS, the cause, when BMDB cannot be reached."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(select(1))
        except (OperationalError, DBAPIError, OSError) as exc:
            raise BMDBUnavailable(connection_failure(self.url, exc)) from exc

    # --- provided machines -------------------------------------------------

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

    async def get_machine(self, machine_id: uuid.UUID) -> MachineRecord | None:
        rows = await self._machine_records(machine_provided.c.machine_id == machine_id)
        return rows[0] if rows else None

    async def list_machines(self) -> list[MachineRecord]:
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
                )
                for r in await conn.execute(query)
            ]

    async def reset_host_key(self, machine_id: uuid.UUID, pinned: str, detail: str) -> bool:
        """Forget the pinned SSH host key, if it still is `pinned`, logging a host_key_reset event with detail.

        False when the pin changed meanwhile: the operator reset a key they did not see.
        """
        async with self.engine.begin() as conn:
            result = await conn.execute(
                update(machine_provided)
                .where(machine_provided.c.machine_id == machine_id, machine_provided.c.ssh_host_key == pinned)
                .values(ssh_host_key=None)
            )
            if result.rowcount == 0:
                return False
            await conn.execute(insert(events).values(machine_id=machine_id, kind="host_key_reset", detail=detail))
            return True

    # --- agent ---------------------------------------------------------------

    async def record_agent_started(self, machine_id: uuid.UUID, started_at: datetime, public_key: bytes) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(_agent_started(machine_id, started_at, public_key))

    async def pin_host_key(self, machine_id: uuid.UUID, host_key: str) -> None:
        """Pin the host key an SSH server showed at first contact; HostKeyPinned when another one is pinned.

        Called at the handshake, before anything is sent: two takeovers that race to a first contact and meet
        different servers cannot both pass.
        """
        async with self.engine.begin() as conn:
            await self._pin(conn, machine_id, host_key)

    @staticmethod
    async def _pin(conn: Any, machine_id: uuid.UUID, host_key: str) -> None:
        await conn.execute(
            update(machine_provided)
            .where(machine_provided.c.machine_id == machine_id, machine_provided.c.ssh_host_key.is_(None))
            .values(ssh_host_key=host_key)
        )
        pinned = await conn.scalar(
            select(machine_provided.c.ssh_host_key).where(machine_provided.c.machine_id == machine_id)
        )
        if pinned is None:
            raise KeyError(f"BMDB has no provided record for machine {machine_id}")
        if pinned != host_key:
            raise HostKeyPinned(machine_id, pinned)

    async def record_takeover(
        self, machine_id: uuid.UUID, started_at: datetime, public_key: bytes, host_key: str, detail: str
    ) -> None:
        """Record a takeover in one transaction: the host key pinned unless one is, the agent, an agent_started event.

        HostKeyPinned, and nothing recorded, when another host key is pinned: a takeover that raced another to
        a different server is refused. One transaction, so an activity that dies on the way leaves all or
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

    async def record_heartbeat(self, machine_id: uuid.UUID, agent_public_key: bytes, sent_at: datetime) -> bool:
        """Record a heartbeat of the agent with this key, unless one sent later was recorded already.

        False means the heartbeat is stale or replayed, or the agent was
        replaced meanwhile.
        """
        return machine_id in await self.record_heartbeats([Heartbeat(machine_id, agent_public_key, sent_at)])

    async def record_heartbeats(self, heartbeats: Sequence[Heartbeat]) -> set[uuid.UUID]:
        """Record many machines' heartbeats in one statement; the machines whose heartbeat was recorded.

        Each is checked on its own, as if alone: the agent must still be the
        one with this key, and sent_at must be newer than the last accepted
        one. A machine may appear once.
        """
        if not heartbeats:
            return set()
        # Rows are locked in machine order, so two statements that share machines cannot deadlock.
        ordered = sorted(heartbeats, key=lambda heartbeat: heartbeat.machine_id)
        parameters = {
            "machine_ids": [heartbeat.machine_id for heartbeat in ordered],
            "keys": [heartbeat.agent_public_key for heartbeat in ordered],
            "sent_at": [heartbeat.sent_at for heartbeat in ordered],
        }
        async with self._heartbeat_lock:
            try:
                if self._heartbeat_connection is None or self._heartbeat_connection.closed:
                    try:
                        self._heartbeat_connection = await psycopg.AsyncConnection.connect(
                            libpq_url(self.url), autocommit=True, connect_timeout=HEARTBEAT_CONNECT_TIMEOUT
                        )
                    except psycopg.Error as error:
                        # Logged by the heartbeat server on one line: the cause, never libpq's several.
                        raise HeartbeatsNotRecorded(
                            f"BMDB failed while recording heartbeats: {connection_failure(self.url, error)}"
                        ) from error
                cursor = await self._heartbeat_connection.execute(RECORD_HEARTBEATS, parameters, prepare=True)
                return {row[0] for row in await cursor.fetchall()}
            except psycopg.Error as error:
                if self._heartbeat_connection is not None and self._heartbeat_connection.broken:
                    await self._heartbeat_connection.close()
                raise HeartbeatsNotRecorded(f"BMDB failed while recording heartbeats: {error}") from error

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

    async def silent_machines(
        self, provider: str, *, as_of: datetime, first_heartbeat_within: float, heartbeat_within: float
    ) -> list[SilentMachine]:
        """Machines whose agent needs recovery, in one set-based query (the seed's rule).

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
            )
            .select_from(
                machine_provided.join(
                    machine_agent_started, machine_agent_started.c.machine_id == machine_provided.c.machine_id
                ).outerjoin(
                    machine_agent_heartbeat, machine_agent_heartbeat.c.machine_id == machine_provided.c.machine_id
                )
            )
            # A machine its provider no longer lists cannot be rebooted through it: it is reported, not recovered.
            # A quarantined machine waits for an operator; its silence is known and counts for no hold.
            .where(
                machine_provided.c.provider == provider,
                machine_provided.c.missing_since.is_(None),
                machine_provided.c.quarantined_since.is_(None),
                machine_provided.c.maintenance_since.is_(None),
                machine_provided.c.retired_at.is_(None),
                or_(never, stopped),
            )
            .order_by(machine_provided.c.provider_id)
        )
        async with self.engine.connect() as conn:
            return [
                SilentMachine(
                    r.machine_id, r.provider_id, r.agent_started_at, r.agent_heartbeat_at, bytes(r.agent_public_key)
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
            .where(
                machine_provided.c.provider == provider,
                machine_provided.c.missing_since.is_(None),
                machine_provided.c.quarantined_since.is_(None),
                machine_provided.c.maintenance_since.is_(None),
                machine_provided.c.retired_at.is_(None),
            )
        )
        hold = select(recovery_holds.c.ended_at).where(recovery_holds.c.provider == provider)
        async with self.engine.connect() as conn:
            count = int(await conn.scalar(watched) or 0)
            newest = await conn.scalar(select(func.max(machine_agent_heartbeat.c.agent_heartbeat_at)))
            row = (await conn.execute(hold)).first()
            ended = None if row is None else row.ended_at
            return WatchedMachines(count, newest, row is not None and ended is None, ended)

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

    async def held_recoveries(self) -> list[HeldRecoveries]:
        """Every provider whose recoveries are held now, by provider name."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(recovery_holds).where(recovery_holds.c.ended_at.is_(None)).order_by(recovery_holds.c.provider)
            )
            return [_held(row) for row in rows]

    async def oldest_heartbeat_age(self) -> float | None:
        """Seconds since the oldest last heartbeat of a running agent; None when no agent has sent one."""
        query = select(func.max(func.extract("epoch", func.now() - machine_agent_heartbeat.c.agent_heartbeat_at)))
        async with self.engine.connect() as conn:
            age = await conn.scalar(query)
            return None if age is None else float(age)

    async def forget_agent(self, machine_id: uuid.UUID, cause: str) -> None:
        """Delete the agent-started and heartbeat records after a reboot, logging the cause."""
        async with self.engine.begin() as conn:
            await _forget_rebooted_agent(conn, machine_id, cause)

    async def record_reboot(self, machine_id: uuid.UUID, cycle: str, cause: str) -> bool:
        """Record the recovery cycle's reboot and forget the machine's agent, in one transaction.

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
            await _forget_rebooted_agent(conn, machine_id, cause)
            return True

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

    async def agent_alive(self, machine_id: uuid.UUID, within: float) -> bool:
        """Whether the machine's agent has had a heartbeat accepted within the last `within` seconds."""
        query = select(machine_agent_heartbeat.c.agent_heartbeat_at).where(
            machine_agent_heartbeat.c.machine_id == machine_id,
            machine_agent_heartbeat.c.agent_heartbeat_at >= func.now() - timedelta(seconds=within),
        )
        async with self.engine.connect() as conn:
            return await conn.scalar(query) is not None

    async def forget_silent_agent(self, machine_id: uuid.UUID, detail: str, *, kind: str = "agent_forgotten") -> bool:
        """Forget the machine's agent, so the next takeover starts a new one without a reboot, or none at all (a
        decommission); with an event of kind. False if it had none."""
        async with self.engine.begin() as conn:
            if not await _forget_agent(conn, machine_id):
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
            await _forget_agent(conn, machine_id)
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

    async def reboot_recorded(self, machine_id: uuid.UUID, cycle: str) -> bool:
        """Whether the recovery cycle's reboot was done and recorded."""
        query = select(recovery_reboots.c.cycle).where(
            recovery_reboots.c.machine_id == machine_id, recovery_reboots.c.cycle == cycle
        )
        async with self.engine.connect() as conn:
            return await conn.scalar(query) is not None

    async def recovery_counts(self, machine_id: uuid.UUID | None = None) -> dict[uuid.UUID, int]:
        """Machine id -> how many times it was rebooted by a recovery, for machines rebooted at least once.

        Of every machine, or only of the one given.
        """
        query = select(events.c.machine_id, func.count()).where(
            events.c.kind == "rebooted",
            events.c.machine_id.is_not(None) if machine_id is None else events.c.machine_id == machine_id,
        )
        async with self.engine.connect() as conn:
            rows = await conn.execute(query.group_by(events.c.machine_id))
            return {machine_id: int(n) for machine_id, n in rows}

    # --- events ----------------------------------------------------------------

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

    async def count_by_status(self) -> dict[str, int]:
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

    async def read_clock(self, local_clock: Callable[[], float] = time.time) -> tuple[float, datetime, float]:
        """BMDB's clock between two readings of local_clock: (before, BMDB's time, after), for measuring how far
        the two clocks are apart. clock_timestamp(), not now(): now() is when the transaction began, outside the
        bracket, which holds one round trip only."""
        async with self.engine.connect() as conn:
            await conn.execute(select(1))  # the checkout and the transaction's start, before the bracket
            before = local_clock()
            at = await conn.scalar(select(func.clock_timestamp()))
            after = local_clock()
        assert isinstance(at, datetime)
        return before, at, after


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


async def _forget_agent(conn: Any, machine_id: uuid.UUID) -> bool:
    """Delete the machine's agent-started and heartbeat records; whether it had an agent."""
    await conn.execute(delete(machine_agent_heartbeat).where(machine_agent_heartbeat.c.machine_id == machine_id))
    forgotten = await conn.execute(
        delete(machine_agent_started)
        .where(machine_agent_started.c.machine_id == machine_id)
        .returning(machine_agent_started.c.machine_id)
    )
    return forgotten.first() is not None


async def _forget_rebooted_agent(conn: Any, machine_id: uuid.UUID, cause: str) -> None:
    await _forget_agent(conn, machine_id)
    await conn.execute(insert(events).values(machine_id=machine_id, kind="rebooted", detail=cause))


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
