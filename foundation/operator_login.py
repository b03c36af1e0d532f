"""An operator's login at the OIDC issuer, as `shepherd login` makes it and every client of the operator API uses it.

log_in() runs the device flow (foundation/oidc_client.py), checks the access token it gives as the API will
(foundation/operator_tokens.py: a login whose tokens the API would refuse fails here, saying why, not at the
first request) and keeps the tokens (foundation/login_tokens.py). access_token() is what a client of the API
calls before each request: the kept access token, or a new one through the refresh token once it expires within
REFRESH_MARGIN. log_out() forgets the tokens and asks the issuer to revoke the refresh token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from foundation.login_tokens import (
    CachedLogin,
    TokenCacheError,
    forget_login,
    load_login,
    refresh_turn,
    save_login,
    tokens_path,
)
from foundation.oidc_client import DeviceLogin, LoginError, OidcClient
from foundation.oidc_issuer import IssuerUnavailable
from foundation.operator_tokens import TokenRefused, TokenVerifier
from foundation.settings import Settings

# An access token this close to its expiry is renewed before use: a request must not reach the API expired.
REFRESH_MARGIN = 60.0


class NotLoggedIn(LoginError):
    """There is no usable login for these settings; str() says why and that `shepherd login` makes one."""


def _client(settings: Settings) -> OidcClient:
    return OidcClient(settings.oidc_issuer, settings.oidc_client_id, settings.oidc_audience)


async def log_in(settings: Settings, show: Callable[[DeviceLogin], None], *, path: Path | None = None) -> CachedLogin:
    """Log the operator in through the device flow: show(login) tells them where to go and which code to enter;
    the login once they approved it, kept. LoginError when it ends otherwise, IssuerUnavailable when the issuer
    cannot be asked."""
    async with _client(settings) as client:
        device = await client.start_device_login()
        show(device)
        tokens = await client.wait_for_tokens(device)
    async with TokenVerifier(settings.oidc_issuer, settings.oidc_audience) as verifier:
        try:
            identity = await verifier.verify(tokens.access_token)
        except TokenRefused as error:
            raise LoginError(f"the issuer's access token is not one the operator API accepts: {error}") from None
    login = CachedLogin(
        issuer=settings.oidc_issuer,
        client_id=settings.oidc_client_id,
        audience=settings.oidc_audience,
        subject=identity.subject,
        groups=identity.groups,
        access_token=tokens.access_token,
        expires_at=tokens.expires_at,
        refresh_token=tokens.refresh_token,
    )
    save_login(path or tokens_path(), login)
    return login


def current_login(settings: Settings, *, path: Path | None = None) -> CachedLogin:
    """The kept login for these settings' issuer, client and API; NotLoggedIn when there is none."""
    login = load_login(path or tokens_path())
    if login is None:
        raise NotLoggedIn(f"not logged in at {settings.oidc_issuer}; run shepherd login")
    if not login.is_for(settings.oidc_issuer, settings.oidc_client_id, settings.oidc_audience):
        raise NotLoggedIn(
            f"logged in at {login.issuer} (client {login.client_id}, audience {login.audience}), not at the "
            f"configured {settings.oidc_issuer} (client {settings.oidc_client_id}, audience "
            f"{settings.oidc_audience}); run shepherd login"
        )
    return login


async def access_token(settings: Settings, *, path: Path | None = None, margin: float = REFRESH_MARGIN) -> str:
    """A valid access token of the logged-in operator for the operator API, refreshed when it expires within
    margin. NotLoggedIn when there is no login or it has ended (the refresh token was refused, and forgotten),
    IssuerUnavailable when the issuer cannot be asked for a refresh, TokenCacheError when the tokens file cannot
    be used (others may read it)."""
    path = path or tokens_path()
    login = current_login(settings, path=path)
    if login.expires_at - margin > time.time():
        return login.access_token
    async with refresh_turn(path):
        # Another process may have refreshed while this one waited for its turn.
        login = current_login(settings, path=path)
        if login.expires_at - margin > time.time():
            return login.access_token
        if login.refresh_token is None:
            raise NotLoggedIn(f"the login at {login.issuer} has expired and holds no refresh token; run shepherd login")
        async with _client(settings) as client:
            try:
                tokens = await client.refresh(login.refresh_token)
            except LoginError as error:  # refused: an issuer that cannot be asked (IssuerUnavailable) ends nothing
                forget_login(path)
                raise NotLoggedIn(f"the login at {login.issuer} has ended ({error}); run shepherd login") from None
        renewed = replace(
            login, access_token=tokens.access_token, expires_at=tokens.expires_at, refresh_token=tokens.refresh_token
        )
        save_login(path, renewed)
        return renewed.access_token


@dataclass(frozen=True)
class Logout:
    """What log_out did: the login it forgot (None when the file could not be read), whether there was a tokens
    file to remove, and whether the issuer took the revocation of the refresh token."""

    login: CachedLogin | None
    removed: bool
    revoked: bool


async def log_out(*, path: Path | None = None) -> Logout:
    """Forget the kept login, and ask its issuer to revoke its refresh token. The file goes even when it cannot be
    read (its mode let others read it: all the more reason) or the issuer cannot be asked."""
    path = path or tokens_path()
    try:
        login = load_login(path)
    except TokenCacheError:
        login = None
    removed = forget_login(path)
    if login is None or login.refresh_token is None:
        return Logout(login, removed, revoked=False)
    try:
        async with OidcClient(login.issuer, login.client_id, login.audience) as client:
            revoked = await client.revoke(login.refresh_token)
    except (IssuerUnavailable, LoginError):
        revoked = False
    return Logout(login, removed, revoked)
