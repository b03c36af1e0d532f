"""Least privilege: BMDB roles for the heartbeat server, the workers and operators' reads, each with what it needs.

Each role is granted what its process's statements need and nothing more. The roles are NOLOGIN groups; a
deployment grants them to its login users (docs/operations.md). Roles belong to the PostgreSQL cluster, not to
one database, so a role another BMDB on the cluster made (or a superuser made beforehand, for a migrating user
without CREATEROLE) is taken as it is; the grants are this database's.

- shepherd_heartbeat: the heartbeat server. It reads the running agents' keys and writes heartbeats through its
  conditional upsert (bmdb/heartbeats.py); it cannot delete a heartbeat, touch a machine, a hold or the event log.
- shepherd_worker: the workers (and operators' commands that act): every row of the schema, no DDL.
- shepherd_reader: operators' reads.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

ROLES = ("shepherd_heartbeat", "shepherd_worker", "shepherd_reader")

# Every table at this revision, and the sequence behind events.event_id.
TABLES = (
    "machines",
    "machine_provided",
    "machine_agent_started",
    "machine_agent_heartbeat",
    "events",
    "recovery_reboots",
    "recovery_holds",
)
SEQUENCES = ("events_event_id_seq",)

GRANTS = (
    # The heartbeat server's statements, column by column: the agent keys it checks requests against (one, or
    # the most recently heartbeating ones at its start), and the upsert that records a heartbeat only for the
    # key BMDB holds and only when newer (its ON CONFLICT reads the row it may update and returns its machine).
    "GRANT SELECT (machine_id, agent_public_key) ON machine_agent_started TO shepherd_heartbeat",
    "GRANT SELECT (machine_id, agent_heartbeat_at, agent_sent_at), INSERT (machine_id, agent_heartbeat_at, "
    "agent_sent_at), UPDATE (agent_heartbeat_at, agent_sent_at) ON machine_agent_heartbeat TO shepherd_heartbeat",
    # Every process checks the schema revision at its start.
    "GRANT SELECT ON alembic_version TO shepherd_heartbeat, shepherd_worker, shepherd_reader",
    f"GRANT SELECT, INSERT, UPDATE, DELETE ON {', '.join(TABLES)} TO shepherd_worker",
    f"GRANT USAGE, SELECT ON SEQUENCE {', '.join(SEQUENCES)} TO shepherd_worker",
    f"GRANT SELECT ON {', '.join(TABLES)} TO shepherd_reader",
)


def _create_role(role: str) -> str:
    """A block that creates the role unless it exists; without the right to, it names what to do instead."""
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        BEGIN
            CREATE ROLE {role} NOLOGIN;
        EXCEPTION
            -- Another BMDB on this cluster, migrating at the same moment, made it first.
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'insufficient_privilege',
                    MESSAGE = 'the BMDB role {role} does not exist and ' || current_user || ' may not create '
                        || 'roles: have a superuser run CREATE ROLE shepherd_heartbeat NOLOGIN; CREATE ROLE '
                        || 'shepherd_worker NOLOGIN; CREATE ROLE shepherd_reader NOLOGIN; once for this PostgreSQL, '
                        || 'or give ' || current_user || ' CREATEROLE, then migrate again';
        END;
    END IF;
END
$$"""


def _revoke(role: str) -> str:
    """A block that takes back what this database granted the role, if the role still exists."""
    return f"""
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        REVOKE ALL ON {", ".join(TABLES)}, alembic_version FROM {role};
        REVOKE ALL ON SEQUENCE {", ".join(SEQUENCES)} FROM {role};
    END IF;
END
$$"""


def _drop_role_unless_used(role: str) -> str:
    """A block that drops the role when nothing holds it any more: no login user is granted it (the migrating
    user's own membership aside, which PostgreSQL gives the creator of a role), and no database of the cluster
    grants it anything, which DROP ROLE itself refuses. A role it keeps is named in a notice."""
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        RETURN;
    END IF;
    IF EXISTS (
        SELECT FROM pg_auth_members AS m JOIN pg_roles AS r ON r.oid = m.roleid JOIN pg_roles AS u ON u.oid = m.member
        WHERE r.rolname = '{role}' AND u.rolname <> current_user
    ) THEN
        RAISE NOTICE 'the BMDB role {role} is kept: login users are granted it';
        RETURN;
    END IF;
    BEGIN
        DROP ROLE {role};
    EXCEPTION
        WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'the BMDB role {role} is kept: another database of this PostgreSQL grants it privileges';
        WHEN insufficient_privilege THEN
            RAISE NOTICE 'the BMDB role {role} is kept: % may not drop it', current_user;
    END;
END
$$"""


def upgrade() -> None:
    for role in ROLES:
        op.execute(_create_role(role))
    for grant in GRANTS:
        op.execute(grant)


def downgrade() -> None:
    # Only this database's grants go; the roles stay while anything still holds them (another BMDB on the
    # cluster, a login user), so a downgrade here never takes a credential away from elsewhere, and an upgrade
    # again finds them with their members.
    for role in ROLES:
        op.execute(_revoke(role))
        op.execute(_drop_role_unless_used(role))
