"""An OIDC issuer as Shepherd reads it: its discovery document, and JSON fetched from it with bounded size and time.

Both the token verification (foundation/operator_tokens.py, which needs the issuer's keys) and `shepherd login`
(foundation/oidc_client.py, which needs its device and token endpoints) start here. A document is read only from
an https:// URL (http:// only on loopback), and the issuer it names must be the configured one, character for
character (OpenID Connect Discovery 1.0, section 4.3): a document that names another issuer is an impostor's or
a misconfiguration, and neither may choose the keys Shepherd trusts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from foundation.setting_values import https_url_problem

# Far above any real discovery document or key set, far below what would hurt to hold.
MAX_DOCUMENT_BYTES = 1 << 20
DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


class IssuerUnavailable(Exception):
    """The issuer could not be asked, or answered with something that is not what it should publish: a failure of
    the issuer (or of the path to it), not of the token or the operator. Worth trying again later; str() says
    what failed."""


@dataclass(frozen=True)
class IssuerMetadata:
    """What Shepherd uses of an issuer's discovery document: where its keys are, and its endpoints for clients."""

    issuer: str
    jwks_uri: str
    token_endpoint: str | None = None
    device_authorization_endpoint: str | None = None
    revocation_endpoint: str | None = None


def discovery_url(issuer: str) -> str:
    """Where the issuer publishes its discovery document."""
    return issuer.rstrip("/") + "/.well-known/openid-configuration"


async def fetch_json(session: aiohttp.ClientSession, url: str, *, what: str) -> dict[str, Any]:
    """The JSON object at url; IssuerUnavailable naming what (such as "the issuer's keys") when it cannot be had."""
    problem = https_url_problem(url)
    if problem is not None:
        raise IssuerUnavailable(f"{what}: the URL {problem}")
    try:
        async with session.get(url, headers={"Accept": "application/json"}) as response:
            body = await response.content.read(MAX_DOCUMENT_BYTES + 1)
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as error:
        raise IssuerUnavailable(f"{what} could not be fetched from {url}: {describe_error(error)}") from None
    if status != 200:
        raise IssuerUnavailable(f"{what} could not be fetched from {url}: HTTP {status}")
    if len(body) > MAX_DOCUMENT_BYTES:
        raise IssuerUnavailable(f"{what} at {url} is larger than {MAX_DOCUMENT_BYTES} bytes")
    try:
        document = json.loads(body)
    except ValueError:
        raise IssuerUnavailable(f"{what} at {url} is not JSON") from None
    if not isinstance(document, dict):
        raise IssuerUnavailable(f"{what} at {url} is not a JSON object")
    return document


async def fetch_metadata(session: aiohttp.ClientSession, issuer: str) -> IssuerMetadata:
    """The issuer's discovery document, checked to name this issuer; IssuerUnavailable when it cannot be had."""
    url = discovery_url(issuer)
    document = await fetch_json(session, url, what="the issuer's discovery document")
    if document.get("issuer") != issuer:
        named = str(document.get("issuer"))[:200]
        raise IssuerUnavailable(f"the discovery document at {url} names the issuer {named!r}, not {issuer!r}")
    endpoints: dict[str, str | None] = {}
    for name in ("jwks_uri", "token_endpoint", "device_authorization_endpoint", "revocation_endpoint"):
        value = document.get(name)
        if value is None and name != "jwks_uri":
            endpoints[name] = None
            continue
        if not isinstance(value, str) or https_url_problem(value) is not None:
            raise IssuerUnavailable(f"the discovery document at {url} has no usable {name}: {str(value)[:200]!r}")
        endpoints[name] = value
    return IssuerMetadata(
        issuer=issuer,
        jwks_uri=str(endpoints["jwks_uri"]),
        token_endpoint=endpoints["token_endpoint"],
        device_authorization_endpoint=endpoints["device_authorization_endpoint"],
        revocation_endpoint=endpoints["revocation_endpoint"],
    )


def describe_error(error: BaseException) -> str:
    """A network error in a few words: its own text, or its kind when it has none (a timeout has none)."""
    text = str(error).strip()
    if isinstance(error, TimeoutError) and not text:
        return "no answer in time"
    return text or type(error).__name__
