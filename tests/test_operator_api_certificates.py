"""The operator API over TLS with client certificates of an operator CA: the certificate names the operator, the
policy's certificate grants decide what they may do, and a certificate the CA did not issue, or no longer vouches
for, ends the handshake; on a real simulated fleet with its worker, Temporal and PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime
import json
import shlex
import ssl
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from foundation.operator_certificates import CertificateRefused, certificate_identity
from foundation.operator_proof import public_key_text
from foundation.settings import Settings, SettingsError
from foundation.tls import CertificateAuthority, subject_alternative_name
from lifecycle.contracts import MachineStage
from processes.api_signing_key import create_signing_key
from processes.operator_api import run_operator_api
from tests.certificates import Issued, write_issued
from tests.fleet_stack import fleet_stack
from tests.ports import free_port
from tests.test_operator_api import call

POLICY = """
[roles]
viewer = ["read"]
operator = ["read", "maintenance"]

[[grants]]
role = "operator"
certificates = ["alice"]

[[grants]]
role = "viewer"
certificates = ["CN=victor"]

# A token's subject: a certificate of the same CN does not reach this grant.
[[grants]]
role = "operator"
subjects = ["victor"]
"""

NOW = datetime.datetime.now(datetime.UTC)
VALID = (NOW - datetime.timedelta(minutes=5), NOW + datetime.timedelta(days=1))


def client(ca: Path, issued: Issued | None) -> aiohttp.ClientSession:
    """A client that trusts the API's CA and shows issued as its client certificate (none when None)."""
    context = ssl.create_default_context(cafile=str(ca))
    if issued is not None:
        context.load_cert_chain(issued.certificate, issued.key)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))


async def wait_listening(port: int, api: asyncio.Task[None], limit: float = 30.0) -> None:
    """Once the API listens on port; its own error if it stopped."""
    deadline = asyncio.get_running_loop().time() + limit
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if api.done():
                await api
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return


