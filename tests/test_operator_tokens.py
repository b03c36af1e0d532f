"""Operators' bearer tokens checked against a real OIDC provider: its tokens accepted, every forgery refused by name."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from joserfc import jwt
from joserfc.jwk import ECKey, Key, RSAKey

from foundation.oidc_client import OidcClient
from foundation.operator_tokens import IssuerUnavailable, TokenRefused, TokenVerifier
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from tests.oidc_fixtures import (
    CI_CLIENT,
    CI_CLIENT_BRIEF,
    CI_GROUPS,
    CLI_CLIENT,
    OTHER_AUDIENCE,
    OidcProvider,
    foreign_oidc_fixture,  # noqa: F401
    oidc_fixture,  # noqa: F401
)
from tests.sshd_fixtures import free_port


@pytest.fixture(name="verifier")
async def verifier_fixture(oidc: OidcProvider):
    async with TokenVerifier(oidc.issuer, oidc.audience) as verifier:
        yield verifier


async def refused(verifier: TokenVerifier, token: str) -> str:
    """Why the verifier refuses the token; the reason must not quote the token or its signature."""
    with pytest.raises(TokenRefused) as caught:
        await verifier.verify(token)
    reason = str(caught.value)
    signature = token.rsplit(".", 1)[-1]
    assert not token or token not in reason
    assert not signature or signature not in reason
    return reason


def provider_key(oidc: OidcProvider, key_type: str) -> Key:
    return next(key for key in oidc.signing_keys.keys if key.key_type == key_type)


def provider_rsa_key(oidc: OidcProvider) -> RSAKey:
    key = provider_key(oidc, "RSA")
    assert isinstance(key, RSAKey)
    return key


def claims(oidc: OidcProvider, **changes: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": oidc.issuer, "aud": oidc.audience, "sub": "mallory", "iat": now, "exp": now + 300, **changes}


def signed(key: Key, payload: dict[str, Any], alg: str = "ES256", **header: Any) -> str:
    return jwt.encode({"alg": alg, "kid": key.kid, **header}, payload, key, algorithms=[alg])


def segment(document: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(document).encode()).rstrip(b"=").decode()


def payload_of(token: str) -> dict[str, Any]:
    part = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))))


async def test_a_token_from_client_credentials_is_accepted(oidc, verifier):
    identity = await verifier.verify(await oidc.access_token(CI_CLIENT))
    assert identity.subject == CI_CLIENT and identity.client_id == CI_CLIENT
    assert identity.groups == tuple(CI_GROUPS)
    assert identity.issuer == oidc.issuer and identity.verified_by == "oidc"
    assert 0 < identity.expires_at.timestamp() - time.time() <= 600


async def test_a_token_from_the_device_flow_is_accepted(oidc, verifier):
    async with OidcClient(oidc.issuer, CLI_CLIENT, oidc.audience) as client:
        login = await client.start_device_login()
        await oidc.approve_device_login(login.user_code, "bob")
        tokens = await client.wait_for_tokens(login)
    identity = await verifier.verify(tokens.access_token)
    assert (identity.subject, identity.groups) == ("bob", tuple(oidc.user("bob").groups))
    assert identity.client_id == CLI_CLIENT and identity.verified_by == "oidc"


async def test_an_expired_token_is_refused_past_the_leeway(oidc):
    token = await oidc.access_token(CI_CLIENT_BRIEF)  # good for one second
    expires = payload_of(token)["exp"]
    await asyncio.sleep(max(0.0, expires - time.time()) + 0.2)
    async with TokenVerifier(oidc.issuer, oidc.audience) as lenient:
        assert (await lenient.verify(token)).subject == CI_CLIENT_BRIEF  # within the default leeway
    async with TokenVerifier(oidc.issuer, oidc.audience, leeway=0) as strict:
        reason = await refused(strict, token)
    assert reason.startswith("token expired at 20") and reason.endswith("+00:00")


async def test_a_token_of_another_issuer_is_refused_without_asking_for_keys(oidc, foreign_oidc, verifier):
    token = await foreign_oidc.access_token(CI_CLIENT)
    assert await refused(verifier, token) == f"issuer {foreign_oidc.issuer!r} is not {oidc.issuer!r}"
    assert verifier.keys.fetches == 0


async def test_a_token_for_another_service_is_refused(oidc, verifier):
    answer = await oidc.client_credentials(CI_CLIENT, resource=OTHER_AUDIENCE)
    reason = await refused(verifier, answer["access_token"])
    assert reason == f"audience {OTHER_AUDIENCE!r} is not {oidc.audience!r}"
    listed = signed(provider_key(oidc, "EC"), claims(oidc, aud=[OTHER_AUDIENCE, "https://else.test"]))
    assert "does not include" in await refused(verifier, listed)
    both = signed(provider_key(oidc, "EC"), claims(oidc, aud=[OTHER_AUDIENCE, oidc.audience]))
    assert (await verifier.verify(both)).subject == "mallory"


async def test_a_tampered_token_is_refused(oidc, verifier):
    token = await oidc.access_token(CI_CLIENT)
    header, _, signature = token.split(".")
    raised = {**payload_of(token), "sub": "alice", "groups": ["shepherd-admins"]}
    assert await refused(verifier, f"{header}.{segment(raised)}.{signature}") == "signature does not verify"


async def test_unsigned_and_hmac_tokens_are_refused(oidc, verifier):
    payload = claims(oidc)
    none = f"{segment({'alg': 'none', 'typ': 'JWT'})}.{segment(payload)}."
    assert (await refused(verifier, none)).startswith("algorithm 'none' is not allowed")
    # HS256 keyed with the issuer's public key, which anyone can read from its key set (joserfc itself will not
    # sign so: made by hand, as a forger would).
    public = provider_rsa_key(oidc)
    signing_input = f"{segment({'alg': 'HS256', 'kid': public.kid})}.{segment(payload)}"
    mac = hmac.digest(public.as_pem(private=False), signing_input.encode(), "sha256")
    forged = f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    assert (await refused(verifier, forged)).startswith("algorithm 'HS256' is not allowed")


async def test_a_token_signed_by_a_key_the_issuer_does_not_publish_is_refused(oidc, verifier):
    own = provider_key(oidc, "EC")
    stranger = ECKey.generate_key("P-256", {"kid": "made-up"})
    reason = await refused(verifier, signed(stranger, claims(oidc)))
    assert reason == "the issuer does not publish the signing key 'made-up' the token names"
    impostor = ECKey.generate_key("P-256", {"kid": str(own.kid)})  # the issuer's key id, another key
    assert await refused(verifier, signed(impostor, claims(oidc))) == "signature does not verify"
    # The RSA key is the issuer's, but for RS256 alone: a token of another algorithm cannot name it.
    rsa = provider_key(oidc, "RSA")
    mismatched = signed(own, claims(oidc), "ES256", kid=rsa.kid)
    assert await refused(verifier, mismatched) == "the token's algorithm ES256 does not fit the issuer's RSA key"
    unbound = RSAKey.import_key({name: value for name, value in rsa.as_dict(private=True).items() if name != "alg"})
    reason = await refused(verifier, signed(unbound, claims(oidc), "PS256"))
    assert reason == "the token's algorithm PS256 is not the RS256 its key is published for"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"exp": None}, "the token has no expiry time (exp)"),
        ({"exp": "tomorrow"}, "the token has no expiry time (exp)"),
        ({"exp": float("nan")}, "the token has no expiry time (exp)"),
        ({"exp": 1e300}, "the token has no expiry time (exp)"),
        ({"nbf": float("inf")}, "token is not valid before inf"),
        ({"nbf": 4102444800}, "token is not valid before 2100-01-01T00:00:00+00:00"),
        ({"iat": 4102444800}, "token was issued in the future, at 2100-01-01T00:00:00+00:00"),
        ({"sub": None}, "the token names no subject (sub) of 1 to 255 printable characters"),
        ({"sub": "alice\nroot"}, "the token names no subject (sub) of 1 to 255 printable characters"),
        ({"aud": None}, "audience None is not 'https://shepherd.test/api'"),
        ({"groups": {"admin": True}}, "the token's groups claim is not a list of names"),
    ],
)
async def test_claims_the_issuer_should_not_have_made_are_refused(oidc, verifier, changes, reason):
    payload = {name: value for name, value in claims(oidc, **changes).items() if value is not None}
    assert await refused(verifier, signed(provider_key(oidc, "EC"), payload)) == reason


@pytest.mark.parametrize(
    "token",
    [
        "",
        "not-a-token",
        "a.b.c",
        "e30.e30.",
        "eyJhbGciOiJFUzI1NiJ9.W10.c2ln",
        "eyJhbGciOlsiRVMyNTYiXX0.e30.c2ln",
        "x" * 20000,
    ],
)
async def test_malformed_tokens_are_refused(verifier, token):
    reason = await refused(verifier, token)
    assert reason.startswith(("malformed token", "algorithm None is not allowed", "algorithm ['ES256'] is not allowed"))


async def test_made_up_key_ids_make_one_fetch_of_the_keys_not_one_each(oidc):
    async with TokenVerifier(oidc.issuer, oidc.audience, refetch_interval=0.5) as verifier:
        await verifier.verify(await oidc.access_token(CI_CLIENT))
        assert verifier.keys.fetches == 1
        await asyncio.sleep(0.5)
        strangers = [signed(ECKey.generate_key("P-256", {"kid": f"flood-{n}"}), claims(oidc)) for n in range(20)]
        reasons = await asyncio.gather(*(refused(verifier, token) for token in strangers))
        assert all("does not publish the signing key" in reason for reason in reasons)
        assert verifier.keys.fetches == 2
        assert (await verifier.verify(await oidc.access_token(CI_CLIENT))).subject == CI_CLIENT


async def test_an_issuer_that_cannot_be_reached_is_a_distinct_error(oidc):
    issuer = f"http://127.0.0.1:{free_port()}"
    token = signed(provider_key(oidc, "EC"), claims(oidc, iss=issuer))
    async with TokenVerifier(issuer, oidc.audience) as verifier:
        with pytest.raises(IssuerUnavailable, match=f"discovery document could not be fetched from {issuer}"):
            await verifier.verify(token)


@pytest.mark.parametrize(
    ("issuer", "problem"),
    [
        ("http://idp.example.net", "must be an https:// URL (http:// only to a loopback address)"),
        ("ftp://idp.example.net", "must be an https:// URL"),
        ("https://idp.example.net/?tenant=1", "must have no query or fragment"),
        ("idp.example.net", "must be an https:// URL"),
    ],
)
def test_the_issuer_must_be_https_unless_on_loopback(issuer, problem):
    with pytest.raises(SettingsError, match="setting oidc_issuer") as caught:
        Settings(oidc_issuer=issuer, oidc_audience="https://shepherd.test/api").check()
    assert problem in str(caught.value)
    for good in (
        "https://idp.example.net/realms/ops",
        "http://127.0.0.1:8080",
        "http://localhost:8080",
        "http://[::1]",
    ):
        Settings(oidc_issuer=good, oidc_audience="https://shepherd.test/api").check()
    with pytest.raises(SettingsError, match="setting oidc_audience"):
        Settings(oidc_issuer="https://idp.example.net").check()


ISSUER = "<the provider's issuer>"  # put in by the test: a strategy cannot reach the fixture
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.just(ISSUER),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "alg": st.sampled_from(["ES256", "RS256", "PS256", "EdDSA", "HS256", "none", ""]) | JSON_VALUES,
        "kid": st.text(max_size=30) | JSON_VALUES,
        "typ": JSON_VALUES,
        "crit": JSON_VALUES,
    },
)
CLAIMS = st.fixed_dictionaries(
    {},
    optional={name: JSON_VALUES for name in ("iss", "aud", "sub", "exp", "nbf", "iat", "groups", "client_id")},
)


@settings(max_examples=150, deadline=None)
@given(header=HEADERS, payload=CLAIMS, signature=st.binary(max_size=96))
def test_any_token_is_refused_by_name_and_nothing_else(oidc, header, payload, signature):
    """Whatever a sender puts in a token's header, claims and signature, the verifier answers TokenRefused."""
    real = {name: oidc.issuer if value == ISSUER else value for name, value in {**header, **payload}.items()}
    header = {name: real[name] for name in header}
    payload = {name: real[name] for name in payload}
    if "kid" in header and isinstance(header["kid"], str) and header["kid"].startswith("ec"):
        header["kid"] = provider_key(oidc, "EC").kid  # now and then the issuer's own key
    token = f"{segment(header)}.{segment(payload)}.{base64.urlsafe_b64encode(signature).rstrip(b'=').decode()}"
    loop = asyncio.new_event_loop()
    try:
        verifier = TokenVerifier(oidc.issuer, oidc.audience)
        with pytest.raises(TokenRefused):
            loop.run_until_complete(asyncio.wait_for(verifier.verify(token), 10))
        loop.run_until_complete(verifier.close())
    finally:
        loop.close()
