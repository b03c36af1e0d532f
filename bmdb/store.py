"""BMDB access: every query Shepherd runs against the machine database, through one BMDB object.

Writes are upserts on natural keys, so an activity that runs twice leaves the same rows as one that ran once.
Listing queries are single set-based statements: the fleet scale is 100,000 machines. The queries live in modules
by what they store: machines (machines), agents and host keys (agents), the heartbeat hot path (heartbeats), the
watchdog's rule (watchdog), recovery holds (holds), an operator's marks (marks) and the event log (events); the
records they answer with are bmdb.records'.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bmdb.agents import AgentRecords
from bmdb.approvals import ApprovalRecords
from bmdb.base import sqlalchemy_url
from bmdb.connection_errors import connection_failure
from bmdb.events import EventLog
from bmdb.heartbeats import HEARTBEAT_CONNECT_TIMEOUT, RECORD_HEARTBEATS, HeartbeatWrites
from bmdb.holds import RecoveryHolds
from bmdb.machines import MachineRecords
from bmdb.marks import MachineMarks
from bmdb.records import (
    OPERATOR_ACTION_KINDS,
    BMDBUnavailable,
    Event,
    Heartbeat,
    HeartbeatsNotRecorded,
    HeldRecoveries,
    HostKeyPinned,
    HostKeyUnexpected,
    MachineRecord,
    ProvidedMachine,
    SilentMachine,
    WatchdogLook,
    WatchedMachines,
)
from bmdb.watchdog import WatchdogQueries

__all__ = [
    "BMDB",
    "HEARTBEAT_CONNECT_TIMEOUT",
    "OPERATOR_ACTION_KINDS",
    "RECORD_HEARTBEATS",
    "BMDBUnavailable",
    "Event",
    "Heartbeat",
    "HeartbeatsNotRecorded",
    "HeldRecoveries",
    "HostKeyPinned",
    "HostKeyUnexpected",
    "MachineRecord",
    "ProvidedMachine",
    "SilentMachine",
    "WatchdogLook",
    "WatchedMachines",
    "sqlalchemy_url",
]


class BMDB(
    MachineRecords,
    AgentRecords,
    HeartbeatWrites,
    WatchdogQueries,
    RecoveryHolds,
    MachineMarks,
    EventLog,
    ApprovalRecords,
):
    """The machine database. One instance per process; it owns a connection pool."""

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        self.url = url
        # The heartbeat hot path's own connection (HeartbeatWrites), opened at the first heartbeat.
        self._heartbeat_connection: psycopg.AsyncConnection[Any] | None = None
        self._heartbeat_lock = asyncio.Lock()
        self.engine: AsyncEngine = create_async_engine(
            sqlalchemy_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
        )

    async def close(self) -> None:
        """Close the heartbeat connection and dispose of the engine's pooled connections."""
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
