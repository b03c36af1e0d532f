"""TLS material: the CA certificate agents trust, and a private CA for the embedded stack and tests.

Production deployments bring their own certificates; the private CA only saves
a local stack from running heartbeats in plain text.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from foundation.files import replace_file
from foundation.settings import SettingsError


@dataclass(frozen=True)
class LocalCertificates:
    """Paths of the private CA's certificate and of the server certificate and key it issued."""

    ca_certificate: Path
    server_certificate: Path
    server_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def subject_alternative_name(host: str) -> x509.GeneralName:
    """An IP address entry for an address, a DNS name entry for anything else."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CertificateAuthority:
    """A private CA that issues certificates: the embedded stack's, and the tests' of every kind."""

    def __init__(self, common_name: str, not_before: datetime.datetime, not_after: datetime.datetime) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def certificate_pem(self) -> bytes:
        return self._certificate.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        not_before: datetime.datetime,
        not_after: datetime.datetime,
        alt_name: x509.GeneralName | None = None,
    ) -> tuple[bytes, bytes]:
        """(certificate, private key) in PEM, for a server when alt_name names it, for a client otherwise."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
        )
        if alt_name is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName([alt_name]), critical=False)
        certificate = builder.sign(self._key, hashes.SHA256())
        return certificate.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def local_certificates(directory: Path, host: str = "127.0.0.1") -> LocalCertificates:
    """The CA and server certificate in directory, issued for host the first time."""
    paths = LocalCertificates(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    if all(p.exists() for p in (paths.ca_certificate, paths.server_certificate, paths.server_key)):
        return paths
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_until = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=3650)
    authority = CertificateAuthority("Shepherd local CA", valid_from, valid_until)
    server, server_key = authority.issue(host, valid_from, valid_until, subject_alternative_name(host))
    replace_file(paths.ca_certificate, authority.certificate_pem, 0o644)
    replace_file(paths.server_certificate, server, 0o644)
    replace_file(paths.server_key, server_key, 0o600)
    return paths


def load_ca_certificate(path: Path) -> bytes:
    """DER bytes of the PEM CA certificate at path, which the agents trust for their endpoint."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)
    except ValueError as error:
        raise SettingsError("agent_endpoint_ca_certificate_path", f"not a PEM X.509 certificate: {error}") from None
