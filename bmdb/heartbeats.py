"""The heartbeat hot path: agents' heartbeats written thousands a second, on a connection of their own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import func, select

from bmdb.base import StoreBase
from bmdb.connection_errors import connection_failure, libpq_url
from bmdb.records import Heartbeat, HeartbeatsNotRecorded
from bmdb.schema import machine_agent_heartbeat

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


class HeartbeatWrites(StoreBase):
    """Recording heartbeats, and how old the oldest is."""

    # Heartbeats have a connection of their own, outside the pool, which BMDB sets up: in autocommit, a statement
    # is one round trip, with no checkout, ping or transaction block around it.
    _heartbeat_connection: psycopg.AsyncConnection[Any] | None
    _heartbeat_lock: asyncio.Lock

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

    async def oldest_heartbeat_age(self) -> float | None:
        """Seconds since the oldest last heartbeat of a running agent; None when no agent has sent one."""
        query = select(func.max(func.extract("epoch", func.now() - machine_agent_heartbeat.c.agent_heartbeat_at)))
        async with self.engine.connect() as conn:
            age = await conn.scalar(query)
            return None if age is None else float(age)
