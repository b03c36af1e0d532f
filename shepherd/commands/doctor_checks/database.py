"""The BMDB checks: reachable, its schema at the newest migration, its clock, and the TLS its URLs ask for; and the
heartbeat server's own credential, when it has one: reachable, and allowed what the heartbeat server does and no
more."""

from __future__ import annotations

import asyncio

from sqlalchemy.exc import ProgrammingError

from bmdb.local_postgres import LocalPostgres
from bmdb.migrate import head_revision, schema_problem, schema_revision
from bmdb.privileges import HEARTBEAT_ROLE, heartbeat_reach
from bmdb.store import BMDB, BMDBUnavailable
from foundation.bmdb_tls import bmdb_tls_warnings, bmdb_transport
from foundation.settings_report import redact_url
from shepherd.commands.doctor_checks.checkup import Checkup
from shepherd.commands.doctor_checks.clocks import ClockReading, clock_verdict
from shepherd.commands.doctor_checks.verdicts import Verdict, fail, ok, warn

# Privileges a line names at most; --json has them all.
SHOWN_PRIVILEGES = 4


class DatabaseChecks(Checkup):
    """The checks of BMDB; it is opened once, and closed when doctor is done."""

    async def bmdb_checks(self) -> None:
        """Check BMDB: reachable first, then its schema and its clock."""
        await self.check("bmdb", self.open_bmdb)
        await self.check("bmdb schema", self.bmdb_schema, needs=["bmdb"])
        await self.check("bmdb clock", self.bmdb_clock, needs=["bmdb"])
        await self.check("bmdb tls", self.bmdb_tls)
        if self.settings.heartbeat_database_url:
            await self.check("bmdb heartbeat credential", self.heartbeat_credential)

    async def open_bmdb(self) -> Verdict:
        """Whether BMDB answers, at database_url or in the local PostgreSQL; kept open for the next checks."""
        url = self.settings.database_url
        local = ""
        if url is None:
            data = self.settings.state_dir / "postgres"
            if not data.is_dir():
                fail(
                    f"database_url is unset and there is no local PostgreSQL in {data}: set SHEPHERD_DATABASE_URL, "
                    "or run `shepherd dev`"
                )
            # Joins the embedded stack's PostgreSQL when it runs, as every command does; started otherwise.
            postgres = LocalPostgres(data)
            url = await asyncio.to_thread(postgres.start)
            self.stack.callback(postgres.stop)
            local = f" (the local PostgreSQL in {data})"
        bmdb = BMDB(url, pool_size=1)
        self.stack.push_async_callback(bmdb.close)
        try:
            await bmdb.ping()
        except BMDBUnavailable as error:
            fail(f"{error} (setting database_url)", url=redact_url(url))
        self.bmdb = bmdb
        return ok(f"reachable at {redact_url(url)}{local}", url=redact_url(url))

    async def bmdb_schema(self) -> Verdict:
        """Whether BMDB is at the newest migration."""
        assert self.bmdb is not None
        revision, head = await schema_revision(self.bmdb), head_revision()
        problem = schema_problem(self.bmdb.url, revision)
        if problem is not None:
            fail(problem, revision=revision, head=head)
        return ok(f"at the newest migration, {head}", revision=revision, head=head)

    async def bmdb_clock(self) -> Verdict:
        """How far BMDB's clock is from this host's."""
        assert self.bmdb is not None
        before, remote, after = await self.bmdb.read_clock()
        how = "SELECT clock_timestamp() between two readings of this host's clock"
        return clock_verdict("BMDB's", ClockReading(before, remote, after), how)

    async def bmdb_tls(self) -> Verdict:
        """The TLS of each BMDB URL (sslmode); a warning for one that reaches another host without verify-full,
        which leaves what goes to BMDB open to whoever is on the path."""
        urls = {
            "database_url": self.settings.database_url,
            "heartbeat_database_url": self.settings.heartbeat_database_url,
        }
        states = {setting: bmdb_transport(url, self.environ) for setting, url in urls.items() if url is not None}
        facts = {f"{setting}_sslmode": transport.sslmode for setting, transport in states.items()}
        warnings = bmdb_tls_warnings(urls, self.environ)
        if warnings:
            return warn("; ".join(warnings), **facts)
        if not states:
            return ok("the local PostgreSQL of the embedded stack, on this host", **facts)
        shown = "; ".join(
            f"{setting}: {transport.state}{', on this host' if transport.local else ''}"
            for setting, transport in states.items()
        )
        return ok(shown, **facts)

    async def heartbeat_credential(self) -> Verdict:
        """Whether the heartbeat server's own credential reaches BMDB at the newest migration, allowed what the
        heartbeat server does; a warning when it is allowed more, which a server broken into could do too."""
        url = self.settings.heartbeat_database_url
        assert url is not None
        shown = redact_url(url)
        bmdb = BMDB(url, pool_size=1)
        self.stack.push_async_callback(bmdb.close)
        try:
            await bmdb.ping()
        except BMDBUnavailable as error:
            fail(f"{error} (setting heartbeat_database_url)", url=shown)
        grant = f"grant its user {HEARTBEAT_ROLE} (docs/operations.md#bmdb-roles)"
        try:
            revision = await schema_revision(bmdb)
        except ProgrammingError:
            fail(f"{shown} may not read the schema revision: {grant}", url=shown)
        problem = schema_problem(url, revision)
        if problem is not None:
            fail(problem, url=shown)
        reach = await heartbeat_reach(bmdb)
        facts = {"url": shown, "missing": reach.missing, "beyond": reach.beyond}
        if reach.missing:
            fail(f"{shown} may not do what the heartbeat server does, no {_some(reach.missing)}: {grant}", **facts)
        if reach.beyond:
            return warn(
                f"{shown} may do more than the heartbeat server needs ({_some(reach.beyond)}), and so could a "
                f"heartbeat server broken into: give it a user granted {HEARTBEAT_ROLE} alone "
                "(docs/operations.md#bmdb-roles)",
                **facts,
            )
        return ok(f"reachable at {shown}, allowed what the heartbeat server does and nothing more", **facts)


def _some(privileges: list[str]) -> str:
    """The first privileges, and how many more there are."""
    shown = ", ".join(privileges[:SHOWN_PRIVILEGES])
    more = len(privileges) - SHOWN_PRIVILEGES
    return f"{shown} and {more} more" if more > 0 else shown
