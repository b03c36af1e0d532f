"""A decommissioned machine is marked retired, with when and why, and kept for its history; no pass adopts it again.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_provided", sa.Column("retired_at", sa.DateTime(timezone=True)))
    op.add_column("machine_provided", sa.Column("retired_reason", sa.Text))


def downgrade() -> None:
    op.drop_column("machine_provided", "retired_reason")
    op.drop_column("machine_provided", "retired_at")
