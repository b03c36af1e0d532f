"""Operators' TLS client certificates: the operator CA a server asks a client certificate of, and the operator a
verified certificate names (its CN, and its whole subject DN for the policy's certificate grants)."""

from __future__ import annotations

import ssl
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from foundation.operator_tokens import OperatorIdentity
from foundation.tls import read_certificates, read_pem

VERIFIED_BY = "certificate"
PEM_CRL = b"-----BEGIN X509 CRL-----"


class CertificateRefused(Exception):
    """A verified client certificate that names no operator; str() says why."""


def ask_client_certificates(context: ssl.SSLContext, ca_path: Path) -> None:
    """Make a TLS server's context ask every client for a certificate of the CAs in ca_path and end the handshake
    of one whose certificate does not verify (another CA, expired, revoked); a client without one gets through,
    to show a bearer token instead.

    ca_path is a PEM bundle: one CA, two while the operator CA is rotated, and the CRLs of those CAs when
    revocations are to be checked (then every CA of the bundle needs its CRL). CertificateProblem naming the file
    when it holds no certificate.
    """
    read_certificates(ca_path)
    # The file, not its text: only OpenSSL's file loader reads the CRLs in it along with the certificates. Only
    # these CAs are trusted; the context holds no system CA, which would let any public CA's client in.
    context.load_verify_locations(cafile=str(ca_path))
    if PEM_CRL in read_pem(ca_path):
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    context.verify_mode = ssl.CERT_OPTIONAL


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> OperatorIdentity | None:
    """The operator a connection's verified client certificate names, or None when the client showed none.
    CertificateRefused when the certificate has no CN (or several) to name an operator by."""
    # getpeercert() is empty unless the certificate verified; the DER form is read only once it did.
    if ssl_object is None or not ssl_object.getpeercert():
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if der is None:
        return None
    return certificate_identity(x509.load_der_x509_certificate(der))


def certificate_identity(certificate: x509.Certificate) -> OperatorIdentity:
    """The operator a verified client certificate names: its CN as the subject, no groups, its issuer's DN, its
    expiry, and its subject DN (RFC 4514) for the policy's certificate grants."""
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        dn = certificate.subject.rfc4514_string() or "an empty subject"
        raise CertificateRefused(
            f"the client certificate of {dn} must name one operator in one CN, it has {len(names)}"
        )
    common_name = names[0].value
    subject = common_name.decode(errors="replace") if isinstance(common_name, bytes) else common_name
    if not subject.strip():
        raise CertificateRefused("the client certificate's CN is empty: it names no operator")
    return OperatorIdentity(
        subject=subject,
        groups=(),
        issuer=certificate.issuer.rfc4514_string(),
        verified_by=VERIFIED_BY,
        expires_at=certificate.not_valid_after_utc,
        certificate=certificate.subject.rfc4514_string(),
    )
