"""Bring a BMDB schema up to date with the Alembic migrations shipped here."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine

from bmdb.store import BMDB, BMDBUnavailable, sqlalchemy_url
from foundation.settings import redact_url
from foundation.startup import StartupError

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Apply every migration up to revision; safe to run again."""
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no migrations shipped"
    return head


async def open_bmdb(url: str) -> BMDB:
    """BMDB for a process: reachable, and at the schema revision this Shepherd needs."""
    bmdb = BMDB(url)
    try:
        await bmdb.ping()
    except BMDBUnavailable as error:
        await bmdb.close()
        raise StartupError(f"{error} (setting database_url)") from error
    revision = await asyncio.to_thread(current_revision, url)
    head = head_revision()
    if revision != head:
        await bmdb.close()
        raise StartupError(
            f"BMDB at {redact_url(url)} has schema revision {revision or 'none'}, this Shepherd needs {head}: "
            "run `shepherd migrate`"
        )
    return bmdb
