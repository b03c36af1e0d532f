"""The heartbeat endpoint as the agents reach it: TLS with HTTP/2, and a certificate their CA verifies and that
is not about to expire."""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
from contextlib import suppress
from typing import Any

from cryptography import x509
from cryptography.x509.oid import NameOID

from foundation.setting_values import SettingsError, parse_endpoint
from foundation.tls import days_left, load_ca_certificates
from shepherd.commands.doctor_checks.checkup import Checkup
from shepherd.commands.doctor_checks.verdicts import Verdict, fail, ok, plural, warn

# A certificate closer than this to its end is a warning: time to renew before the agents are locked out.
CERTIFICATE_WARN_DAYS = 30


def _common_name(name: x509.Name) -> str:
    names = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else name.rfc4514_string()


def _certificate_names(certificate: x509.Certificate) -> list[str]:
    try:
        alternatives = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [_common_name(certificate.subject)]
    return [str(name) for name in alternatives.get_values_for_type(x509.DNSName)] + [
        str(address) for address in alternatives.get_values_for_type(x509.IPAddress)
    ]


def _expiry(certificate: x509.Certificate) -> tuple[str, dict[str, Any]]:
    """'expires in 41 days (2027-01-04 10:00 UTC)' or 'expired 3 days ago (...)', and the facts for --json."""
    left = days_left(certificate)
    end = f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    facts = {"not_after": certificate.not_valid_after_utc.isoformat(), "days_left": math.floor(left)}
    if left < 0:
        ago = math.floor(-left)
        return (f"expired {plural(ago, 'day')} ago" if ago else "expired today") + f" ({end})", facts
    return f"expires in {plural(math.floor(left), 'day')} ({end})", facts


async def _tls_handshake(host: str, port: int, context: ssl.SSLContext) -> tuple[bytes, str | None]:
    """The peer's certificate (DER) and the protocol it chose by ALPN, after a TLS handshake with context."""
    _, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname=host)
    try:
        tls = writer.get_extra_info("ssl_object")
        return tls.getpeercert(binary_form=True), tls.selected_alpn_protocol()
    finally:
        writer.close()
        # A server that drops the connection without a TLS goodbye is no concern here.
        with suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


def _grpc_tls_context(context: ssl.SSLContext) -> ssl.SSLContext:
    # gRPC clients, the agents among them, refuse a server that does not choose HTTP/2 by ALPN.
    context.set_alpn_protocols(["h2"])
    return context


class EndpointChecks(Checkup):
    """The checks of the heartbeat endpoint; the second looks again at the certificate the first was shown."""

    async def endpoint_checks(self) -> None:
        """Check the heartbeat endpoint: that it answers, then its certificate."""
        await self.check("heartbeat endpoint", self.endpoint)
        await self.check("heartbeat endpoint certificate", self.endpoint_certificate, needs=["heartbeat endpoint"])

    def _endpoint(self) -> tuple[str, int]:
        """(host, port) of agent_endpoint; a failure when it is unset or no host:port."""
        endpoint = self.settings.agent_endpoint
        if not endpoint:
            fail("agent_endpoint is not set (SHEPHERD_AGENT_ENDPOINT): agents have nowhere to send heartbeats")
        try:
            return parse_endpoint(endpoint)
        except ValueError as error:
            fail(f"agent_endpoint {error}")

    async def endpoint(self) -> Verdict:
        """Whether agent_endpoint answers TLS with HTTP/2, whatever its certificate."""
        endpoint = self.settings.agent_endpoint
        host, port = self._endpoint()
        # Any certificate: whether the agents trust it is the next check's question.
        context = _grpc_tls_context(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        try:
            self.peer_certificate, protocol = await _tls_handshake(host, port, context)
        except ConnectionRefusedError:
            fail(f"nothing listens at {endpoint} (connection refused): is a heartbeat server, or its proxy, there?")
        except socket.gaierror as error:
            fail(f"cannot resolve {host} of agent_endpoint {endpoint}: {error.strerror}")
        except ssl.SSLError as error:
            fail(
                f"{endpoint} does not answer TLS ({error.reason or error}); agents always use TLS: serve it there, or "
                "put a TLS-terminating proxy before a plain-text heartbeat server"
            )
        except OSError as error:
            fail(f"cannot connect to {endpoint}: {error.strerror or error}")
        if protocol != "h2":
            fail(
                f"{endpoint} answers TLS but not with HTTP/2 (ALPN h2), which the agents' gRPC requires: let the "
                "proxy in front pass HTTP/2 through",
                alpn=protocol,
            )
        return ok(f"{endpoint} answers TLS with HTTP/2, as the agents' gRPC needs", alpn=protocol)

    async def endpoint_certificate(self) -> Verdict:
        """Whether the agents' CA verifies the endpoint's certificate, and how long it has left."""
        host, port = self._endpoint()
        ca = self.settings.agent_endpoint_ca_certificate_path
        if ca is None:
            trust = "the system trust store (agent_endpoint_ca_certificate_path unset)"
            context = ssl.create_default_context()
        else:
            trust = f"the agents' CA {ca}"
            try:
                # The very certificates the worker gives the agents, read the way it reads them.
                context = ssl.create_default_context(cadata=b"".join(load_ca_certificates(ca)))
            except SettingsError as error:
                fail(str(error))
        try:
            der, _ = await _tls_handshake(host, port, _grpc_tls_context(context))
        except ssl.SSLCertVerificationError as error:
            presented = x509.load_der_x509_certificate(self.peer_certificate)
            expiry, facts = _expiry(presented)
            reason = str(error.verify_message or error.reason)
            seen = (
                f"it is for {', '.join(_certificate_names(presented))}, issued by {_common_name(presented.issuer)}, "
                f"{expiry}"
            )
            fail(
                f"not verifiable with {trust}: {reason}; {seen}{_certificate_advice(reason, host)}",
                verify_error=reason,
                issuer=presented.issuer.rfc4514_string(),
                **facts,
            )
        certificate = x509.load_der_x509_certificate(der)
        expiry, facts = _expiry(certificate)
        detail = f"{expiry}, verified for {host} with {trust}"
        facts["issuer"] = certificate.issuer.rfc4514_string()
        if facts["days_left"] < CERTIFICATE_WARN_DAYS:
            return warn(f"{detail}: under {CERTIFICATE_WARN_DAYS} days, renew it", **facts)
        return ok(detail, **facts)


def _certificate_advice(reason: str, host: str) -> str:
    """What to do about a certificate the agents cannot verify, by OpenSSL's reason."""
    if "expired" in reason:
        return ": renew it"
    if "not yet valid" in reason:
        return ": check the clocks of this host and of the server"
    if "mismatch" in reason:
        return f": issue it for {host}, or set agent_endpoint to a name it is issued for"
    if "issuer" in reason or "self-signed" in reason or "self signed" in reason:
        return ": give the agents the CA that issued it (agent_endpoint_ca_certificate_path), or use one theirs issued"
    return ""
