"""When a recovery cycle first asked its provider to reboot a machine: a retry whose attempt before died with the
call under way looks for that reboot's evidence, and reboots again only without it.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reboot_asks",
        sa.Column(
            "machine_id", UUID(as_uuid=True), sa.ForeignKey("machines.machine_id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("cycle", sa.Text, nullable=False),
        sa.Column("asked_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("machine_id", "cycle"),
    )
    # As 0010 grants every table: the workers' role writes, readers read.
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON reboot_asks TO shepherd_worker")
    op.execute("GRANT SELECT ON reboot_asks TO shepherd_reader")


def downgrade() -> None:
    op.drop_table("reboot_asks")
