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


def local_certificates(directory: Path, host: str = "127.0.0.1") -> LocalCertificates:
    """The CA and server certificate in directory, issued for host the first time."""
    paths = LocalCertificates(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    if all(p.exists() for p in (paths.ca_certificate, paths.server_certificate, paths.server_key)):
        return paths
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("Shepherd local CA"))
        .issuer_name(_name("Shepherd local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    try:
        alt_name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt_name = x509.DNSName(host)
    server = (
        x509.CertificateBuilder()
        .subject_name(_name(host))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([alt_name]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    replace_file(paths.ca_certificate, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    replace_file(paths.server_certificate, server.public_bytes(serialization.Encoding.PEM), 0o644)
    key_pem = server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    replace_file(paths.server_key, key_pem, 0o600)
    return paths


def load_ca_certificate(path: Path) -> bytes:
    """DER bytes of the PEM CA certificate at path, which the agents trust for their endpoint."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)
    except ValueError as error:
        raise SettingsError("agent_endpoint_ca_certificate_path", f"not a PEM X.509 certificate: {error}") from None
