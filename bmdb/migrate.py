"""Bring a BMDB schema up to date with the Alembic migrations shipped here."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.exc import DBAPIError, OperationalError

from bmdb.connection_errors import connection_failure
from bmdb.store import BMDB, BMDBUnavailable, sqlalchemy_url
from foundation.settings_report import redact_url
from foundation.startup import StartupError

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    """The Alembic configuration that finds the migrations shipped here."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def _connect(engine: Engine, url: str) -> Connection:
    """A connection, or BMDBUnavailable with the cause on one line (for TLS, the URL parameter at fault)."""
    try:
        return engine.connect()
    except (OperationalError, DBAPIError, OSError) as error:
        raise BMDBUnavailable(connection_failure(url, error)) from error


def upgrade(url: str, revision: str = "head") -> None:
    """Apply every migration up to revision; safe to run again. BMDBUnavailable when BMDB cannot be reached."""
    engine = create_engine(sqlalchemy_url(url))
    try:
        with _connect(engine, url) as connection, connection.begin():
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    """The schema revision BMDB is at (None: no schema yet); BMDBUnavailable when BMDB cannot be reached."""
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(sqlalchemy_url(url))
    try:
        with _connect(engine, url) as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest schema revision the shipped migrations reach."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no migrations shipped"
    return head


def known_revisions() -> set[str]:
    """Every schema revision the migrations shipped here bring BMDB to."""
    from alembic.script import ScriptDirectory

    return {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


async def schema_revision(bmdb: BMDB) -> str | None:
    """The schema revision BMDB is at (None: no schema yet), read over its own connection pool."""
    from alembic.runtime.migration import MigrationContext

    async with bmdb.engine.connect() as connection:
        return await connection.run_sync(lambda sync: MigrationContext.configure(sync).get_current_revision())


def schema_problem(url: str, revision: str | None) -> str | None:
    """Why this Shepherd cannot use BMDB at url at that schema revision, naming what to do; None when it can."""
    head = head_revision()
    if revision == head:
        return None
    if revision is not None and revision not in known_revisions():
        # `shepherd migrate` cannot help: only a Shepherd that ships this revision knows the schema.
        return (
            f"BMDB at {redact_url(url)} has schema revision {revision}, newer than this Shepherd knows (it needs "
            f"{head}): a newer Shepherd migrated it; run that version"
        )
    return (
        f"BMDB at {redact_url(url)} has schema revision {revision or 'none'}, this Shepherd needs {head}: "
        "run `shepherd migrate`"
    )


async def open_bmdb(url: str, *, setting: str = "database_url") -> BMDB:
    """BMDB for a process: reachable, and at the schema revision this Shepherd needs; a failure names the setting
    the URL came from."""
    bmdb = BMDB(url)
    try:
        await bmdb.ping()
    except BMDBUnavailable as error:
        await bmdb.close()
        raise StartupError(f"{error} (setting {setting})") from error
    problem = schema_problem(url, await schema_revision(bmdb))
    if problem is not None:
        await bmdb.close()
        raise StartupError(problem)
    return bmdb
