"""A machine the provider no longer lists is marked, so it is reported and never rebooted again.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_provided", sa.Column("missing_since", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("machine_provided", "missing_since")
