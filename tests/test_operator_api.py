"""The operator API: verified operators read machines and ask for actions over HTTP, as the policy allows; on a
real OIDC provider, a real simulated fleet with its worker, Temporal and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from pathlib import Path
from typing import Any

import aiohttp
from joserfc import jwt

from foundation.operator_proof import public_key_text
from foundation.operator_tokens import TokenVerifier
from lifecycle.contracts import MachineStage
from processes.api_signing_key import load_signing_key
from processes.operator_api_routes import ROUTES
from tests.fleet_stack import fleet_stack
from tests.oidc_fixtures import (  # noqa: F401
    CI_CLIENT,
    CI_CLIENT_BRIEF,
    OTHER_AUDIENCE,
    OidcProvider,
    oidc_fixture,
)
from tests.operator_api_fixtures import api_keys, start_api

POLICY = f"""
[roles]
viewer = ["read"]
operator = ["read", "maintenance", "restart-agent", "release", "decommission"]

[[grants]]
role = "operator"
subjects = ["{CI_CLIENT}"]
providers = ["sim"]

[[grants]]
role = "viewer"
groups = ["shepherd-viewers"]

[[grants]]
role = "operator"
subjects = ["olga"]

[confirmations]
second_person = ["decommission"]
typed = ["release"]
"""


def viewer_token(oidc: OidcProvider, **changes: Any) -> str:
    """An access token signed with the issuer's own key, for a viewer the provider has no client for."""
    key = next(key for key in oidc.signing_keys.keys if key.key_type == "EC")
    now = int(time.time())
    claims: dict[str, Any] = {"iss": oidc.issuer, "aud": oidc.audience, "sub": "vera", "groups": ["shepherd-viewers"]}
    claims |= {"iat": now, "exp": now + 300, **changes}
    return jwt.encode({"alg": "ES256", "kid": key.kid}, claims, key, algorithms=["ES256"])


async def call(
    http: aiohttp.ClientSession, base: str, method: str, path: str, token: str | None, body: Any = None
) -> tuple[int, Any, aiohttp.ClientResponse]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    async with http.request(method, base + path, headers=headers, data=data) as response:
        return response.status, await response.json(), response


