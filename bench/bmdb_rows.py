"""Machines written straight into BMDB with COPY, for benchmarks that need a large fleet in seconds."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg


@dataclass(frozen=True)
class BenchMachine:
    """A machine as BMDB holds it once provided; with an agent key, as after its takeover too."""

    machine_id: uuid.UUID
    provider: str
    provider_id: str
    agent_public_key: bytes | None = None


def insert_machines(url: str, machines: Sequence[BenchMachine], *, heartbeat_at: datetime | None = None) -> None:
    """Write the machines provided, their agents started where they have a key, heartbeating at heartbeat_at if
    given; then ANALYZE, so the planner sees the fleet's size."""
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cursor:
        with cursor.copy("COPY machines (machine_id) FROM STDIN") as copy:
            for machine in machines:
                copy.write_row((machine.machine_id,))
        with cursor.copy(
            "COPY machine_provided (machine_id, provider, provider_id, status, address, ssh_port) FROM STDIN"
        ) as copy:
            for machine in machines:
                copy.write_row((machine.machine_id, machine.provider, machine.provider_id, "provided", "10.0.0.1", 22))
        with_agents = [machine for machine in machines if machine.agent_public_key is not None]
        started_at = heartbeat_at or datetime.now(UTC)
        with cursor.copy(
            "COPY machine_agent_started (machine_id, agent_started_at, agent_public_key) FROM STDIN"
        ) as copy:
            for machine in with_agents:
                copy.write_row((machine.machine_id, started_at, machine.agent_public_key))
        if heartbeat_at is not None:
            with cursor.copy(
                "COPY machine_agent_heartbeat (machine_id, agent_heartbeat_at, agent_sent_at) FROM STDIN"
            ) as copy:
                for machine in with_agents:
                    copy.write_row((machine.machine_id, heartbeat_at, heartbeat_at))
        cursor.execute("ANALYZE")
