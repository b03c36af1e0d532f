"""`shepherd login`'s side of OIDC: the device authorization grant (RFC 8628), refreshing tokens, and revoking them.

Shepherd's CLI is a public client (it can keep no secret on an operator's laptop), so it logs in with the device
flow: it asks the issuer for a device code and a user code, the operator opens the issuer's page in any browser,
enters the user code and logs in there, and the CLI meanwhile polls the token endpoint at the interval the issuer
asked for. It asks for the scopes openid and offline_access (a refresh token, so the login outlives the short
access tokens) and names the Shepherd API as the resource (RFC 8707), so the access tokens are for the API.

Every answer of the issuer that ends the wait is a LoginError saying what happened in the operator's words; an
issuer that cannot be asked is an IssuerUnavailable (foundation/oidc_issuer.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from foundation.oidc_issuer import (
    DEFAULT_TIMEOUT,
    MAX_DOCUMENT_BYTES,
    IssuerMetadata,
    IssuerUnavailable,
    describe_error,
    fetch_metadata,
)

DEVICE_CODE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
SCOPES = "openid offline_access"
# RFC 8628 section 3.2: the interval when the issuer names none, and what slow_down adds to it (section 3.5).
DEFAULT_INTERVAL = 5.0
SLOW_DOWN_STEP = 5.0


class LoginError(Exception):
    """The login (or a refresh) did not give tokens; str() says why, for the operator."""


@dataclass(frozen=True)
class DeviceLogin:
    """A device login under way: what the operator is shown, and what the CLI polls with."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None  # the page with the user code filled in, when the issuer offers one
    expires_at: float  # time.time() after which the codes are no good
    interval: float  # seconds between two polls


@dataclass(frozen=True)
class TokenSet:
    """Tokens the issuer gave: the access token for the API, until when it is good, and the refresh token."""

    access_token: str
    expires_at: float  # time.time() of the access token's expiry, as the issuer told it
    refresh_token: str | None


def wait_after(error: str, description: str, interval: float) -> float:
    """The interval to poll at after the token endpoint answered error to a device-code poll; LoginError when the
    answer ends the login."""
    if error == "authorization_pending":
        return interval
    if error == "slow_down":
        return interval + SLOW_DOWN_STEP
    if error == "expired_token":
        raise LoginError("the code expired before the login was approved; run shepherd login again")
    if error == "access_denied":
        raise LoginError("the login was denied at the issuer")
    raise LoginError(f"the issuer refused the login: {_issuer_words(error, description)}")


