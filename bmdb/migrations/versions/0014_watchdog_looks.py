"""When the watchdog last looked for silent machines of each provider instance, and which process looked: the
workers take turns by it, so one look an interval is made however many workers run, and operators see it.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

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
    # As 0010 grants every table: the workers' role writes, readers read.
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON watchdog_looks TO shepherd_worker")
    op.execute("GRANT SELECT ON watchdog_looks TO shepherd_reader")


def downgrade() -> None:
    op.drop_table("watchdog_looks")
