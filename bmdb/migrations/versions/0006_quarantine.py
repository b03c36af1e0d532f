"""A machine past its recovery budget is quarantined: marked, so the watchdog leaves it to an operator.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_provided", sa.Column("quarantined_since", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("machine_provided", "quarantined_since")