async def test_verified_operators_read_and_act_as_the_policy_allows(
    tmp_path, temporal_client, bmdb_url, oidc, shepherd_cli
):
    signer, policy_path, keys = api_keys(tmp_path, POLICY)
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1, api_trusted_keys=keys) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        # No leeway, so a token a second old is expired.
        verifier = TokenVerifier(oidc.issuer, oidc.audience, leeway=0)
        api, server, base = await start_api(stack, oidc, signer, policy_path, bmdb_url, verifier=verifier)
        operator = await oidc.access_token(CI_CLIENT)
        viewer = viewer_token(oidc)
        try:
            async with aiohttp.ClientSession() as http:
                # Who: no token, another service's token, an expired one.
                status, body, response = await call(http, base, "GET", "/v1/machines", None)
                assert status == 401 and "no bearer token" in body["error"]
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
                other = (await oidc.client_credentials(CI_CLIENT, resource=OTHER_AUDIENCE))["access_token"]
                status, body, response = await call(http, base, "GET", "/v1/machines", other)
                assert status == 401 and body["error"].startswith("token refused: audience")
                assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
                brief = await oidc.access_token(CI_CLIENT_BRIEF)
                await asyncio.sleep(1.5)
                status, body, _ = await call(http, base, "GET", "/v1/machines", brief)
                assert status == 401 and "token expired at" in body["error"]

                # Reads: the same facts as `shepherd status --json` and `shepherd machines --json`.
                env = stack.environment(bmdb_url)
                code, out, _ = await shepherd_cli(env, "status", "node-0001", "--json")
                assert code == 0
                status, body, _ = await call(http, base, "GET", "/v1/machines/node-0001", viewer)
                assert status == 200 and body == json.loads(out)
                code, out, _ = await shepherd_cli(env, "machines", "--json")
                status, body, _ = await call(http, base, "GET", "/v1/machines", viewer)
                assert status == 200 and body == json.loads(out) and body[0]["provider_id"] == "node-0001"
                status, body, _ = await call(http, base, "GET", "/v1/machines/node-9999", viewer)
                assert status == 404 and "no machine 'node-9999'" in body["error"]

                # What: a viewer may not, an operator may, a decommission needs a second person.
                maintenance = {"on": True, "reason": "fans"}
                path = "/v1/machines/node-0001/maintenance"
                status, body, _ = await call(http, base, "POST", path, viewer, maintenance)
                assert status == 403
                assert body["error"].startswith("vera may not set maintenance of machines of provider sim")
                for bad, field in (
                    (b"{not json", "not JSON"),
                    ({"on": "yes", "reason": "fans"}, "field 'on' must be a boolean"),
                    ({"on": True}, "field 'reason' is missing"),
                    ({"on": True, "reason": "fans", "by": "mallory"}, "unknown field 'by'"),
                ):
                    status, body, _ = await call(http, base, "POST", path, operator, bad)
                    assert status == 400 and field in body["error"], body
                status, body, _ = await call(http, base, "POST", path, operator, b"x" * (65 * 1024))
                assert status == 413
                status, body, _ = await call(http, base, "POST", path, operator, maintenance)
                assert status == 200, body
                assert body["answer"].endswith("in maintenance (fans): never rebooted or taken over until it ends")
                machine = await stack.status("node-0001")
                assert machine.maintenance is not None
                assert machine.maintenance.by == f"{CI_CLIENT} (verified: oidc)"
                status, body, _ = await call(http, base, "POST", path, operator, maintenance)
                assert status == 409 and body["error"].startswith("machine-sim-node-0001: ")
                # A typed confirmation: the machine's name, typed back.
                release = "/v1/machines/node-0001/release"
                status, body, _ = await call(http, base, "POST", release, operator, {"reason": "mended"})
                assert (
                    status == 428 and body["error"] == 'release needs a typed confirmation: send "confirm": "node-0001"'
                )
                typed = {"reason": "mended", "confirm": "node-0001"}
                status, body, _ = await call(http, base, "POST", release, operator, typed)
                assert status == 409 and "not quarantined" in body["error"]

                # A second person: the request waits, is refused by one, asked again and approved by another.
                olga = viewer_token(oidc, sub="olga", groups=[])
                decommission = "/v1/machines/node-0001/decommission"
                lease = {"reason": "end of lease"}
                status, body, _ = await call(http, base, "POST", decommission, operator, lease)
                assert status == 202 and "waits for a second operator allowed to decommission" in body["answer"]
                first = body["approval"]["approval_id"]
                status, body, _ = await call(http, base, "GET", "/v1/approvals", viewer)
                assert status == 200 and [a["approval_id"] for a in body] == [first]
                assert body[0]["asked_by"] == f"{CI_CLIENT} (verified: oidc)" and body[0]["target"].endswith(
                    "node-0001"
                )
                status, body, _ = await call(http, base, "POST", f"/v1/approvals/{first}/refuse", olga)
                assert status == 200 and body["answer"].endswith("refused by olga, nothing done")
                # The machine is in maintenance: the decommission asks for force, kept with the approval.
                forced = lease | {"force": True}
                status, body, _ = await call(http, base, "POST", decommission, operator, forced)
                second = body["approval"]["approval_id"]
                for who, error in (
                    (operator, f"was asked by {CI_CLIENT}: a second operator decides it"),
                    (viewer, "vera may not decommission"),
                ):
                    status, body, _ = await call(http, base, "POST", f"/v1/approvals/{second}/approve", who)
                    assert status == 403 and error in body["error"], body
                assert (await stack.status("node-0001")).decommission is None
                status, body, _ = await call(http, base, "POST", f"/v1/approvals/{second}/approve", olga)
                assert status == 200 and "decommission" in body["answer"], body
                # The decommission may be done already: its record is in the actions the status keeps.
                asked = (await stack.status("node-0001")).actions[-1]
                assert (asked.action, asked.by) == ("decommission", f"{CI_CLIENT} (verified: oidc)")
                assert asked.reason == "end of lease; approved by olga (verified: oidc)"
                status, body, _ = await call(http, base, "POST", f"/v1/approvals/{second}/approve", olga)
                assert status == 409 and "was approved by olga (verified: oidc) already" in body["error"]
                status, body, _ = await call(http, base, "POST", f"/v1/approvals/{first}/approve", olga)
                assert status == 409 and "was refused by olga (verified: oidc) already" in body["error"]
                status, body, _ = await call(http, base, "POST", "/v1/approvals/nonsense/approve", olga)
                assert status == 404 and "an approval is named by its UUID" in body["error"]
                code, out, _ = await shepherd_cli(env, "events", "node-0001", "--actions")
                assert code == 0 and "approval_asked" in out and "approval_approved" in out

                # The document lists exactly what is served.
                status, document, _ = await call(http, base, "GET", "/v1/openapi.json", viewer)
                assert status == 200 and document["openapi"].startswith("3.1")
                listed = {(method.upper(), p) for p, ops in document["paths"].items() for method in ops}
                served = {
                    (r.method, r.resource.canonical)
                    for r in server.app.router.routes()
                    if r.method != "HEAD" and r.resource is not None
                }
                assert listed == served == {(r.method, r.path) for r in ROUTES}
                assert len(served) == len(ROUTES)
        finally:
            await server.close()
            await api.close()


async def test_api_key_create_writes_a_private_key_once(tmp_path, shepherd_cli):
    path = tmp_path / "api.key"
    code, out, _ = await shepherd_cli({}, "api-key", "create", str(path))
    assert code == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    signer = load_signing_key(path)
    assert out.strip() == f"SHEPHERD_API_TRUSTED_KEYS={public_key_text(signer.public_key)}"
    code, _, err = await shepherd_cli({}, "api-key", "create", str(path))
    assert code == 1 and "exists" in err
    assert load_signing_key(path).public_key == signer.public_key


async def test_shepherd_api_refuses_to_start_without_its_settings(tmp_path: Path, shepherd_cli):
    code, _, err = await shepherd_cli({"SHEPHERD_STATE_DIR": str(tmp_path)}, "api")
    assert code == 2
    for setting in ("oidc_issuer", "oidc_audience", "api_signing_key_path", "api_policy_path"):
        assert setting in err
    key = tmp_path / "api.key"
    await shepherd_cli({}, "api-key", "create", str(key))
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    env = {
        "SHEPHERD_OIDC_ISSUER": "https://issuer.example",
        "SHEPHERD_OIDC_AUDIENCE": "https://shepherd.example/api",
        "SHEPHERD_API_SIGNING_KEY_PATH": str(key),
        "SHEPHERD_API_POLICY_PATH": str(policy),
        "SHEPHERD_API_LISTEN": "0.0.0.0:8700",
    }
    code, _, err = await shepherd_cli(env, "api")
    assert code == 2 and "api_listen" in err and "plain http is served on a loopback address only" in err
    key.chmod(0o644)
    code, _, err = await shepherd_cli(env | {"SHEPHERD_API_LISTEN": "127.0.0.1:0"}, "api")
    assert code == 2 and "api_signing_key_path" in err and "readable by others" in err
