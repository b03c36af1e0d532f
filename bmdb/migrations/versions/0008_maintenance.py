"""A machine an operator took out of automation for hardware work is marked, so the watchdog leaves it alone.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_provided", sa.Column("maintenance_since", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("machine_provided", "maintenance_since")
