"""TLS material: the CA certificates agents trust, certificates read from PEM files and how long they have left,
and a private CA for the embedded stack and tests.

Production deployments bring their own certificates; the private CA only saves
a local stack from running heartbeats in plain text.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import NameOID

from foundation.files import ReloadedFile, replace_file
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


PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
SECONDS_A_DAY = 86400.0


class CertificateProblem(ValueError):
    """A file holds no usable certificate, or no key that goes with it; the message names the file and why, and
    where is the file at fault."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


def parse_certificates(pem: bytes, where: str) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle or chain, in order; CertificateProblem naming where when there is none,
    or one does not parse (often a file caught half written)."""
    begun = pem.count(PEM_CERTIFICATE)
    if not begun:
        raise CertificateProblem(f"{where} holds no PEM certificate", where)
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError:
        certificates = []
    # A block cut short (no END line) is skipped by the parser, not refused: a bundle would lose a CA unnoticed.
    if len(certificates) != begun:
        raise CertificateProblem(f"{where} holds a PEM certificate that does not parse", where)
    return certificates


def read_pem(path: Path) -> bytes:
    """The contents of a PEM file; CertificateProblem naming the file when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as error:
        raise CertificateProblem(f"cannot read {path}: {error.strerror or error}", str(path)) from None


def read_certificates(path: Path) -> list[x509.Certificate]:
    """The certificates in the PEM file at path; CertificateProblem naming the file when it cannot be read or
    holds none."""
    return parse_certificates(read_pem(path), str(path))


def days_left(certificate: x509.Certificate, now: datetime.datetime | None = None) -> float:
    """Days until the certificate's notAfter, with their fraction; negative once it has expired."""
    now = now or datetime.datetime.now(datetime.UTC)
    return (certificate.not_valid_after_utc - now).total_seconds() / SECONDS_A_DAY


def soonest_days_left(certificates: list[x509.Certificate], now: datetime.datetime | None = None) -> float:
    """Days left of the certificate that expires first: a chain or a bundle is as good as its weakest link."""
    return min(days_left(certificate, now) for certificate in certificates)


class NotValidYet(CertificateProblem):
    """A certificate whose validity starts later: it may be given another try at valid_from."""

    def __init__(self, message: str, where: str, valid_from: datetime.datetime) -> None:
        super().__init__(message, where)
        self.valid_from = valid_from


def load_key_pair(
    certificate_pem: bytes,
    key_pem: bytes,
    certificate_where: str,
    key_where: str,
    *,
    not_before_margin: datetime.timedelta = datetime.timedelta(0),
    now: datetime.datetime | None = None,
) -> list[x509.Certificate]:
    """The certificate chain of a server's PEM certificate and key, checked as a TLS server would need them: both
    parse, the key is the first certificate's, and that certificate is valid now, and has been for
    not_before_margin. CertificateProblem otherwise, naming the file at fault."""
    chain = parse_certificates(certificate_pem, certificate_where)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        problem = f"{key_where} holds a key protected by a password; give it without one"
        raise CertificateProblem(problem, key_where) from None
    except (ValueError, UnsupportedAlgorithm):
        raise CertificateProblem(f"{key_where} holds no PEM private key that parses", key_where) from None
    if _public_key_der(key.public_key()) != _public_key_der(chain[0].public_key()):
        raise CertificateProblem(
            f"{certificate_where} and {key_where} do not belong together: the certificate is for another key",
            key_where,
        )
    now = now or datetime.datetime.now(datetime.UTC)
    leaf = chain[0]
    if leaf.not_valid_after_utc <= now:
        expired = f"{certificate_where} expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        raise CertificateProblem(expired, certificate_where)
    ready = leaf.not_valid_before_utc + not_before_margin
    if ready > now:
        later = f"; it is taken from {ready:%H:%M:%S} UTC on" if not_before_margin else ""
        raise NotValidYet(
            f"{certificate_where} is valid only from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC{later}",
            certificate_where,
            ready,
        )
    return chain


def _public_key_der(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def read_ca_bundle(path: Path) -> tuple[bytes, ...]:
    """DER bytes of each CA certificate in the PEM bundle at path, in the file's order: the CAs agents trust for
    their endpoint. During a CA rotation the bundle holds the old CA and the new. CertificateProblem naming the file
    when it cannot be read, holds no certificate, or a certificate in it does not parse."""
    return tuple(certificate.public_bytes(serialization.Encoding.DER) for certificate in read_certificates(path))


def load_ca_certificates(path: Path) -> tuple[bytes, ...]:
    """read_ca_bundle, with a SettingsError naming agent_endpoint_ca_certificate_path for a bundle it refuses."""
    try:
        return read_ca_bundle(path)
    except CertificateProblem as problem:
        raise SettingsError("agent_endpoint_ca_certificate_path", str(problem)) from None


def agent_ca_bundle_file(path: Path) -> ReloadedFile[tuple[bytes, ...]]:
    """The CA bundle takeovers hand the agents (DER each), read again when the file changed; a bundle that does not
    parse whole is kept from use (and at start, a SettingsError naming agent_endpoint_ca_certificate_path)."""

    def describe(bundle: tuple[bytes, ...]) -> str:
        certificates = [x509.load_der_x509_certificate(der) for der in bundle]
        soonest = min(certificate.not_valid_after_utc for certificate in certificates)
        return (
            f"{len(bundle)} CA certificate(s), the first to expire on {soonest:%Y-%m-%d %H:%M} UTC; "
            "takeovers from now on hand them to the agents"
        )

    return ReloadedFile(
        path, read_ca_bundle, what="agents' CA bundle", setting="agent_endpoint_ca_certificate_path", describe=describe
    )


def bmdb_client_certificate_path(database_url: str) -> Path | None:
    """The client certificate a BMDB URL names (libpq's sslcert), or None when it names none."""
    given = parse_qs(urlsplit(database_url).query).get("sslcert")
    return Path(given[-1]) if given and given[-1] else None
