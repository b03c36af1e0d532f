"""The embedded stack's operator API credentials, made once in the state dir: the API's signing key, an operator CA,
the API's TLS certificate for 127.0.0.1 and a client certificate for the local user, and a policy file that makes
that certificate the stack's admin."""

from __future__ import annotations

import datetime
import getpass
import json
import shutil
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from foundation.files import replace_file
from foundation.tls import CertificateAuthority, subject_alternative_name
from processes.api_signing_key import create_signing_key

# The API listens on loopback alone; its certificate names the address it is reached at.
API_HOST = "127.0.0.1"
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class ApiCredentials:
    """Paths of what the embedded stack's operator API and its local operator use."""

    signing_key: Path
    policy: Path
    ca_certificate: Path  # the operator CA, which also issued the API's own certificate
    server_certificate: Path
    server_key: Path
    client_certificate: Path
    client_key: Path

    def client_context(self) -> ssl.SSLContext:
        """A TLS client context of the local operator: trusts the API's certificate, shows the client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_certificate))
        context.load_cert_chain(self.client_certificate, self.client_key)
        return context

    def all(self) -> tuple[Path, ...]:
        return (
            self.signing_key,
            self.policy,
            self.ca_certificate,
            self.server_certificate,
            self.server_key,
            self.client_certificate,
            self.client_key,
        )


def api_credentials(directory: Path, user: str | None = None) -> ApiCredentials:
    """The credentials in directory, made the first time (every file 0600, the directory 0700) for user (default:
    the local user), and kept for later runs so a client certificate handed out stays good."""
    paths = ApiCredentials(
        signing_key=directory / "api-signing.key",
        policy=directory / "policy.toml",
        ca_certificate=directory / "operator-ca.pem",
        server_certificate=directory / "api-server.pem",
        server_key=directory / "api-server-key.pem",
        client_certificate=directory / "operator.pem",
        client_key=directory / "operator-key.pem",
    )
    if all(path.exists() for path in paths.all()):
        return paths
    # Half made (a run stopped midway): made again whole, since the signing key is never written over.
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_until = now - datetime.timedelta(minutes=5), now + VALIDITY
    authority = CertificateAuthority("Shepherd embedded stack operator CA", valid_from, valid_until)
    server, server_key = authority.issue(
        API_HOST, valid_from, valid_until, subject_alternative_name(API_HOST), usage=ExtendedKeyUsageOID.SERVER_AUTH
    )
    operator = user or getpass.getuser()
    client, client_key = authority.issue(operator, valid_from, valid_until, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    replace_file(paths.ca_certificate, authority.certificate_pem, 0o600)
    replace_file(paths.server_certificate, server, 0o600)
    replace_file(paths.server_key, server_key, 0o600)
    replace_file(paths.client_certificate, client, 0o600)
    replace_file(paths.client_key, client_key, 0o600)
    subject = x509.load_pem_x509_certificate(client).subject.rfc4514_string()
    replace_file(paths.policy, admin_policy(subject).encode(), 0o600)
    create_signing_key(paths.signing_key)
    return paths


def admin_policy(certificate: str) -> str:
    """A policy file that gives the client certificate of this subject DN every action, with no confirmation."""
    return "\n".join(
        [
            "# The embedded stack's operator API: the local operator's client certificate may do everything.",
            "[roles]",
            'admin = ["*"]',
            "",
            "[[grants]]",
            'role = "admin"',
            f"certificates = [{json.dumps(certificate, ensure_ascii=False)}]",
            "",
        ]
    )
