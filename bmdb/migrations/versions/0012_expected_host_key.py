"""A host-key pin reset may name the fingerprint the machine's next key must have: kept beside the empty pin until
a key with it is pinned.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machine_provided", sa.Column("expected_host_key_fingerprint", sa.Text))


def downgrade() -> None:
    op.drop_column("machine_provided", "expected_host_key_fingerprint")