class OidcClient:
    """One public client at one issuer, asking for tokens for one audience; its HTTP session closes with it."""

    def __init__(self, issuer: str, client_id: str, audience: str, *, clock: Callable[[], float] = time.time) -> None:
        self.issuer, self.client_id, self.audience = issuer, client_id, audience
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._metadata: IssuerMetadata | None = None

    async def __aenter__(self) -> OidcClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=DEFAULT_TIMEOUT)
        return self._session

    async def metadata(self) -> IssuerMetadata:
        """The issuer's discovery document, fetched once."""
        if self._metadata is None:
            self._metadata = await fetch_metadata(self._http(), self.issuer)
        return self._metadata

    async def start_device_login(self) -> DeviceLogin:
        """Ask the issuer for a device code and the user code the operator enters."""
        endpoint = (await self.metadata()).device_authorization_endpoint
        if endpoint is None:
            raise LoginError(f"the issuer {self.issuer} offers no device login (no device_authorization_endpoint)")
        form = {"client_id": self.client_id, "scope": SCOPES, "resource": self.audience}
        status, answer = await self._post(endpoint, form)
        if status != 200:
            raise LoginError(f"the issuer refused to start a device login: {_error_words(answer)}")
        try:
            return DeviceLogin(
                device_code=_text(answer, "device_code"),
                user_code=_text(answer, "user_code"),
                verification_uri=_text(answer, "verification_uri"),
                verification_uri_complete=answer.get("verification_uri_complete")
                if isinstance(answer.get("verification_uri_complete"), str)
                else None,
                expires_at=self._clock() + _seconds(answer, "expires_in"),
                interval=_seconds(answer, "interval") if "interval" in answer else DEFAULT_INTERVAL,
            )
        except ValueError as error:
            raise LoginError(f"the issuer's device login answer is not usable: {error}") from None

    async def wait_for_tokens(self, login: DeviceLogin) -> TokenSet:
        """Poll the token endpoint until the operator approved the login (tokens) or it ended (LoginError)."""
        interval = login.interval
        while True:
            form = {"grant_type": DEVICE_CODE_GRANT, "device_code": login.device_code, "client_id": self.client_id}
            status, answer = await self._post(await self._token_endpoint(), form)
            if status == 200:
                return self._tokens(answer, None)
            error = answer.get("error")
            if not isinstance(error, str):
                raise LoginError(f"the issuer answered the poll with HTTP {status} and no error code")
            interval = wait_after(error, str(answer.get("error_description", "")), interval)
            # The issuer says expired_token once the code is past; an interval after that, stop asking anyway.
            if self._clock() > login.expires_at + interval:
                raise LoginError("the code expired before the login was approved; run shepherd login again")
            await asyncio.sleep(interval)

    async def refresh(self, refresh_token: str) -> TokenSet:
        """New tokens for the refresh token; LoginError when the issuer refuses it (the login is over)."""
        form = {
            "grant_type": "refresh_token",
            "refresh_token": refresh_token,
            "client_id": self.client_id,
            "resource": self.audience,
        }
        status, answer = await self._post(await self._token_endpoint(), form)
        if status != 200:
            raise LoginError(f"the issuer refused to refresh the login: {_error_words(answer)}")
        return self._tokens(answer, refresh_token)

    async def revoke(self, refresh_token: str) -> bool:
        """Ask the issuer to forget the refresh token (RFC 7009); whether it offers revocation and took it."""
        endpoint = (await self.metadata()).revocation_endpoint
        if endpoint is None:
            return False
        form = {"token": refresh_token, "token_type_hint": "refresh_token", "client_id": self.client_id}
        status, _ = await self._post(endpoint, form)
        return status == 200

    async def _token_endpoint(self) -> str:
        endpoint = (await self.metadata()).token_endpoint
        if endpoint is None:
            raise LoginError(f"the issuer {self.issuer} publishes no token_endpoint")
        return endpoint

    def _tokens(self, answer: dict[str, Any], refresh_token: str | None) -> TokenSet:
        try:
            access_token = _text(answer, "access_token")
            expires_in = _seconds(answer, "expires_in")
        except ValueError as error:
            raise LoginError(f"the issuer's token answer is not usable: {error}") from None
        # An issuer that rotates refresh tokens sends a new one; one that does not keeps the old one good.
        rotated = answer.get("refresh_token")
        return TokenSet(
            access_token=access_token,
            expires_at=self._clock() + expires_in,
            refresh_token=rotated if isinstance(rotated, str) and rotated else refresh_token,
        )

    async def _post(self, url: str, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON object) of a form POST to the issuer; IssuerUnavailable when it cannot be asked or
        answers with no JSON object (a 5xx page, a proxy's)."""
        try:
            async with self._http().post(url, data=form, headers={"Accept": "application/json"}) as response:
                body = await response.content.read(MAX_DOCUMENT_BYTES + 1)
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise IssuerUnavailable(f"the issuer could not be asked at {url}: {describe_error(error)}") from None
        if not body.strip() and 200 <= status < 300:
            return status, {}  # a revocation's answer: HTTP 200 and nothing more
        try:
            answer = _json_object(body)
        except ValueError:
            raise IssuerUnavailable(f"the issuer answered HTTP {status} at {url}, without a JSON object") from None
        return status, answer


def _json_object(body: bytes) -> dict[str, Any]:
    document = json.loads(body) if len(body) <= MAX_DOCUMENT_BYTES else None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    return document


def _text(answer: dict[str, Any], name: str) -> str:
    value = answer.get(name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"it has no {name}")
    return value


def _seconds(answer: dict[str, Any], name: str) -> float:
    value = answer.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 10**7:
        raise ValueError(f"its {name} is not a number of seconds: {str(value)[:40]!r}")
    return float(value)


def _error_words(answer: dict[str, Any]) -> str:
    return _issuer_words(str(answer.get("error", "no error code")), str(answer.get("error_description", "")))


def _issuer_words(error: str, description: str) -> str:
    """The issuer's error code and description, cut to one short line: its text, not ours."""
    words = f"{error}: {description}" if description else error
    words = "".join(char if char.isprintable() else " " for char in words)
    return words if len(words) <= 200 else words[:197] + "..."
