"""The checks of the settings that concern operators: the OIDC issuer, the operator API's keys, listen address,
TLS and policy, and what the workers trust of requests the API signs. foundation.settings calls them."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from foundation.operator_proof import OperatorTrust, TrustedKeys
from foundation.setting_values import SettingsError, check_listen_address, https_url_problem, is_loopback
from foundation.tls import CertificateProblem, read_certificates

# What each unverified_operator_actions refuses without the operator API's proof: the updates that retire a
# machine or let a quarantined one be rebooted again. A signal (force_recover) cannot be refused before it acts.
UNVERIFIED_OPERATOR_ACTIONS = {
    "accept": frozenset[str](),
    "refuse_destructive": frozenset({"decommission", "release"}),
}


class OperatorSettings(Protocol):
    """The settings these checks read (foundation.settings.Settings has them all)."""

    @property
    def oidc_issuer(self) -> str: ...
    @property
    def oidc_audience(self) -> str: ...
    @property
    def oidc_client_id(self) -> str: ...
    @property
    def api_url(self) -> str: ...
    @property
    def api_ca_path(self) -> Path | None: ...
    @property
    def api_client_certificate_path(self) -> Path | None: ...
    @property
    def api_client_key_path(self) -> Path | None: ...
    @property
    def api_listen(self) -> str: ...
    @property
    def api_policy_path(self) -> Path | None: ...
    @property
    def api_signing_key_path(self) -> Path | None: ...
    @property
    def api_tls_certificate_path(self) -> Path | None: ...
    @property
    def api_tls_key_path(self) -> Path | None: ...
    @property
    def api_client_ca_path(self) -> Path | None: ...
    @property
    def api_trusted_keys(self) -> str: ...
    @property
    def unverified_operator_actions(self) -> str: ...


def check_operator_settings(settings: OperatorSettings) -> None:
    """The operator settings' part of Settings.check(): SettingsError naming the first bad one."""
    if settings.oidc_issuer:
        _check_oidc(settings)
    _check_files(settings, "api_policy_path")
    check_listen_address("api_listen", settings.api_listen)
    _check_pair(settings, "api_tls_certificate_path", "api_tls_key_path", "a certificate is served with its key")
    if settings.api_client_ca_path is not None and settings.api_tls_certificate_path is None:
        raise SettingsError(
            "api_client_ca_path",
            "needs api_tls_certificate_path and api_tls_key_path: a client certificate is shown in the TLS "
            "handshake, and plain http has none",
        )
    if settings.api_url:
        _check_api_client(settings)
    operator_trust(settings)


def _check_api_client(settings: OperatorSettings) -> None:
    # A token or client certificate goes wherever api_url points: only to a server whose certificate is checked.
    _check_trusted_url(settings, "api_url")
    _check_pair(
        settings, "api_client_certificate_path", "api_client_key_path", "a client certificate is shown with its key"
    )
    _check_files(settings, "api_ca_path", "api_client_certificate_path", "api_client_key_path")


def _check_trusted_url(settings: OperatorSettings, name: str) -> None:
    """SettingsError unless the setting is an https:// URL (http:// to loopback), with no query or fragment."""
    url = getattr(settings, name)
    problem = https_url_problem(url)
    if problem is None and ("?" in url or "#" in url):
        problem = f"must have no query or fragment, got {url!r}"
    if problem is not None:
        raise SettingsError(name, problem)


def _check_pair(settings: OperatorSettings, first: str, second: str, why: str) -> None:
    """SettingsError naming the one of two settings missing when only the other is set."""
    if (getattr(settings, first) is None) != (getattr(settings, second) is None):
        given, missing = (first, second) if getattr(settings, second) is None else (second, first)
        raise SettingsError(missing, f"must be set with {given}: {why}")


def _check_files(settings: OperatorSettings, *names: str) -> None:
    """SettingsError naming the first of these path settings that is set to no readable file."""
    for name in names:
        path = getattr(settings, name)
        if path is not None and not path.is_file():
            raise SettingsError(name, f"{path} is not a readable file")


def operator_trust(settings: OperatorSettings) -> OperatorTrust:
    """What a worker's machine workflows trust of operator requests; SettingsError naming a bad setting."""
    try:
        keys = TrustedKeys.parse(settings.api_trusted_keys)
    except ValueError as error:
        raise SettingsError("api_trusted_keys", str(error)) from None
    policy = settings.unverified_operator_actions
    if policy not in UNVERIFIED_OPERATOR_ACTIONS:
        known = ", ".join(UNVERIFIED_OPERATOR_ACTIONS)
        raise SettingsError("unverified_operator_actions", f"must be one of {known}, got {policy!r}")
    refused = UNVERIFIED_OPERATOR_ACTIONS[policy]
    if refused and not keys.keys:
        raise SettingsError(
            "unverified_operator_actions",
            f"{policy} needs api_trusted_keys: without the operator API's keys no request could be verified",
        )
    return OperatorTrust(keys, refused)


def _check_oidc(settings: OperatorSettings) -> None:
    # The issuer's URL is where its signing keys come from: whoever can answer there can sign as any operator.
    _check_trusted_url(settings, "oidc_issuer")
    if not settings.oidc_audience:
        raise SettingsError("oidc_audience", "must be set with oidc_issuer: the audience access tokens must name")


def check_login_settings(settings: OperatorSettings) -> None:
    """What `shepherd login` needs beyond Settings.check(): an issuer and the client id."""
    if not settings.oidc_issuer:
        raise SettingsError("oidc_issuer", "must be set to the issuer URL of the OIDC provider to log in at")
    if not settings.oidc_client_id:
        raise SettingsError("oidc_client_id", "must be set to the client id of `shepherd login` at the issuer")


def check_api_settings(settings: OperatorSettings) -> None:
    """What the operator API needs beyond Settings.check(): each missing setting named, the files there, and TLS
    unless it listens on loopback alone (bearer tokens in plain http go nowhere else). An API with an operator CA
    may do without an OIDC issuer: its operators show client certificates."""
    needed: tuple[str, ...] = ("oidc_issuer", "oidc_audience", "api_signing_key_path", "api_policy_path")
    if settings.api_client_ca_path is not None and not (settings.oidc_issuer or settings.oidc_audience):
        needed = ("api_signing_key_path", "api_policy_path")
    missing = [name for name in needed if not getattr(settings, name)]
    if missing:
        raise SettingsError(
            missing[0], f"the operator API needs {', '.join(missing)}: tokens, proofs and decisions rest on them"
        )
    _check_files(settings, "api_signing_key_path", "api_tls_certificate_path", "api_tls_key_path", "api_client_ca_path")
    if settings.api_client_ca_path is not None:
        try:
            read_certificates(settings.api_client_ca_path)
        except CertificateProblem as problem:
            raise SettingsError("api_client_ca_path", f"{problem}: the operator CA's certificates") from None
    host, _ = check_listen_address("api_listen", settings.api_listen)
    if settings.api_tls_certificate_path is None and not is_loopback(host):
        raise SettingsError(
            "api_listen",
            f"plain http is served on a loopback address only, got {settings.api_listen!r}: set "
            "api_tls_certificate_path and api_tls_key_path, or listen on 127.0.0.1",
        )
