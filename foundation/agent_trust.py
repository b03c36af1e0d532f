"""What the agents check of the heartbeat server's certificate: that it names the host they call (the host of
agent_endpoint) and that it chains to a CA of the bundle they are given (agent_endpoint_ca_certificate_path).

The heartbeat server checks a certificate it is about to serve the same way, so a renewal for another name or from
another CA is refused before any agent sees it, instead of cutting every new connection off.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID

from foundation.tls import CertificateProblem

# The CA bundle in use now (DER each); read again when its file changes, as the worker hands it on.
CABundle = Callable[[], tuple[bytes, ...]]


@dataclass(frozen=True)
class AgentTrust:
    """The host agents call and the CAs they trust; either None when the settings do not say (not checked then:
    an endpoint behind a name only the worker knows, or agents on their system trust store)."""

    host: str | None
    ca_bundle: CABundle | None

    def check(self, chain: list[x509.Certificate], where: str) -> None:
        """CertificateProblem naming where when an agent would refuse chain: its first certificate is for another
        name, or no CA of the bundle issued the chain."""
        if self.host is not None and not names_host(chain[0], self.host):
            raise CertificateProblem(
                f"{where} is for {', '.join(certificate_names(chain[0])) or 'no name'}, not for {self.host}, "
                "the host agents call (agent_endpoint)",
                where,
            )
        if self.ca_bundle is not None:
            authorities = [x509.load_der_x509_certificate(der) for der in self.ca_bundle()]
            if not chains_to(chain, authorities):
                names = ", ".join(authority.subject.rfc4514_string() for authority in authorities)
                raise CertificateProblem(
                    f"{where} is not issued by a CA agents trust ({names}, agent_endpoint_ca_certificate_path)",
                    where,
                )


def certificate_names(certificate: x509.Certificate) -> list[str]:
    """The names a TLS client matches: the subject alternative names, or the common name when there are none."""
    try:
        alternatives = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [str(value) for value in certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return [str(name) for name in alternatives.get_values_for_type(x509.DNSName)] + [
        str(address) for address in alternatives.get_values_for_type(x509.IPAddress)
    ]


def names_host(certificate: x509.Certificate, host: str) -> bool:
    """Whether a TLS client calling host accepts certificate's names: an address matches an IP address entry, a
    name a DNS entry, case aside, with a wildcard standing for the whole first label only."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    names = certificate_names(certificate)
    if address is not None:
        return any(_address(name) == address for name in names)
    wanted = host.rstrip(".").lower()
    return any(_name_matches(name.rstrip(".").lower(), wanted) for name in names if _address(name) is None)


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _name_matches(pattern: str, host: str) -> bool:
    if not pattern.startswith("*."):
        return pattern == host
    first, _, rest = host.partition(".")
    # Clients take a wildcard for one label, never for a name of one label or for the whole of a public suffix.
    return bool(first) and rest == pattern[2:] and "." in rest


def chains_to(chain: list[x509.Certificate], authorities: list[x509.Certificate]) -> bool:
    """Whether the chain's first certificate is issued, through the chain's others in their order, by one of
    authorities: each link's issuer name and signature checked."""
    for index, certificate in enumerate(chain):
        if any(_issued_by(certificate, authority) for authority in authorities):
            return True
        if index + 1 == len(chain) or not _issued_by(certificate, chain[index + 1]):
            return False
    return False


def _issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
