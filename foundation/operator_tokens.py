"""Who an operator is, from the bearer token the operator presents: an OIDC access token checked against its issuer.

A token is accepted only when all of these hold, checked in this order:

- it is a JWS in compact form, no longer than MAX_TOKEN_CHARS, without critical header extensions;
- its algorithm is an asymmetric one of ALLOWED_ALGORITHMS: never ``none``, never an HMAC (HS256 with the
  issuer's public key as the secret would let anyone who read the key set sign);
- it names the configured issuer (read before the signature, so a token of another issuer costs the issuer no
  key fetch; it is checked again once verified);
- it is signed by a key the issuer publishes now (foundation/issuer_keys.py), of the kind the algorithm needs,
  and the signature verifies (joserfc);
- its ``aud`` is, or includes, the API's audience: a token the issuer made for another service is refused;
- ``exp`` is present and not past, ``nbf`` and ``iat`` are not ahead, each within a small leeway for clocks;
- ``sub`` names someone.

A refusal is a TokenRefused whose text names what is wrong and never quotes the token; an issuer that cannot be
asked is an IssuerUnavailable (foundation/oidc_issuer.py), a distinct error worth trying again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeGuard

import aiohttp
from joserfc import jws, jwt
from joserfc.errors import BadSignatureError, JoseError
from joserfc.jwk import Key

from foundation.issuer_keys import IssuerKeys, UnknownSigningKey
from foundation.oidc_issuer import DEFAULT_TIMEOUT, IssuerUnavailable

__all__ = ["ALLOWED_ALGORITHMS", "IssuerUnavailable", "OperatorIdentity", "TokenRefused", "TokenVerifier"]

# Asymmetric JWS algorithms, by the key type each needs.
ALLOWED_ALGORITHMS = {
    "RS256": "RSA",
    "RS384": "RSA",
    "RS512": "RSA",
    "PS256": "RSA",
    "PS384": "RSA",
    "PS512": "RSA",
    "ES256": "EC",
    "ES384": "EC",
    "ES512": "EC",
    "EdDSA": "OKP",
    "Ed25519": "OKP",
}
# Far above any access token an issuer makes (a few kilobytes with many groups).
MAX_TOKEN_CHARS = 16384
DEFAULT_LEEWAY = 30.0
LATEST_TIME = 64060588800  # 4000-01-01 UTC: a time claim past it is no time
VERIFIED_BY_OIDC = "oidc"


class TokenRefused(Exception):
    """The token does not prove who presents it; str() says why, without the token."""


@dataclass(frozen=True)
class OperatorIdentity:
    """An operator as a verified token or client certificate shows them: who, in which groups, vouched for by whom,
    and until when."""

    subject: str
    groups: tuple[str, ...]
    issuer: str
    # how: "oidc", a token checked against the issuer's keys; "certificate", a client certificate of the operator CA
    verified_by: str
    expires_at: datetime  # the token's (or certificate's) expiry (UTC): the identity is not to be trusted past it
    client_id: str | None = None  # the client the token was issued to: the CLI, a CI tool
    certificate: str | None = None  # the client certificate's subject DN (RFC 4514), matched by certificate grants


class TokenVerifier:
    """Checks operators' bearer tokens against one issuer and audience; keeps the issuer's keys between checks.

    Use it as an async context manager, or close() it, to close its HTTP session.
    """

    def __init__(
        self,
        issuer: str,
        audience: str,
        *,
        leeway: float = DEFAULT_LEEWAY,
        refetch_interval: float = 5.0,
        keys_max_age: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.issuer = issuer
        self.audience = audience
        self.leeway = leeway
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self.keys = IssuerKeys(issuer, self._http, refetch_interval=refetch_interval, max_age=keys_max_age)

    async def __aenter__(self) -> TokenVerifier:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session to the issuer, if one was opened."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=DEFAULT_TIMEOUT)
        return self._session

    async def verify(self, token: str) -> OperatorIdentity:
        """The operator the token proves; TokenRefused naming what is wrong with it, IssuerUnavailable when the
        issuer's keys cannot be had."""
        header, unverified = _read(token)
        algorithm = header.get("alg")
        if not isinstance(algorithm, str) or algorithm not in ALLOWED_ALGORITHMS:
            allowed = ", ".join(ALLOWED_ALGORITHMS)
            raise TokenRefused(f"algorithm {_quote(algorithm)} is not allowed (allowed: {allowed})")
        if "crit" in header:
            raise TokenRefused("the token's header has critical extensions (crit), which are not understood here")
        self._check_issuer(unverified)
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise TokenRefused("malformed token: its key id (kid) is not a string")
        try:
            key = await self.keys.key(kid)
        except UnknownSigningKey as error:
            raise TokenRefused(str(error)) from None
        _check_key_fits(key, algorithm)
        try:
            claims = jwt.decode(token, key, algorithms=[algorithm]).claims
        except BadSignatureError:
            raise TokenRefused("signature does not verify") from None
        except JoseError:
            raise TokenRefused("malformed token") from None
        self._check_issuer(claims)
        self._check_audience(claims)
        expires_at = self._check_times(claims)
        return OperatorIdentity(
            subject=_subject(claims),
            groups=_groups(claims),
            issuer=self.issuer,
            verified_by=VERIFIED_BY_OIDC,
            expires_at=expires_at,
            client_id=_client_id(claims),
        )

    def _check_issuer(self, claims: dict[str, Any]) -> None:
        issuer = claims.get("iss")
        if issuer != self.issuer:
            raise TokenRefused(f"issuer {_quote(issuer)} is not {self.issuer!r}")

    def _check_audience(self, claims: dict[str, Any]) -> None:
        audience = claims.get("aud")
        if audience == self.audience:
            return
        if isinstance(audience, list) and self.audience in audience:
            return
        if isinstance(audience, list):
            raise TokenRefused(f"audience {_quote(audience)} does not include {self.audience!r}")
        raise TokenRefused(f"audience {_quote(audience)} is not {self.audience!r}")

    def _check_times(self, claims: dict[str, Any]) -> datetime:
        now = self._clock()
        expires = claims.get("exp")
        if not _is_time(expires):
            raise TokenRefused("the token has no expiry time (exp)")
        if now > expires + self.leeway:
            raise TokenRefused(f"token expired at {_when(expires)}")
        not_before = claims.get("nbf")
        if not_before is not None and (not _is_time(not_before) or now + self.leeway < not_before):
            raise TokenRefused(f"token is not valid before {_when(not_before)}")
        issued = claims.get("iat")
        if issued is not None and (not _is_time(issued) or now + self.leeway < issued):
            raise TokenRefused(f"token was issued in the future, at {_when(issued)}")
        return datetime.fromtimestamp(expires, UTC)


