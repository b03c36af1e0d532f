"""Initial BMDB: machines, provided, agent started, agent heartbeat, events.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _machine_fk() -> sa.Column:
    return sa.Column(
        "machine_id",
        UUID(as_uuid=True),
        sa.ForeignKey("machines.machine_id", ondelete="CASCADE"),
        primary_key=True,
    )


def upgrade() -> None:
    op.create_table(
        "machines",
        sa.Column("machine_id", UUID(as_uuid=True), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "machine_provided",
        _machine_fk(),
        sa.Column("provider", sa.Text, nullable=False),
        sa.Column("provider_id", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("address", sa.Text),
        sa.Column("ssh_port", sa.Integer),
        sa.Column("location", sa.Text),
        sa.Column("ssh_host_key", sa.Text),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("provider", "provider_id", name="machine_provided_provider_key"),
    )
    op.create_table(
        "machine_agent_started",
        _machine_fk(),
        sa.Column("agent_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("agent_public_key", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "machine_agent_heartbeat",
        _machine_fk(),
        sa.Column("agent_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("event_id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("machine_id", UUID(as_uuid=True), sa.ForeignKey("machines.machine_id", ondelete="CASCADE")),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("detail", sa.Text, nullable=False, server_default=""),
    )
    op.create_index("events_machine_at", "events", ["machine_id", "at"])


def downgrade() -> None:
    for table in ("events", "machine_agent_heartbeat", "machine_agent_started", "machine_provided", "machines"):
        op.drop_table(table)
