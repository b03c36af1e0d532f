"""A machine whose provisioning or agent start outlasts its deadline is flagged stuck, for operators and alerts.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_provided", sa.Column("stuck_since", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("machine_provided", "stuck_since")
