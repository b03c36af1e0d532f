"""How a BMDB URL reaches its server: the TLS it asks of libpq (sslmode) and whether that leaves the connection
open to whoever sits on the path.

Only sslmode=verify-full checks both the server's certificate and its name; every other mode lets a machine on the
path between a process and a BMDB on another host read and change what goes by: agent keys, heartbeats, the
machines' addresses and host-key pins. A BMDB on this host (loopback, a Unix socket) has no such path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from foundation.setting_values import is_loopback

SAFE_MODE = "verify-full"

# libpq's sslmode when neither the URL nor PGSSLMODE gives one: TLS if the server offers it, with no certificate
# check at all.
LIBPQ_DEFAULT_MODE = "prefer"


@dataclass(frozen=True)
class BMDBTransport:
    """A BMDB URL's host and the sslmode its connections use, with where that mode came from."""

    host: str
    sslmode: str
    # "the URL", "PGSSLMODE" or "libpq's default"
    source: str

    @property
    def local(self) -> bool:
        """Whether the server is on this host: a loopback address or a Unix socket (no host, or a directory)."""
        return not self.host or self.host.startswith("/") or is_loopback(self.host)

    @property
    def state(self) -> str:
        """The TLS state in a few words, as doctor shows it."""
        return f"sslmode={self.sslmode} ({self.source})"

    def warning(self, setting: str) -> str | None:
        """Why connections to a BMDB on another host can be read and changed on the way, or None when they cannot
        (verify-full) or there is no way (a local server)."""
        if self.local or self.sslmode == SAFE_MODE:
            return None
        return (
            f"{setting} reaches BMDB at {self.host} with {self.state}, which does not check the server's certificate "
            f"and name: whoever is on the path can read and change agent keys and heartbeats; add "
            f"sslmode={SAFE_MODE}&sslrootcert=<the BMDB server's CA> to the URL"
        )


def bmdb_transport(url: str, environ: Mapping[str, str] | None = None) -> BMDBTransport:
    """What a postgresql:// URL says of its host and TLS; libpq's own rules fill what it leaves out: a host query
    parameter overrides the URL's, and PGSSLMODE gives the mode the URL does not."""
    environ = os.environ if environ is None else environ
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    try:
        host = parts.hostname or ""
    except ValueError:
        host = ""
    if query.get("host"):
        host = query["host"][-1]
    if query.get("sslmode"):
        return BMDBTransport(host, query["sslmode"][-1], "the URL")
    if environ.get("PGSSLMODE"):
        return BMDBTransport(host, environ["PGSSLMODE"], "PGSSLMODE")
    return BMDBTransport(host, LIBPQ_DEFAULT_MODE, "libpq's default")


def bmdb_tls_warnings(urls: Mapping[str, str | None], environ: Mapping[str, str] | None = None) -> list[str]:
    """The warning of each BMDB URL set (setting -> URL) that reaches another host without verify-full."""
    warnings = []
    for setting, url in urls.items():
        if url is not None:
            warning = bmdb_transport(url, environ).warning(setting)
            if warning is not None:
                warnings.append(warning)
    return warnings


def log_bmdb_tls_warnings(log: logging.Logger, urls: Mapping[str, str | None]) -> None:
    """At a process's start: a WARNING for each BMDB URL that reaches another host without verify-full."""
    for warning in bmdb_tls_warnings(urls):
        log.warning("%s", warning)
