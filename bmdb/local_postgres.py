"""A local PostgreSQL under the state dir (the pgserver wheel): BMDB wherever database_url is unset."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from foundation.settings import Settings

log = logging.getLogger(__name__)


class LocalPostgres:
    """PostgreSQL on a Unix socket with its data under data_dir.

    Several processes may open the same data_dir: they share one server, and
    the last one to stop it stops it.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._server: Any = None

    def start(self) -> str:
        """Start (or join) the server and return its postgresql:// URL."""
        with warnings.catch_warnings():
            # pgserver warns that XDG_RUNTIME_DIR is unset, which is normal on servers.
            warnings.simplefilter("ignore")
            import pgserver  # imported here: only the embedded stack needs it

        self.data_dir.mkdir(parents=True, exist_ok=True)
        log.debug("starting or joining the local PostgreSQL in %s", self.data_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._server = pgserver.get_server(self.data_dir, cleanup_mode="stop")
        return str(self._server.get_uri())

    def stop(self) -> None:
        """Leave the server, stopping it if no other process still uses it."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def bmdb_url(settings: Settings) -> Iterator[str]:
    """The BMDB URL of the settings, or while the block runs a local PostgreSQL's under the state dir."""
    if settings.database_url:
        yield settings.database_url
        return
    with LocalPostgres(settings.state_dir / "postgres") as url:
        yield url


@contextmanager
def heartbeat_bmdb_url(settings: Settings) -> Iterator[str]:
    """The BMDB URL of the heartbeat server: its own credential, heartbeat_database_url, or else bmdb_url's."""
    if settings.heartbeat_database_url:
        yield settings.heartbeat_database_url
        return
    with bmdb_url(settings) as url:
        yield url
