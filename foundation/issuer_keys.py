"""An OIDC issuer's public signing keys (its JWKS), fetched through its discovery document and kept.

Keys are kept by key id. A token signed with a key id not among them makes the keys be fetched again, since an
issuer publishes a new key before it signs with it (a rotation); but at most once every refetch_interval, so a
flood of tokens with made-up key ids costs the issuer one request every few seconds, not one a token. Keys older
than max_age are fetched again at the next use, so a key the issuer withdrew stops being trusted; when that fetch
fails the keys held are used on (they were the issuer's a moment ago, and an issuer's outage should not lock every
operator out), and the fetch is tried again after refetch_interval.

Only asymmetric signing keys are kept: a symmetric ("oct") key in a key set is a shared secret, and a token
"signed" with it could have been made by anyone holding the set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from joserfc.errors import JoseError
from joserfc.jwk import JWKRegistry, Key

from foundation.oidc_issuer import IssuerUnavailable, fetch_json, fetch_metadata

log = logging.getLogger("shepherd.oidc")

# Key types that sign with a private key and verify with a public one.
ASYMMETRIC_KEY_TYPES = ("RSA", "EC", "OKP")


class UnknownSigningKey(Exception):
    """The issuer publishes no key that the token names; str() says which, without the token."""


class IssuerKeys:
    """The signing keys of one issuer, fetched when first needed and kept (see the module's docstring)."""

    def __init__(
        self,
        issuer: str,
        session: Callable[[], aiohttp.ClientSession],
        *,
        refetch_interval: float = 5.0,
        max_age: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.issuer = issuer
        self.refetch_interval = refetch_interval
        self.max_age = max_age
        self.fetches = 0  # how many times the keys were fetched, for the logs and tests
        self._session = session
        self._clock = clock
        self._keys: dict[str | None, Key] = {}
        self._fetched_at: float | None = None
        self._tried_at: float | None = None
        self._lock = asyncio.Lock()

    async def key(self, kid: str | None) -> Key:
        """The issuer's key of that id (None: the token names none, and the issuer publishes exactly one);
        UnknownSigningKey when the issuer does not publish it, IssuerUnavailable when its keys cannot be had."""
        if self._fetched_at is None or self._clock() - self._fetched_at >= self.max_age:
            await self._refresh(kid, stale=self._fetched_at is not None)
        elif self._find(kid) is None:
            await self._refresh(kid, stale=False)
        key = self._find(kid)
        if key is not None:
            return key
        if kid is None:
            raise UnknownSigningKey(
                f"the token names no signing key (kid), and the issuer publishes {len(self._keys)} keys with ids"
            )
        raise UnknownSigningKey(f"the issuer does not publish the signing key {kid[:100]!r} the token names")

    def _find(self, kid: str | None) -> Key | None:
        # A token without a key id fits the issuer's only key, or else its only key without an id.
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(kid)

    async def _refresh(self, kid: str | None, *, stale: bool) -> None:
        async with self._lock:
            # Another request may have fetched them while this one waited.
            if self._fetched_at is not None and self._find(kid) is not None and not self._expired():
                return
            if self._tried_at is not None and self._clock() - self._tried_at < self.refetch_interval:
                if self._fetched_at is None:
                    raise IssuerUnavailable(f"the keys of {self.issuer} could not be fetched a moment ago")
                return
            self._tried_at = self._clock()
            try:
                self._keys = await self._fetch()
            except IssuerUnavailable as error:
                if not stale:
                    raise
                log.warning("the keys of %s were not fetched again, the ones held are used on: %s", self.issuer, error)
                return
            self._fetched_at = self._clock()

    def _expired(self) -> bool:
        return self._fetched_at is None or self._clock() - self._fetched_at >= self.max_age

    async def _fetch(self) -> dict[str | None, Key]:
        session = self._session()
        metadata = await fetch_metadata(session, self.issuer)
        document = await fetch_json(session, metadata.jwks_uri, what="the issuer's keys")
        self.fetches += 1
        keys = signing_keys(document)
        if not keys:
            raise IssuerUnavailable(f"the key set at {metadata.jwks_uri} holds no asymmetric signing key")
        log.debug("fetched %d signing keys of %s", len(keys), self.issuer)
        return keys


def signing_keys(document: dict[str, Any]) -> dict[str | None, Key]:
    """The asymmetric signing keys of a JWKS document, by key id; keys of other kinds, for encryption, or that do
    not import are left out, as RFC 7517 section 5 asks of keys a reader does not understand."""
    entries = document.get("keys")
    keys: dict[str | None, Key] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or entry.get("kty") not in ASYMMETRIC_KEY_TYPES:
            continue
        if entry.get("use", "sig") != "sig" or any(private in entry for private in ("d", "p", "q")):
            continue
        try:
            key = JWKRegistry.import_key(entry)
        except (JoseError, ValueError, TypeError):
            continue
        keys.setdefault(key.kid, key)
    return keys
