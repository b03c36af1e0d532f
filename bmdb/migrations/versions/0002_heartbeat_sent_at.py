"""Heartbeats remember the agent's own send time, to refuse replayed requests.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_agent_heartbeat", sa.Column("agent_sent_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("machine_agent_heartbeat", "agent_sent_at")
