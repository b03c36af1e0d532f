"""When a machine's workflow confirmed the silence the watchdog told it of: its recovery is under way, so a look
tells it again only after an hour (a workflow reset to before it), not after every heartbeat timeout while the
reboot waits its turn at the provider's rate limit.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("silence_signals", sa.Column("confirmed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("silence_signals", "confirmed_at")
