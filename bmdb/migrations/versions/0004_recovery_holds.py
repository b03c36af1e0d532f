"""The watchdog's recovery holds: one row per provider, its hold's start, the operator's release and its end.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "recovery_holds",
        sa.Column("provider", sa.Text, primary_key=True),
        sa.Column("held_since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("silent_count", sa.Integer, nullable=False),
        sa.Column("threshold", sa.Integer, nullable=False),
        sa.Column("sample", sa.Text, nullable=False, server_default=""),
        sa.Column("released_at", sa.DateTime(timezone=True)),
        sa.Column("released_by", sa.Text),
        sa.Column("release_reason", sa.Text),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    op.drop_table("recovery_holds")
