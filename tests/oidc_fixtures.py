"""A real OpenID Connect provider: oidc-provider (npm) on Node, started by the tests, with users and clients.

Import the fixtures into a test module to use them: ``from tests.oidc_fixtures import oidc_fixture  # noqa: F401``;
tests then take an ``oidc`` argument (``foreign_oidc``: a second provider, another issuer with keys of its own).
Each provider is started once per session on a free loopback port with signing keys made for that session (an
RSA key for ID tokens, an EC key for access tokens); tests/oidc/provider.mjs configures it from the file written
here. Its packages are installed by ``npm ci --prefix tests/oidc`` (.ci/run and the README's test command).

What the provider has:

- the Shepherd API as a resource (AUDIENCE): access tokens for it are JWTs with ``aud`` = AUDIENCE and the
  ``groups`` of their user or client; and another service's API (OTHER_AUDIENCE), whose tokens are alike;
- users (USERS) with passwords unique to the session and groups, who log in on the provider's own pages;
- confidential clients for client credentials (a CI tool), one of whose tokens live a second;
- public clients for the device flow with refresh tokens (`shepherd login`), one whose access tokens live a few
  seconds (always due for a refresh), one whose device codes expire after two seconds.

approve_device_login() plays the user's part of the device flow over HTTP: the device page, the user code, the
login, and the consent given or denied.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from joserfc.jwk import ECKey, KeySet, RSAKey

from tests.sshd_fixtures import free_port

PROVIDER_DIR = Path(__file__).parent / "oidc"
SCRIPT = PROVIDER_DIR / "provider.mjs"
START_TIMEOUT = 30.0
AUDIENCE = "https://shepherd.test/api"
OTHER_AUDIENCE = "https://inventory.test/api"  # another service's API at the same issuer
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"

# The public client of `shepherd login`, and its variants with short lifetimes.
CLI_CLIENT = "shepherd-cli"
CLI_CLIENT_BRIEF_TOKENS = "shepherd-cli-brief-tokens"  # access tokens of 5 s: always within a refresh margin
CLI_CLIENT_BRIEF_CODES = "shepherd-cli-brief-codes"  # device codes of 2 s
# Confidential clients that act for themselves (client credentials).
CI_CLIENT = "shepherd-ci"
CI_CLIENT_BRIEF = "shepherd-ci-brief"  # access tokens of 1 s
CI_GROUPS = ["shepherd-automation"]


@dataclass(frozen=True)
class TestUser:
    name: str
    password: str
    groups: list[str]


@dataclass
class OidcProvider:
    issuer: str
    audience: str
    users: dict[str, TestUser]
    secrets: dict[str, str]  # confidential client id -> its secret
    signing_keys: KeySet  # the provider's private keys, for tests that sign tokens of their own
    log: Path
    process: subprocess.Popen[bytes]

    def user(self, name: str) -> TestUser:
        return self.users[name]

    async def client_credentials(self, client_id: str = CI_CLIENT, **extra: str) -> dict[str, Any]:
        """The token answer to a client credentials grant of the confidential client, for the Shepherd API."""
        form = {"grant_type": "client_credentials", "resource": self.audience, **extra}
        headers = {"Authorization": aiohttp.encode_basic_auth(client_id, self.secrets[client_id])}
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.post(f"{self.issuer}/token", data=form) as r,
        ):
            answer = await r.json()
            if r.status != 200:
                raise AssertionError(f"client credentials of {client_id}: HTTP {r.status}: {answer}")
            return dict(answer)

    async def access_token(self, client_id: str = CI_CLIENT) -> str:
        """An access token for the Shepherd API from client credentials."""
        return str((await self.client_credentials(client_id))["access_token"])

    async def approve_device_login(self, user_code: str, user: str, *, consent: bool = True) -> str:
        """Do what the user does in a browser for a device login: open the device page, enter the user code and
        confirm it, log in as user, then allow (or deny) what the client asked for. The text of the last page."""
        jar = aiohttp.CookieJar(unsafe=True)  # the provider is on an IP address, whose cookies aiohttp drops
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:
            page = await _get(browser, f"{self.issuer}/device")
            xsrf = _field(page, "xsrf")
            page = await _post(browser, f"{self.issuer}/device", {"xsrf": xsrf, "user_code": user_code})
            confirm = {name: _field(page, name) for name in ("xsrf", "user_code", "confirm")}
            page = await _post(browser, f"{self.issuer}/device", confirm)
            login = _action(page, "login")
            secret = self.users[user].password
            page = await _post(browser, self.issuer + login, {"login": user, "password": secret})
            page = await _post(browser, self.issuer + _action(page, "confirm" if consent else "abort"), {})
            return page


async def _get(browser: aiohttp.ClientSession, url: str) -> str:
    async with browser.get(url) as response:
        return await _page(response)


async def _post(browser: aiohttp.ClientSession, url: str, form: dict[str, str]) -> str:
    async with browser.post(url, data=form) as response:
        return await _page(response)


async def _page(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    if response.status >= 400:
        raise AssertionError(f"{response.method} {response.url}: HTTP {response.status}: {text[:500]}")
    return text


def _field(page: str, name: str) -> str:
    """The value of the form field of that name on the page."""
    match = re.search(rf'name="{name}" value="([^"]*)"', page)
    if not match:
        raise AssertionError(f"no field {name!r} on the page: {page[:800]}")
    return match.group(1)


def _action(page: str, action: str) -> str:
    """The path of the page's form that posts to .../action."""
    match = re.search(rf'action="(/interaction/[\w-]+/{action})"', page)
    if not match:
        raise AssertionError(f"no form for {action!r} on the page: {page[:800]}")
    return match.group(1)


