"""What a BMDB credential may do, beside what the heartbeat server needs of it: for `shepherd doctor`.

The migrations make the role shepherd_heartbeat with exactly the heartbeat server's needs (docs/operations.md);
a deployment may still hand the server a user with more, its owner's or the workers'. Read through PostgreSQL's
own privilege functions, so a superuser, a table's owner and a user granted several roles each show what they
truly may do.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from bmdb.schema import metadata
from bmdb.store import BMDB

# The role whose grants are the heartbeat server's needs.
HEARTBEAT_ROLE = "shepherd_heartbeat"

# What the heartbeat server's statements use, (table, privilege) -> columns: the agent keys it checks requests
# against (bmdb/agents.py), the conditional upsert that records heartbeats (bmdb/heartbeats.py), and the schema
# revision every process reads at its start.
HEARTBEAT_NEEDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("machine_agent_started", "SELECT"): ("machine_id", "agent_public_key"),
    ("machine_agent_heartbeat", "SELECT"): ("machine_id", "agent_heartbeat_at", "agent_sent_at"),
    ("machine_agent_heartbeat", "INSERT"): ("machine_id", "agent_heartbeat_at", "agent_sent_at"),
    ("machine_agent_heartbeat", "UPDATE"): ("agent_heartbeat_at", "agent_sent_at"),
    ("alembic_version", "SELECT"): ("version_num",),
}

# Privileges PostgreSQL grants a column at a time, and those it grants only a whole table.
_COLUMN_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "REFERENCES")
_TABLE_PRIVILEGES = ("DELETE", "TRUNCATE", "TRIGGER")


@dataclass(frozen=True)
class Reach:
    """What a credential lacks of a process's needs, and what it may do beyond them, each as "DELETE on events"."""

    missing: list[str]
    beyond: list[str]


# Each (table, column or NULL for the table, privilege) asked of PostgreSQL at once.
_HELD = """
    SELECT checked.table_name, checked.column_name, checked.privilege
    FROM unnest(CAST(:tables AS text[]), CAST(:columns AS text[]), CAST(:privileges AS text[]))
        AS checked (table_name, column_name, privilege)
    WHERE CASE WHEN checked.column_name IS NULL THEN has_table_privilege(checked.table_name, checked.privilege)
        ELSE has_column_privilege(checked.table_name, checked.column_name, checked.privilege) END
"""


async def heartbeat_reach(bmdb: BMDB) -> Reach:
    """What the credential bmdb connects with lacks of the heartbeat server's needs, and what else it may do."""
    tables = {name: tuple(table.c.keys()) for name, table in metadata.tables.items()}
    tables["alembic_version"] = ("version_num",)
    checks: list[tuple[str, str | None, str]] = [
        (table, column, privilege)
        for table, columns in tables.items()
        for column in columns
        for privilege in _COLUMN_PRIVILEGES
    ]
    checks += [(table, None, privilege) for table in tables for privilege in _TABLE_PRIVILEGES]
    parameters = {
        "tables": [table for table, _, _ in checks],
        "columns": [column for _, column, _ in checks],
        "privileges": [privilege for _, _, privilege in checks],
    }
    async with bmdb.engine.connect() as conn:
        held = {(table, column, privilege) for table, column, privilege in await conn.execute(text(_HELD), parameters)}
    needed = {
        (table, column, privilege) for (table, privilege), columns in HEARTBEAT_NEEDS.items() for column in columns
    }
    return Reach(
        missing=sorted({f"{privilege} on {table}" for table, _, privilege in needed - held}),
        beyond=sorted({f"{privilege} on {table}" for table, _, privilege in held - needed}),
    )
