"""The operator API as the tests serve it: over a fleet stack, on a loopback port, with a real OIDC provider's
tokens verified and the policy file given."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestServer

from foundation.operator_proof import ProofSigner, public_key_text
from foundation.operator_tokens import TokenVerifier
from operations.policy import ReloadedPolicy
from processes.operator_api import OperatorApi
from tests.fleet_stack import FleetStack
from tests.oidc_fixtures import OidcProvider


async def start_api(
    stack: FleetStack,
    oidc: OidcProvider,
    signer: ProofSigner,
    policy_path: Path,
    database_url: str,
    *,
    verifier: TokenVerifier | None = None,
) -> tuple[OperatorApi, TestServer, str]:
    """The API, its server and its base URL; the caller closes the server, then the API."""
    api = OperatorApi(
        stack.settings,
        verifier or TokenVerifier(oidc.issuer, oidc.audience),
        ReloadedPolicy(policy_path),
        signer,
        stack.client,
        database_url=database_url,
    )
    server = TestServer(api.application(), host="127.0.0.1")
    await server.start_server()
    return api, server, str(server.make_url(""))


def api_keys(directory: Path, policy: str) -> tuple[ProofSigner, Path, str]:
    """A new signing key, the policy written to a file in directory, and the key's public half as workers trust it."""
    signer = ProofSigner.generate()
    policy_path = directory / "policy.toml"
    policy_path.write_text(policy)
    return signer, policy_path, public_key_text(signer.public_key)