def make_signing_keys() -> KeySet:
    """A fresh RSA key (ID tokens, RS256) and EC key (access tokens, ES256), each with a key id of its own."""
    rsa = RSAKey.generate_key(2048, {"kid": f"rsa-{secrets.token_hex(6)}", "use": "sig", "alg": "RS256"})
    ec = ECKey.generate_key("P-256", {"kid": f"ec-{secrets.token_hex(6)}", "use": "sig", "alg": "ES256"})
    return KeySet([rsa, ec])


def provider_config(issuer: str, port: int, keys: KeySet, users: dict[str, TestUser], secrets_: dict[str, str]):
    public = {"token_endpoint_auth_method": "none", "response_types": [], "redirect_uris": []}
    device = {**public, "grant_types": [DEVICE_GRANT, "refresh_token"]}
    confidential = {"grant_types": ["client_credentials"], "response_types": [], "redirect_uris": []}
    return {
        "issuer": issuer,
        "port": port,
        "jwks": {"keys": [key.as_dict(private=True) for key in keys.keys]},
        "cookieKeys": [secrets.token_hex(32)],
        "audience": AUDIENCE,
        "resources": [AUDIENCE, OTHER_AUDIENCE],
        "accessTokenAlg": "ES256",
        # Real providers ask for 5 s; one second keeps the tests short and still shows the interval is kept.
        "deviceInterval": 1,
        "users": {name: {"password": user.password, "groups": user.groups} for name, user in users.items()},
        "clients": [
            {"client_id": CLI_CLIENT, **device},
            {"client_id": CLI_CLIENT_BRIEF_TOKENS, **device, "lifetimes": {"AccessToken": 5}},
            {"client_id": CLI_CLIENT_BRIEF_CODES, **device, "lifetimes": {"DeviceCode": 2}},
            {"client_id": CI_CLIENT, "client_secret": secrets_[CI_CLIENT], **confidential, "groups": CI_GROUPS},
            {
                "client_id": CI_CLIENT_BRIEF,
                "client_secret": secrets_[CI_CLIENT_BRIEF],
                **confidential,
                "groups": CI_GROUPS,
                "lifetimes": {"ClientCredentials": 1},
            },
        ],
    }


def wait_until_answering(provider: OidcProvider) -> None:
    """Return once the provider serves its discovery document; RuntimeError with its log if it died or took too
    long."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            if requests.get(f"{provider.issuer}/.well-known/openid-configuration", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        if provider.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"oidc-provider did not answer at {provider.issuer}: {provider.log.read_text()[-3000:]}")
        time.sleep(0.05)


@contextlib.contextmanager
def running_provider(directory: Path) -> Iterator[OidcProvider]:
    """oidc-provider on a free loopback port with fresh keys, users and clients, stopped on exit."""
    node = shutil.which("node")
    if node is None or not (PROVIDER_DIR / "node_modules" / "oidc-provider").is_dir():
        raise RuntimeError(f"the test OIDC provider needs Node and its packages: run npm ci --prefix {PROVIDER_DIR}")
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    keys = make_signing_keys()
    users = {
        "alice": TestUser("alice", secrets.token_urlsafe(12), ["shepherd-admins"]),
        "bob": TestUser("bob", secrets.token_urlsafe(12), ["shepherd-viewers", "rack1-operators"]),
    }
    client_secrets = {CI_CLIENT: secrets.token_urlsafe(32), CI_CLIENT_BRIEF: secrets.token_urlsafe(32)}
    config = directory / "provider.json"
    # It holds the provider's private keys and every password: for this user alone.
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(provider_config(issuer, port, keys, users, client_secrets), file)
    log = directory / "provider.log"
    with log.open("ab") as output:
        # A session of its own, stopped as one group with whatever it starts.
        process = subprocess.Popen(
            [node, str(SCRIPT), str(config)], stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    provider = OidcProvider(issuer, AUDIENCE, users, client_secrets, keys, log, process)
    try:
        wait_until_answering(provider)
        yield provider
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session", name="oidc")
def oidc_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    with running_provider(tmp_path_factory.mktemp("oidc")) as provider:
        yield provider


@pytest.fixture(scope="session", name="foreign_oidc")
def foreign_oidc_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    with running_provider(tmp_path_factory.mktemp("foreign-oidc")) as provider:
        yield provider