def _read(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and the claims of a token, unverified: for choosing the key and refusing early, never trusted."""
    if not isinstance(token, str) or not token:
        raise TokenRefused("malformed token: empty")
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenRefused(f"malformed token: longer than {MAX_TOKEN_CHARS} characters")
    try:
        signed = jws.extract_compact(token.encode("ascii"))
        claims = json.loads(signed.payload)
    except (JoseError, ValueError, UnicodeError):
        raise TokenRefused("malformed token") from None
    if not isinstance(claims, dict):
        raise TokenRefused("malformed token: its claims are not a JSON object")
    return dict(signed.headers()), claims


def _check_key_fits(key: Key, algorithm: str) -> None:
    """Refuse a key of another kind than the algorithm's, or published for another algorithm."""
    if key.key_type != ALLOWED_ALGORITHMS[algorithm]:
        raise TokenRefused(f"the token's algorithm {algorithm} does not fit the issuer's {key.key_type} key")
    if key.alg is not None and key.alg != algorithm:
        raise TokenRefused(f"the token's algorithm {algorithm} is not the {key.alg} its key is published for")


def _subject(claims: dict[str, Any]) -> str:
    subject = claims.get("sub")
    if not isinstance(subject, str) or not subject.strip() or len(subject) > 255 or not subject.isprintable():
        raise TokenRefused("the token names no subject (sub) of 1 to 255 printable characters")
    return subject


def _client_id(claims: dict[str, Any]) -> str | None:
    """The client the token was issued to: client_id (RFC 9068), or azp where an issuer puts it there."""
    for name in ("client_id", "azp"):
        value = claims.get(name)
        if isinstance(value, str) and value:
            return value[:255]
    return None


def _groups(claims: dict[str, Any]) -> tuple[str, ...]:
    groups = claims.get("groups", [])
    if isinstance(groups, str):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(group, str) for group in groups):
        raise TokenRefused("the token's groups claim is not a list of names")
    return tuple(groups)


def _is_time(value: object) -> TypeGuard[float]:
    """Whether a claim is a time: seconds since 1970, finite (JSON as Python reads it allows NaN and Infinity,
    which pass or fail every comparison) and before the year 4000."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < LATEST_TIME


def _when(value: object) -> str:
    """A claimed time as an operator reads it (UTC), or the claim itself cut short when it is no time."""
    if _is_time(value):
        try:
            return datetime.fromtimestamp(value, UTC).isoformat(timespec="seconds")
        except (OverflowError, OSError, ValueError):
            pass
    return _quote(value)


def _quote(value: object) -> str:
    """A value read from a token, quoted and cut short: it is the sender's text, not ours."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
