"""TLS material: the CA certificates agents trust, certificates read from PEM files and how long they have left,
and a private CA for the embedded stack and tests.

Production deployments bring their own certificates; the private CA only saves
a local stack from running heartbeats in plain text.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import NameOID

from foundation.files import FileChanges, ReloadedFile, replace_file
from foundation.setting_values import SettingsError

log = logging.getLogger("shepherd.tls")


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
        """The CA's certificate, PEM-encoded."""
        return self._certificate.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        not_before: datetime.datetime,
        not_after: datetime.datetime,
        alt_name: x509.GeneralName | None = None,
        usage: x509.ObjectIdentifier | None = None,
    ) -> tuple[bytes, bytes]:
        """(certificate, private key) in PEM, for a server when alt_name names it, for a client otherwise; usage
        (ExtendedKeyUsageOID.SERVER_AUTH or CLIENT_AUTH) keeps a certificate to that one side of TLS."""
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
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        certificate = builder.sign(self._key, hashes.SHA256())
        return certificate.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def revocation_list(
        self, serials: list[int], this_update: datetime.datetime, next_update: datetime.datetime
    ) -> bytes:
        """A CRL of this CA, in PEM, revoking the certificates of these serial numbers."""
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self._certificate.subject)
            .last_update(this_update)
            .next_update(next_update)
        )
        for serial in serials:
            revoked = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(this_update).build()
            builder = builder.add_revoked_certificate(revoked)
        return builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


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


# A renewed certificate that is not valid yet is taken this long after its validity begins: a client whose clock
# is a little behind (or reads the time coarsely) would refuse it a moment earlier.
NOT_BEFORE_MARGIN = 60.0


class ReloadedKeyPair:
    """A certificate chain and its private key, read again whenever either file changes on disk.

    While nothing changed, a look costs two stat calls. A new pair that cannot be used (a file half written, a key
    that is not the certificate's, a certificate expired) is logged once a change, naming the file, and the pair
    before it is used on; one not valid yet is taken not_before_margin after its validity begins. check is asked of
    every pair read, and refuses one (CertificateProblem) that its users would not accept. on_refused hears of each
    new pair refused. At start there is no pair before: CertificateProblem. Looks may come from several threads.
    """

    def __init__(
        self,
        certificate_path: Path,
        key_path: Path,
        *,
        what: str,
        not_before_margin: float = NOT_BEFORE_MARGIN,
        check: Callable[[list[x509.Certificate], str], None] = lambda chain, where: None,
        on_refused: Callable[[CertificateProblem], None] = lambda problem: None,
    ) -> None:
        self.certificate_path, self.key_path, self.what = certificate_path, key_path, what
        self.not_before_margin = datetime.timedelta(seconds=not_before_margin)
        self._check, self._on_refused = check, on_refused
        self._lock = threading.Lock()
        # Stat'ed before the first read, so that a write after it is read at the next look.
        self._files = FileChanges(certificate_path, key_path)
        # At start there is no pair before to use meanwhile: one valid now is taken.
        self.chain, self.pems = self._read(datetime.timedelta(0))
        # When a certificate that was not valid yet is given another try; None: only when a file changes.
        self._retry_at: datetime.datetime | None = None

    def look(self) -> bool:
        """Read the pair again if a file changed (or one not valid yet may be now); True when a new pair is taken."""
        with self._lock:
            return self._reload_if_changed()

    def current(self) -> list[x509.Certificate]:
        """The chain in use, the files looked at first."""
        with self._lock:
            self._reload_if_changed()
            return self.chain

    def _read(self, not_before_margin: datetime.timedelta) -> tuple[list[x509.Certificate], tuple[bytes, bytes]]:
        certificate, key = read_pem(self.certificate_path), read_pem(self.key_path)
        chain = load_key_pair(
            certificate, key, str(self.certificate_path), str(self.key_path), not_before_margin=not_before_margin
        )
        self._check(chain, str(self.certificate_path))
        return chain, (certificate, key)

    def _reload_if_changed(self) -> bool:
        # Looked at before reading: a write after the read changes what the next look sees, and is read then.
        changed = self._files.look()
        retry = self._retry_at is not None and datetime.datetime.now(datetime.UTC) >= self._retry_at
        if not changed and not retry:
            return False
        self._retry_at = None
        try:
            chain, pems = self._read(self.not_before_margin)
        except CertificateProblem as problem:
            if isinstance(problem, NotValidYet):
                self._retry_at = problem.valid_from
            log.warning("%s not reloaded, the one before is used on: %s", self.what, problem)
            self._on_refused(problem)
            return False
        if pems == self.pems:
            return False  # touched or copied over with the same contents
        self.chain, self.pems = chain, pems
        leaf = chain[0]
        log.info(
            "%s reloaded from %s: serial %x, valid until %s UTC",
            self.what,
            self.certificate_path,
            leaf.serial_number,
            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M}",
        )
        return True
