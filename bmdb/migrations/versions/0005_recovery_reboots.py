"""Each recovery reboot, by the recovery cycle it belongs to: a cycle reboots a machine once.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "recovery_reboots",
        sa.Column(
            "machine_id", UUID(as_uuid=True), sa.ForeignKey("machines.machine_id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("cycle", sa.Text, nullable=False),
        sa.Column("rebooted_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("cause", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("machine_id", "cycle"),
    )


def downgrade() -> None:
    op.drop_table("recovery_reboots")
