"""Alembic environment: runs the BMDB migrations on the connection it is handed."""

from __future__ import annotations

from alembic import context

from bmdb.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata)
with context.begin_transaction():
    context.run_migrations()
