"""The watchdog's turns and signals: when it last looked for silent machines of each provider instance and which
process looked (the workers take turns by it, so one look an interval is made however many workers run), and when
it signalled each silent agent's machine (a look signals an agent again only once a heartbeat timeout has passed,
where it signalled every silent machine at every look until its recovery forgot the agent).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "watchdog_looks",
        sa.Column("provider", sa.Text, primary_key=True),
        sa.Column("looked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("looked_by", sa.Text, nullable=False),
    )
    op.create_table(
        "silence_signals",
        sa.Column(
            "machine_id", UUID(as_uuid=True), sa.ForeignKey("machines.machine_id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("agent_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signalled_at", sa.DateTime(timezone=True), nullable=False),
    )
    # As 0010 grants every table: the workers' role writes, readers read.
    for table in ("watchdog_looks", "silence_signals"):
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO shepherd_worker")
        op.execute(f"GRANT SELECT ON {table} TO shepherd_reader")


def downgrade() -> None:
    op.drop_table("silence_signals")
    op.drop_table("watchdog_looks")
