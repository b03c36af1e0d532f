"""Operator approvals: a request the policy gives to two people waits here, as asked, until a second operator
approves or refuses it, or it expires.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "operator_approvals",
        sa.Column("approval_id", UUID(as_uuid=True), primary_key=True),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("request", JSONB, nullable=False),
        sa.Column("asked_by", sa.Text, nullable=False),
        sa.Column("asked_via", sa.Text, nullable=False),
        sa.Column("asked_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decision", sa.Text),
        sa.Column("decided_by", sa.Text),
        sa.Column("decided_at", sa.DateTime(timezone=True)),
        sa.Column("outcome", sa.Text),
    )
    op.create_index(
        "operator_approvals_open", "operator_approvals", ["expires_at"], postgresql_where="decision IS NULL"
    )
    # As 0010 grants every table: the workers' role (and the API's, which acts as it) writes, readers read.
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON operator_approvals TO shepherd_worker")
    op.execute("GRANT SELECT ON operator_approvals TO shepherd_reader")


def downgrade() -> None:
    op.drop_table("operator_approvals")