async def test_client_certificates_of_the_operator_ca_name_the_operator(tmp_path, temporal_client, bmdb_url):
    operators, server_ca = CertificateAuthority("Operators", *VALID), CertificateAuthority("API server CA", *VALID)
    # The operator CA that replaces the first in a rotation, and a stranger's CA of the same name.
    successor, stranger = CertificateAuthority("Operators 2", *VALID), CertificateAuthority("Operators", *VALID)

    def issue(
        authority: CertificateAuthority,
        name: str,
        file: str,
        valid: tuple[datetime.datetime, datetime.datetime] = VALID,
    ) -> Issued:
        issued = authority.issue(name, valid[0], valid[1], usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        return write_issued(tmp_path, file, issued)

    alice, victor, rex = (issue(operators, name, name) for name in ("alice", "victor", "rex"))
    alice_renewed = issue(successor, "alice", "alice-renewed")
    expired = issue(
        operators, "alice", "alice-expired", (NOW - datetime.timedelta(days=2), NOW - datetime.timedelta(days=1))
    )
    foreign = issue(stranger, "alice", "alice-foreign")
    server = write_issued(
        tmp_path, "api-server", server_ca.issue("127.0.0.1", *VALID, subject_alternative_name("127.0.0.1"))
    )
    (ca := tmp_path / "server-ca.pem").write_bytes(server_ca.certificate_pem)
    # The operator CAs' bundle during a rotation: both CAs, each with its CRL; the old one's revokes rex's.
    revoked = x509.load_pem_x509_certificate(rex.certificate.read_bytes()).serial_number
    operator_ca = tmp_path / "operator-ca.pem"
    operator_ca.write_bytes(
        operators.certificate_pem
        + operators.revocation_list([revoked], NOW, VALID[1])
        + successor.certificate_pem
        + successor.revocation_list([], NOW, VALID[1])
    )
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    signer = create_signing_key(tmp_path / "api.key")

    async with fleet_stack(
        tmp_path, temporal_client, bmdb_url, machines=1, api_trusted_keys=public_key_text(signer.public_key)
    ) as stack:
        port = free_port()
        settings = stack.settings.replace(
            database_url=bmdb_url,
            api_listen=f"127.0.0.1:{port}",
            api_signing_key_path=tmp_path / "api.key",
            api_policy_path=policy,
            api_tls_certificate_path=server.certificate,
            api_tls_key_path=server.key,
            api_client_ca_path=operator_ca,
        ).check_api()  # no OIDC issuer: certificates alone
        stop = asyncio.Event()
        api = asyncio.create_task(run_operator_api(settings, stop=stop))
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        await wait_listening(port, api)
        base = f"https://127.0.0.1:{port}"
        try:
            async with client(ca, alice) as http:
                status, body, _ = await call(http, base, "GET", "/v1/machines", None)
                assert status == 200 and [m["provider_id"] for m in body] == ["node-0001"]
                maintenance = {"on": True, "reason": "fans"}
                status, body, _ = await call(
                    http, base, "POST", "/v1/machines/node-0001/maintenance", None, maintenance
                )
                assert status == 200, body
                machine = await stack.status("node-0001")
                assert machine.maintenance is not None and machine.maintenance.by == "alice (verified: certificate)"
                # A token and a certificate: the token decides, and this API takes none.
                status, body, _ = await call(http, base, "GET", "/v1/machines", "a-token")
                assert status == 401 and body["error"].startswith("token refused: this API takes no bearer tokens")

            async with client(ca, alice_renewed) as http:
                status, body, _ = await call(http, base, "GET", "/v1/machines/node-0001", None)
                assert status == 200 and body["provider_id"] == "node-0001"

            async with client(ca, victor) as http:
                status, body, _ = await call(http, base, "GET", "/v1/machines/node-0001", None)
                assert status == 200 and body["provider_id"] == "node-0001"
                off = {"on": False, "reason": "fans fixed"}
                status, body, _ = await call(http, base, "POST", "/v1/machines/node-0001/maintenance", None, off)
                assert status == 403
                assert body["error"].startswith("victor may not set maintenance of machines of provider sim")
                assert (await stack.status("node-0001")).maintenance is not None

            async with client(ca, None) as http:
                status, body, response = await call(http, base, "GET", "/v1/machines", None)
                assert status == 401 and body["error"].endswith("or a client certificate of the operator CA")
                assert response.headers["WWW-Authenticate"].startswith("Bearer")

            # Another CA's certificate of the same names, an expired one, a revoked one: no handshake, no answer.
            for refused in (foreign, expired, rex):
                async with client(ca, refused) as http:
                    with pytest.raises(aiohttp.ClientConnectionError):
                        await call(http, base, "GET", "/v1/machines", None)
        finally:
            stop.set()
            await api


def machines_as_printed(stdout: IO[str], limit: float = 60.0) -> tuple[list[str], list[Any]]:
    """The lines `shepherd dev` prints up to its curl line for the operator API, then GET that URL with the
    certificate, key and CA the line names until the answer lists machines; the lines and the machines."""
    lines = []
    for line in stdout:
        lines.append(line)
        if "curl --cacert" in line:
            break
    assert lines and "curl --cacert" in lines[-1], "".join(lines)
    words = shlex.split(lines[-1][lines[-1].index("curl ") :])
    options, url = dict(zip(words[1:-1:2], words[2:-1:2], strict=True)), words[-1]
    context = ssl.create_default_context(cafile=options["--cacert"])
    context.load_cert_chain(options["--cert"], options["--key"])
    deadline = time.monotonic() + limit
    while True:
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            machines = json.load(response)
        # The first reconcile pass fills BMDB a moment after the API is up.
        if machines or time.monotonic() > deadline:
            return lines, machines
        time.sleep(0.5)


def test_client_certificates_need_the_api_to_serve_tls(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(CertificateAuthority("Operators", *VALID).certificate_pem)
    with pytest.raises(SettingsError) as refused:
        Settings(api_client_ca_path=ca).check()
    assert refused.value.setting == "api_client_ca_path" and "needs api_tls_certificate_path" in str(refused.value)


def test_a_certificate_names_one_operator_by_its_one_cn():
    key = ec.generate_private_key(ec.SECP256R1())

    def certificate(*attributes: x509.NameAttribute) -> x509.Certificate:
        name = x509.Name(list(attributes))
        builder = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        builder = builder.serial_number(1).not_valid_before(VALID[0]).not_valid_after(VALID[1])
        return builder.sign(key, hashes.SHA256())

    ops = x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ops")
    identity = certificate_identity(certificate(x509.NameAttribute(NameOID.COMMON_NAME, "alice"), ops))
    assert (identity.subject, identity.certificate, identity.verified_by) == ("alice", "O=ops,CN=alice", "certificate")
    for attributes in (
        (ops,),
        (x509.NameAttribute(NameOID.COMMON_NAME, "a"), x509.NameAttribute(NameOID.COMMON_NAME, "b")),
    ):
        with pytest.raises(CertificateRefused, match="must name one operator in one CN"):
            certificate_identity(certificate(*attributes))
