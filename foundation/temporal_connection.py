"""Where Shepherd's processes find Temporal: the Temporal CLI's own configuration, Shepherd's settings over it.

The `TEMPORAL_*` environment variables and the profiles of `temporal.toml` (`TEMPORAL_CONFIG_FILE`,
`TEMPORAL_PROFILE`) give the address, the namespace, TLS (server CA, server name, client certificate and key),
an API key and gRPC metadata, as they do to the Temporal CLI and SDKs. Shepherd's `temporal_address` and
`temporal_namespace`, when set, win over them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509
from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from foundation.settings import Settings

DEFAULT_ADDRESS = "localhost:7233"
DEFAULT_NAMESPACE = "default"
# Where the Temporal CLI looks for its configuration unless TEMPORAL_CONFIG_FILE says otherwise.
DEFAULT_CONFIG_FILE = "~/.config/temporalio/temporal.toml"

# Each part of a connection and the variables that can set it, for telling where it came from.
_VARIABLES = {
    "address": ("TEMPORAL_ADDRESS",),
    "namespace": ("TEMPORAL_NAMESPACE",),
    "api_key": ("TEMPORAL_API_KEY",),
    "tls": ("TEMPORAL_TLS",),
    "tls_server_name": ("TEMPORAL_TLS_SERVER_NAME",),
    "tls_server_ca": ("TEMPORAL_TLS_SERVER_CA_CERT_PATH", "TEMPORAL_TLS_SERVER_CA_CERT_DATA"),
    "tls_client_certificate": ("TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_CERT_DATA"),
    "tls_client_key": ("TEMPORAL_TLS_CLIENT_KEY_PATH", "TEMPORAL_TLS_CLIENT_KEY_DATA"),
}


# A refusal of the credentials, as the SDK reports it: the gRPC status code, or the HTTP status of a proxy that
# answered in plain HTTP ("... while receiving response with status: 401 Unauthorized"). A bare 401 could be a
# port, a namespace or a date in the same text.
_REFUSED_CREDENTIALS = re.compile(
    r"\bcode: (?:Unauthenticated|PermissionDenied)\b|\bstatus: 401\b|\b401 Unauthorized\b"
)

# The SDK's complaint about a temporal.toml quotes the line it found wrong, and a caret line under it
# ("3 | api_key = sk-...", "  |     ^^^"): that line may be the API key's.
_QUOTED_LINE = re.compile(r"^\s*\d*\s*\|")
# What the SDK's words quote of a value: `123`, "a string". One character in backticks is TOML's own syntax
# (expected `"`), anything longer may be the value of the key.
_QUOTED_VALUE = re.compile(r'`[^`]*`|"(?:[^"\\]|\\.)*"')
_POSITION = re.compile(r"\bline (\d+), column \d+")
# A key = at the start of a TOML line: its name alone says which setting is wrong, never its value. Names are
# short (client_cert_path); a secret pasted where a name goes is longer, and not shown.
_TOML_KEY = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_-]{0,39})\s*=")

# Where a client certificate or its key is set: the variable, and the key of a profile's [tls].
_CLIENT_TLS_SETTINGS = {
    "certificate": ("TEMPORAL_TLS_CLIENT_CERT_PATH", "client_cert_path"),
    "key": ("TEMPORAL_TLS_CLIENT_KEY_PATH", "client_key_path"),
}


class TemporalConfigError(Exception):
    """The Temporal client configuration cannot be used; the message names what and where to fix it."""


@dataclass(frozen=True)
class TemporalConnection:
    """How to reach Temporal, and where each part came from ("default" where nothing set it)."""

    address: str
    namespace: str
    api_key: str | None = None
    tls: ClientConfigTLS | None = None
    rpc_metadata: Mapping[str, str] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)

    def source(self, part: str) -> str:
        """Where the part was set, or "default" where nothing set it."""
        return self.sources.get(part, "default")

    @property
    def uses_tls(self) -> bool:
        """Whether the connection uses TLS: as the configuration says, else when an API key or TLS material is set."""
        if self.tls is not None and self.tls.disabled is not None:
            return not self.tls.disabled
        # An API key or any TLS material turns TLS on, as it does for the Temporal CLI.
        return self.api_key is not None or self.tls is not None

    def connect_arguments(self) -> dict[str, Any]:
        """Keyword arguments of Client.connect; TemporalConfigError naming a certificate or key it cannot read."""
        arguments: dict[str, Any] = {"target_host": self.address, "namespace": self.namespace}
        if self.api_key is not None:
            arguments["api_key"] = self.api_key
        if self.rpc_metadata:
            arguments["rpc_metadata"] = dict(self.rpc_metadata)
        if not self.uses_tls:
            return arguments
        tls = self.tls or ClientConfigTLS()
        client_certificate = self._read("tls_client_certificate", "the TLS client certificate", tls.client_cert)
        if client_certificate is not None:
            self._check_validity(client_certificate)
        arguments["tls"] = TLSConfig(
            domain=tls.server_name,
            server_root_ca_cert=self._read("tls_server_ca", "the TLS server CA certificate", tls.server_root_ca_cert),
            client_cert=client_certificate,
            client_private_key=self._read("tls_client_key", "the TLS client key", tls.client_private_key),
        )
        return arguments

    def explain(self, error: BaseException) -> str:
        """One line on why connecting failed and which setting to look at, from the SDK's error text."""
        text = str(error)
        tls = self.tls or ClientConfigTLS()
        ca = _shown(tls.server_root_ca_cert, "the system trust store")
        ca_setting = self._where("tls_server_ca", "TEMPORAL_TLS_SERVER_CA_CERT_PATH")
        if "ConnectionRefused" in text or "Connection refused" in text:
            return f"nothing listens at {self.address} (connection refused): is Temporal's frontend there?"
        if "failed to lookup address" in text or "Name or service not known" in text:
            return f"cannot resolve the host of {self.address}: check the address"
        if "UnknownIssuer" in text or "certificate verify failed" in text:
            return (
                f"the server's certificate is not signed by a CA in {ca} ({ca_setting}): give the CA that "
                "issued the server's certificate"
            )
        if "NotValidForName" in text:
            names = re.findall(r'DnsName\(\\?"([^"\\]+)', text.split("presented", 1)[-1])
            expected = tls.server_name or self.address.rsplit(":", 1)[0]
            return (
                f"the server's certificate is for {', '.join(names) or 'other names'}, not {expected} "
                f"({self._where('tls_server_name', 'TEMPORAL_TLS_SERVER_NAME')}): set the server name to one of them"
            )
        if "Expired" in text and "InvalidCertificate" in text:
            return f"the server's certificate has expired (checked against {ca}): the server must renew it"
        if "InvalidContentType" in text or "CorruptMessage" in text:
            return f"{self.address} does not answer TLS: turn TLS off (TEMPORAL_TLS=false), or give the TLS address"
        refused = "400 Bad Request" in text or "CertificateRequired" in text or "BadCertificate" in text
        if refused and self.uses_tls and tls.client_cert is None:
            return (
                "the server demands a client certificate (mutual TLS): set TEMPORAL_TLS_CLIENT_CERT_PATH and "
                "TEMPORAL_TLS_CLIENT_KEY_PATH, or client_cert_path and client_key_path in the profile's [tls]"
            )
        if refused and tls.client_cert is not None:
            return (
                f"the server refused the client certificate {_shown(tls.client_cert, '')} "
                f"({self.source('tls_client_certificate')}): it is not issued by a CA the server trusts, or revoked"
            )
        refused_credentials = isinstance(error, RPCError) and error.status in (
            RPCStatusCode.UNAUTHENTICATED,
            RPCStatusCode.PERMISSION_DENIED,
        )
        if refused_credentials or _REFUSED_CREDENTIALS.search(text):
            if self.api_key is not None:
                source = self.source("api_key")
                setting = "TEMPORAL_API_KEY" if "TEMPORAL_API_KEY" in source else "api_key in the profile"
                return f"the server refused the API key ({source}): check {setting}"
            return "the server demands credentials: an API key (TEMPORAL_API_KEY) or a client certificate"
        return text

    def _where(self, part: str, variable: str) -> str:
        source = self.source(part)
        return source if variable in source else f"{source}; {variable}"

    def _check_validity(self, pem: bytes) -> None:
        """A client certificate out of its validity is refused by every server: say so before connecting."""
        shown = _shown((self.tls or ClientConfigTLS()).client_cert, "inline")
        where = f"{shown}, {self.source('tls_client_certificate')}"
        try:
            certificate = x509.load_pem_x509_certificate(pem)
        except ValueError as error:
            problem = f"the TLS client certificate ({where}) is not a PEM certificate: {error}"
            raise TemporalConfigError(problem) from None
        now = datetime.now(UTC)
        if certificate.not_valid_after_utc < now:
            raise TemporalConfigError(
                f"the TLS client certificate ({where}) expired on "
                f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it"
            )
        if certificate.not_valid_before_utc > now:
            raise TemporalConfigError(
                f"the TLS client certificate ({where}) is valid only from "
                f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: check this host's clock"
            )

    def described(self) -> list[tuple[str, str, str]]:
        """(part, value, source) of every part, for `shepherd config`: key material and API keys hidden."""
        tls = self.tls or ClientConfigTLS()
        parts = [
            ("address", self.address, self.source("address")),
            ("namespace", self.namespace, self.source("namespace")),
            ("tls", "on" if self.uses_tls else "off", self.source("tls")),
            ("tls_server_name", tls.server_name or "", self.source("tls_server_name")),
            ("tls_server_ca", _shown(tls.server_root_ca_cert, "system trust store"), self.source("tls_server_ca")),
            ("tls_client_certificate", _shown(tls.client_cert, ""), self.source("tls_client_certificate")),
            ("tls_client_key", _shown(tls.client_private_key, "", secret=True), self.source("tls_client_key")),
            ("api_key", "***" if self.api_key else "", self.source("api_key")),
        ]
        parts += [(f"grpc_meta.{key}", "***", self.source("grpc_meta")) for key in sorted(self.rpc_metadata)]
        return [(part, value, source) for part, value, source in parts if value or part in ("address", "namespace")]

    def _read(self, part: str, what: str, source: str | bytes | Path | None) -> bytes | None:
        if source is None or isinstance(source, bytes):
            return source
        if isinstance(source, str):
            return source.encode()
        try:
            return source.read_bytes()
        except OSError as error:
            raise TemporalConfigError(
                f"cannot read {what} at {source} ({self.source(part)}): {error.strerror or error}"
            ) from None


