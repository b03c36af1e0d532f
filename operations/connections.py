"""The operator client's connections: Temporal and BMDB, each opened at its first use and closed together."""

from __future__ import annotations

from contextlib import ExitStack
from types import TracebackType

from temporalio.client import Client

from bmdb.local_postgres import bmdb_url
from bmdb.migrate import open_bmdb
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import credited
from operations.attestation import Attestation


class OperatorError(Exception):
    """An operator's request could not be done; the message says why and what to do, and is shown as it is."""


class Connections:
    """Temporal and BMDB for one operator's requests. BMDB is opened only when a request needs it, so that a
    local PostgreSQL starts only then and a request Temporal alone answers works while BMDB is down."""

    def __init__(
        self,
        settings: Settings,
        *,
        temporal: Client | None = None,
        database_url: str | None = None,
        bmdb: BMDB | None = None,
        attestation: Attestation | None = None,
    ) -> None:
        self.settings = settings
        # The operator the API verified, whose updates carry the API's proof; None for a command run by hand.
        self.attestation = attestation
        self._temporal = temporal
        self._database_url = database_url
        # A BMDB already open is the caller's to close (the API shares one across its requests); one this client
        # opens is its own.
        self._bmdb = bmdb
        self._owns_bmdb = bmdb is None
        self._closing = ExitStack()

    def credited(self, by: str) -> str:
        """Who asked, as the event log records what this client does itself (a host-key reset, a release of held
        recoveries, a fleet schedule paused): the operator the API verified, else whoever the caller says."""
        if self.attestation is not None:
            return credited(self.attestation.subject, self.attestation.via)
        return credited(by, None)

    async def temporal(self) -> Client:
        """The Temporal client, connected at the first call."""
        if self._temporal is None:
            self._temporal = await connect_temporal(self.settings)
        return self._temporal

    async def bmdb(self) -> BMDB:
        """BMDB, opened at the first call: the given URL, the settings', or a local PostgreSQL's."""
        if self._bmdb is None:
            url = self._database_url or self._closing.enter_context(bmdb_url(self.settings))
            self._bmdb = await open_bmdb(url)
        return self._bmdb

    async def close(self) -> None:
        """Close the BMDB this client opened and stop a local PostgreSQL it started; the Temporal client needs no
        closing."""
        try:
            if self._bmdb is not None and self._owns_bmdb:
                await self._bmdb.close()
                self._bmdb = None
        finally:
            self._closing.close()

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()