def _shown(source: str | bytes | Path | None, unset: str, *, secret: bool = False) -> str:
    if source is None:
        return unset
    if isinstance(source, Path):
        return str(source)
    return "(inline, hidden)" if secret else "(inline PEM)"


def load_temporal_connection(settings: Settings, environ: Mapping[str, str] | None = None) -> TemporalConnection:
    """The connection in effect: the Temporal configuration in environ (the process's by default), then
    Shepherd's temporal_address and temporal_namespace where set; TemporalConfigError naming what is wrong."""
    environ = os.environ if environ is None else environ
    profile_name = environ.get("TEMPORAL_PROFILE") or None
    config_file = environ.get("TEMPORAL_CONFIG_FILE") or DEFAULT_CONFIG_FILE
    where = f"profile {profile_name or 'default'} of {config_file}"
    try:
        profile = ClientConfigProfile.load(profile_name, override_env_vars=dict(environ))
    except Exception as error:  # the SDK's ConfigError, raised from its native loader
        problem = _without_content(error, Path(config_file).expanduser())
        raise TemporalConfigError(
            f"cannot use the Temporal client configuration ({where}; TEMPORAL_CONFIG_FILE, TEMPORAL_PROFILE): {problem}"
        ) from None

    sources: dict[str, str] = {}

    def origin(part: str, value: object) -> None:
        if value is None or value == {}:
            return
        variables = [name for name in _VARIABLES.get(part, ()) if environ.get(name)]
        sources[part] = f"environment {variables[0]}" if variables else where

    tls = profile.tls
    origin("address", profile.address)
    origin("namespace", profile.namespace)
    origin("api_key", profile.api_key)
    if tls is not None:
        origin("tls", tls.disabled)
        origin("tls_server_name", tls.server_name)
        origin("tls_server_ca", tls.server_root_ca_cert)
        origin("tls_client_certificate", tls.client_cert)
        origin("tls_client_key", tls.client_private_key)
    if profile.grpc_meta:
        meta = [name for name in environ if name.startswith("TEMPORAL_GRPC_META_")]
        sources["grpc_meta"] = f"environment {meta[0]}" if meta else where

    address, namespace = profile.address or DEFAULT_ADDRESS, profile.namespace or DEFAULT_NAMESPACE
    if settings.temporal_address is not None:
        address, sources["address"] = settings.temporal_address, "Shepherd setting temporal_address"
    if settings.temporal_namespace is not None:
        namespace, sources["namespace"] = settings.temporal_namespace, "Shepherd setting temporal_namespace"
    if tls is not None and (tls.client_cert is None) != (tls.client_private_key is None):
        given, missing = ("certificate", "key") if tls.client_cert is not None else ("key", "certificate")
        variable, profile_key = _CLIENT_TLS_SETTINGS[missing]
        raise TemporalConfigError(
            f"a TLS client {given} ({sources[f'tls_client_{given}']}) needs its {missing}: set {variable}, "
            f"or {profile_key} in the profile's [tls]"
        )
    return TemporalConnection(
        address=address,
        namespace=namespace,
        api_key=profile.api_key,
        tls=tls,
        rpc_metadata=dict(profile.grpc_meta),
        sources=sources,
    )


def _without_content(error: BaseException, config_file: Path) -> str:
    """The SDK's complaint about the configuration without anything of the file's content: the line it quotes and
    the values it names are left out, the key of that line is named instead (the API key's line is the one to
    keep off a terminal and out of the logs)."""
    text = str(error).removeprefix("Configuration loading error: ")
    words = ": ".join(line.strip() for line in text.splitlines() if line.strip() and not _QUOTED_LINE.match(line))
    words = _QUOTED_VALUE.sub(lambda found: "(value not shown)" if len(found.group(0)) > 3 else found.group(0), words)
    position = _POSITION.search(words)
    if position is None:
        return words
    try:
        line = config_file.read_text(errors="replace").splitlines()[int(position.group(1)) - 1]
    except (OSError, IndexError):
        return words
    key = _TOML_KEY.match(line)
    if key is None:
        return words
    return f"{words[: position.end()]} (key {key.group(1)}){words[position.end() :]}"
