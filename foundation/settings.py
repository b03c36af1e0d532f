"""Typed settings, read from ``SHEPHERD_*`` environment variables and checked at start.

Every setting has a default that suits a production deployment; the embedded
stack (``shepherd dev``) overrides the slow ones so a fleet comes up in minutes.
A bad value is refused with an error that names the setting, before anything
starts. Where the values come from is foundation.settings_sources, how they are shown
foundation.settings_report, the text forms they take foundation.setting_values.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from foundation.operator_proof import OperatorTrust
from foundation.operator_settings import (
    UNVERIFIED_OPERATOR_ACTIONS,
    check_api_settings,
    check_login_settings,
    check_operator_settings,
    operator_trust,
)
from foundation.provider_instances import INSTANCE_NAME, ProviderInstance
from foundation.setting_values import SettingsError, check_listen_address, parse_endpoint
from foundation.settings_sources import read_sources

# A provider plugin's factory imports ProviderInstance and SettingsError from here (docs/providers.md), so they
# stay importable from this module too.
__all__ = ["LOG_FORMATS", "UNVERIFIED_OPERATOR_ACTIONS", "ProviderInstance", "Settings", "SettingsError"]

LOG_FORMATS = ("text", "json")
# Where the deploy files and docs put BMC password files.
DEFAULT_BMC_SECRETS_DIR = Path("/etc/shepherd/bmc")
# Variables a BMC password prefix must never reach: Shepherd's settings and the Temporal client's configuration.
_OWN_VARIABLE_PREFIXES = ("SHEPHERD_", "TEMPORAL_")


def _duration(default: float, doc: str) -> Any:
    """A setting that is a duration: given as 30s, 250ms, 5m or 4h, and checked to be positive."""
    return field(default=default, metadata={"duration": True, "doc": doc})


def _setting(default: Any, doc: str) -> Any:
    """A setting with its default and the meaning its help text shows."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Settings:
    """Every setting of Shepherd, with its default and meaning; read by from_env (or resolve), checked by check()."""

    # Temporal
    # Unset: the Temporal CLI's configuration (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, temporal.toml), which also
    # gives TLS, client certificates and API keys; see foundation/temporal_connection.py.
    temporal_address: str | None = _setting(None, "Temporal frontend host:port, over the Temporal configuration's")
    temporal_namespace: str | None = _setting(None, "Temporal namespace, over the Temporal configuration's")
    task_queue: str = _setting("shepherd", "Task queue of all workflows and activities")

    # BMDB
    database_url: str | None = _setting(
        None, "BMDB PostgreSQL URL (postgresql://...); unset: a local PostgreSQL under state_dir"
    )
    heartbeat_database_url: str | None = _setting(
        None, "BMDB URL the heartbeat server uses, of a user granted shepherd_heartbeat alone; unset: database_url"
    )
    state_dir: Path = _setting(Path(".shepherd"), "Directory for local state (embedded PostgreSQL, keys)")

    # Provider
    provider: str = _setting("sim", "Provider of the one instance when no [[providers]] are configured; 'sim'")
    providers: tuple[ProviderInstance, ...] = _setting((), "Provider instances: [[providers]] tables in the file")
    sim_api_url: str = _setting("http://127.0.0.1:8800", "Base URL of the simulator's provider API")
    provider_timeout: float = _duration(10.0, "Timeout of one provider API call")
    reboot_timeout: float = _duration(600.0, "Longest one reboot may take through a provider or BMC, confirmed")
    boot_deadline: float = _duration(
        900.0, "After a recovery reboot, how long the machine may take to answer SSH before takeovers are tried"
    )
    # Where a static inventory may take BMC passwords from: an inventory may be another's file, so it reads only
    # what the operator put there for it, never Shepherd's own keys nor its variables.
    bmc_secrets_dir: Path | None = _setting(
        None, "Directory the inventories' BMC password files must be in; unset: /etc/shepherd/bmc"
    )
    bmc_password_env_prefix: str = _setting(
        "BMC_PASSWORD_", "Prefix of the environment variables an inventory's password_env may name"
    )

    # SSH and the agent
    ssh_key_path: Path | None = _setting(None, "Shepherd's ed25519 SSH key; unset: state_dir/ssh_key")
    ssh_user: str = _setting("root", "User Shepherd logs in as on machines")
    ssh_connect_timeout: float = _duration(2.0, "Timeout of SSH connect, handshake and authentication")
    ssh_exec_timeout: float = _duration(60.0, "Timeout of agent upload, start and reply")
    agent_executable_path: Path | None = _setting(
        None, "Agent executable uploaded to machines; several, one per architecture, separated by ':'"
    )
    agent_target_path: str = _setting("/root/agent", "Path on the machine the agent is uploaded to")
    agent_endpoint: str = _setting("", "host:port the agent calls back (heartbeats)")
    agent_endpoint_ca_certificate_path: Path | None = _setting(
        None,
        "PEM CA certificate of the agent endpoint, or a bundle of several during a CA rotation; unset: the agent uses "
        "its system trust store",
    )

    # Heartbeat server (the agent callback API)
    heartbeat_listen: str = _setting("0.0.0.0:8900", "host:port the heartbeat server listens on")
    heartbeat_tls_certificate_path: Path | None = _setting(None, "PEM certificate chain of the heartbeat server")
    heartbeat_tls_key_path: Path | None = _setting(None, "PEM private key of the heartbeat server")
    heartbeat_plaintext: bool = _setting(False, "Serve heartbeats without TLS (behind a TLS-terminating proxy)")
    heartbeat_interval: float = _duration(30.0, "How often agents are asked to send a heartbeat")
    heartbeat_max_skew: float = _duration(300.0, "Largest difference between agent and server clocks accepted")
    heartbeat_peer_rate: float = _setting(
        5000.0, "Heartbeats one address may send a second, in bursts of twice that (0: no limit)"
    )
    heartbeat_max_streams: int = _setting(
        200_000, "Heartbeat streams one server process keeps open at once (an agent keeps one open)"
    )
    heartbeat_max_streams_per_address: int = _setting(
        5_000,
        "Heartbeat streams one server process keeps open at once from one address, so one host cannot take them all "
        "(0: no limit; behind a proxy that hides the agents' addresses)",
    )
    heartbeat_max_connections: int = _setting(
        210_000,
        "Connections one heartbeat server process keeps open at once, past which a new one is closed as it comes (an "
        "agent holds one, streaming or not); at least heartbeat_max_streams",
    )
    heartbeat_max_connections_per_address: int = _setting(
        5_000,
        "Connections one heartbeat server process keeps open at once from one address; past it the extra ones are "
        "closed, those without a stream first (0: no limit; behind a proxy that hides the agents' addresses)",
    )
    heartbeat_idle_timeout: float = _duration(
        120.0,
        "A heartbeat connection with no call open this long is closed; at least twice heartbeat_interval, so an "
        "agent sending unary calls keeps its connection",
    )
    heartbeat_ipv6_prefix: int = _setting(
        64, "Prefix length an IPv6 address is counted by in the per-address limits: a host holds a whole /64"
    )
    heartbeat_key_reads_per_address: float = _setting(
        20.0,
        "BMDB reads of an agent key a second that heartbeats from one address may cause (a key not cached, or one "
        "that did not verify), in bursts of twice that; past it they are refused as if unknown (0: no limit)",
    )
    heartbeat_key_reads: float = _setting(
        1000.0,
        "BMDB reads of an agent key a second that all heartbeats together may cause, in bursts of twice that "
        "(0: no limit)",
    )
    heartbeat_processes: int = _setting(
        1, "Heartbeat server processes sharing its port, for hosts with more cores; process i serves /metrics on port+i"
    )

    # Lifecycle back-offs (the seed's defaults)
    agent_start_backoff_initial: float = _duration(300.0, "First wait after a failed agent start")
    agent_start_backoff_maximum: float = _duration(4 * 3600.0, "Longest wait between agent starts")
    agent_start_backoff_multiplier: float = _setting(1.2, "Growth of the agent-start wait")
    provision_backoff_initial: float = _duration(60.0, "First wait after a failed provisioning")
    provision_backoff_maximum: float = _duration(3600.0, "Longest wait between provisioning attempts")
    provision_backoff_multiplier: float = _setting(1.2, "Growth of the provisioning wait")

    provisioning_deadline: float = _duration(3600.0, "PROVISIONING longer than this: flag the machine stuck")
    agent_start_deadline: float = _duration(4 * 3600.0, "AGENT_STARTING longer than this: flag the machine stuck")

    recovery_backoff_initial: float = _duration(60.0, "First wait after a failed recovery reboot")
    recovery_backoff_maximum: float = _duration(3600.0, "Longest wait between recovery reboots")
    recovery_backoff_multiplier: float = _setting(1.2, "Growth of the recovery wait")

    # Heartbeat watch (the seed's recovery rule)
    first_heartbeat_timeout: float = _duration(1800.0, "Agent started this long ago without any heartbeat: recover")
    heartbeat_timeout: float = _duration(600.0, "Last heartbeat older than this: recover")

    # Recovery safety: a machine that keeps dying waits for a human
    recovery_budget: int = _setting(3, "Recoveries of a machine within recovery_budget_window; one more quarantines it")
    recovery_budget_window: float = _duration(3600.0, "The window the recovery budget counts in")
    reimage_before_quarantine: bool = _setting(
        True, "With the budget spent, reimage a machine once through a provider that can, before a quarantine"
    )
    # Many machines silent at once is more likely our fault than theirs
    recovery_hold_min_machines: int = _setting(
        5, "Hold every recovery of a provider when more of its machines than this are silent at once"
    )
    recovery_hold_fraction: float = _setting(
        0.1, "... or more than this fraction of its watched machines, whichever is larger"
    )

    # Fleet reconciliation (the seed's Provisioner)
    max_machines: int = _setting(50, "Most machines brought under management; 0 for no limit")
    chunk_size: int = _setting(20, "Most machines created in one reconcile pass")
    reconcile_interval: float = _duration(
        900.0, "Time between reconcile passes (the schedule); a pass that admitted a whole chunk goes on at once"
    )
    watchdog_interval: float = _duration(60.0, "How often a worker looks for silent machines, in turn with the others")
    device_creation_interval: float = _duration(5.0, "Time between two machine creations")

    # Worker
    max_concurrent_activities: int = _setting(200, "Activities one worker runs at once")
    max_activities_per_second: float = _setting(0.0, "Activity rate limit of one worker; 0 for none")
    max_concurrent_workflow_tasks: int = _setting(100, "Workflow tasks one worker runs at once")
    max_cached_workflows: int = _setting(
        1000, "Workflow runs one worker keeps in memory; the others are replayed from their history at their next task"
    )
    shutdown_grace: float = _duration(10.0, "How long a stopping worker lets running activities finish")

    # Operator identity: OIDC (docs/security.md#operators-and-their-tokens)
    oidc_issuer: str = _setting(
        "", "Issuer URL of the OIDC provider that vouches for operators (https://, http:// on loopback); empty: none"
    )
    oidc_audience: str = _setting("", "Audience (resource indicator) of the operator API: access tokens name it in aud")
    oidc_client_id: str = _setting("", "Client id of `shepherd login` at the OIDC provider (a public client)")

    # Where the shepherd commands send operators' reads and requests (docs/operations.md#the-operator-api)
    api_url: str = _setting(
        "", "URL of the operator API the commands go through; empty: straight to Temporal and BMDB (embedded stack)"
    )
    api_ca_path: Path | None = _setting(
        None, "PEM CA bundle the commands check the operator API's certificate with; unset: the system's CAs"
    )
    api_client_certificate_path: Path | None = _setting(
        None, "PEM client certificate the commands show the operator API instead of a login's token"
    )
    api_client_key_path: Path | None = _setting(None, "PEM private key of api_client_certificate_path")
    bulk_max_machines: int = _setting(
        50, "Most machines a --where action touches on --yes alone; above it, only with --max N of at least the count"
    )

    # Operator requests sent straight to Temporal, and those the operator API signs (docs/security.md)
    api_trusted_keys: str = _setting(
        "",
        "Public keys of the operator API, ed25519:<base64>, comma-separated (two during a key rotation): a request "
        "signed with one is recorded as verified",
    )
    unverified_operator_actions: str = _setting(
        "accept",
        "Operator requests without the operator API's proof: accept (recorded as unverified), or refuse_destructive "
        "(decommission and release refused; force_recover, maintenance and agent restarts still taken)",
    )

    # Who may do what through the operator API (docs/security.md#who-may-do-what-the-policy)
    api_policy_path: Path | None = _setting(
        None, "TOML file of the operator API's roles, grants and confirmations; unset: no policy, nothing is granted"
    )

    # The operator API process, `shepherd api` (docs/operations.md#the-operator-api)
    api_listen: str = _setting("127.0.0.1:8700", "host:port the operator API listens on")
    api_signing_key_path: Path | None = _setting(
        None, "File (mode 0600) of the operator API's ed25519 signing key, the base64 of its 32-byte seed"
    )
    api_tls_certificate_path: Path | None = _setting(
        None, "PEM certificate chain of the operator API; unset: plain http, on a loopback address only"
    )
    api_tls_key_path: Path | None = _setting(None, "PEM private key of the operator API's certificate")
    api_approval_wait: float = _duration(
        3600.0, "How long a request the policy gives to two people waits for the second operator before it expires"
    )
    api_client_ca_path: Path | None = _setting(
        None,
        "PEM bundle of the operator CA (two during its rotation; their CRLs to check revocations): operators may show "
        "a client certificate of it instead of a token; needs api_tls_certificate_path",
    )
    api_max_streams: int = _setting(
        100, "Event streams (GET /v1/events/stream) the operator API serves at once; past it a client is answered 503"
    )

    # Observability, per process
    metrics_listen: str = _setting("", "host:port this process serves Prometheus /metrics on; empty: none")
    log_format: str = _setting("text", "Log lines as text or json")

    @property
    def provider_instances(self) -> tuple[ProviderInstance, ...]:
        """The configured [[providers]], or the one instance that the provider setting names."""
        return self.providers or (ProviderInstance(self.provider, self.provider),)

    def provider_instance(self, name: str) -> ProviderInstance:
        """The instance of that name; SettingsError when there is none."""
        for instance in self.provider_instances:
            if instance.name == name:
                return instance
        known = ", ".join(instance.name for instance in self.provider_instances)
        raise SettingsError("providers", f"no provider instance {name!r} (configured: {known})")

    @property
    def agent_executable_paths(self) -> tuple[Path, ...]:
        """The agent executables, one per kind of machine: agent_executable_path split at ':'."""
        if self.agent_executable_path is None:
            return ()
        return tuple(Path(part) for part in str(self.agent_executable_path).split(":") if part)

    @property
    def effective_bmc_secrets_dir(self) -> Path:
        """The directory BMC password files must be in: bmc_secrets_dir, or /etc/shepherd/bmc when it is unset."""
        return self.bmc_secrets_dir or DEFAULT_BMC_SECRETS_DIR

    @property
    def effective_ssh_key_path(self) -> Path:
        """Shepherd's SSH key: ssh_key_path, or ssh_key under state_dir when it is unset."""
        return self.ssh_key_path or self.state_dir / "ssh_key"

    def replace(self, **changes: Any) -> Settings:
        """These settings with some values changed; nothing here checks the new values."""
        return dataclasses.replace(self, **changes)

    def check(self) -> Settings:
        """Refuse values Shepherd cannot run with; returns self so calls chain."""
        if self.metrics_listen:
            check_listen_address("metrics_listen", self.metrics_listen)
        if self.log_format not in LOG_FORMATS:
            raise SettingsError("log_format", f"must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            # nan passes every comparison below, and inf makes timers that never fire.
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f.name, f"must be a finite number, got {value}")
            if f.metadata.get("duration") and value <= 0:
                raise SettingsError(f.name, f"must be a positive duration, got {value}")
        for name in ("agent_start_backoff_multiplier", "provision_backoff_multiplier", "recovery_backoff_multiplier"):
            if getattr(self, name) < 1.0:
                raise SettingsError(name, f"must be at least 1.0, got {getattr(self, name)}")
        for name, low in (
            ("chunk_size", 1),
            ("max_machines", 0),
            ("max_concurrent_activities", 1),
            ("max_concurrent_workflow_tasks", 2),
            ("max_cached_workflows", 0),
            ("max_activities_per_second", 0),
            ("recovery_hold_min_machines", 1),
            ("recovery_budget", 1),
            ("heartbeat_peer_rate", 0),
            ("heartbeat_max_streams", 1),
            ("heartbeat_max_streams_per_address", 0),
            ("heartbeat_max_connections_per_address", 0),
            ("heartbeat_key_reads_per_address", 0),
            ("heartbeat_key_reads", 0),
            ("heartbeat_processes", 1),
            ("api_max_streams", 1),
            ("bulk_max_machines", 1),
        ):
            if getattr(self, name) < low:
                raise SettingsError(name, f"must be at least {low}, got {getattr(self, name)}")
        if not 1 <= self.heartbeat_ipv6_prefix <= 128:
            raise SettingsError("heartbeat_ipv6_prefix", f"must be 1 to 128, got {self.heartbeat_ipv6_prefix}")
        if not 0 < self.recovery_hold_fraction <= 1:
            fraction = self.recovery_hold_fraction
            raise SettingsError("recovery_hold_fraction", f"must be above 0 and at most 1, got {fraction}")
        if self.agent_start_backoff_maximum < self.agent_start_backoff_initial:
            raise SettingsError("agent_start_backoff_maximum", "must not be below agent_start_backoff_initial")
        if self.recovery_backoff_maximum < self.recovery_backoff_initial:
            raise SettingsError("recovery_backoff_maximum", "must not be below recovery_backoff_initial")
        if self.provision_backoff_maximum < self.provision_backoff_initial:
            raise SettingsError("provision_backoff_maximum", "must not be below provision_backoff_initial")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise SettingsError(
                "heartbeat_interval",
                f"must be below heartbeat_timeout ({self.heartbeat_timeout:g}s), got {self.heartbeat_interval:g}s: "
                "every agent would be found silent between two heartbeats",
            )
        if self.heartbeat_max_connections < self.heartbeat_max_streams:
            raise SettingsError(
                "heartbeat_max_connections",
                f"must be at least heartbeat_max_streams ({self.heartbeat_max_streams:,}), got "
                f"{self.heartbeat_max_connections:,}: an agent holds its stream on a connection of its own",
            )
        if self.heartbeat_idle_timeout < 2 * self.heartbeat_interval:
            raise SettingsError(
                "heartbeat_idle_timeout",
                f"must be at least twice heartbeat_interval ({self.heartbeat_interval:g}s), got "
                f"{self.heartbeat_idle_timeout:g}s: an agent sending unary calls would lose its connection between "
                "two heartbeats",
            )
        if self.heartbeat_max_skew > self.heartbeat_timeout:
            raise SettingsError(
                "heartbeat_max_skew",
                f"must not exceed heartbeat_timeout ({self.heartbeat_timeout:g}s), got {self.heartbeat_max_skew:g}s: "
                "a heartbeat that old would be accepted from a machine the watchdog reads as silent",
            )
        self._check_bmc_password_env_prefix()
        if not self.agent_target_path.startswith("/"):
            raise SettingsError("agent_target_path", f"must be an absolute path, got {self.agent_target_path!r}")
        if not self.providers and not INSTANCE_NAME.match(self.provider):
            raise SettingsError("provider", f"must match {INSTANCE_NAME.pattern}, got {self.provider!r}")
        for name in ("database_url", "heartbeat_database_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("postgresql://", "postgresql+")):
                raise SettingsError(name, "must be a postgresql:// URL")
        check_operator_settings(self)
        return self

    def operator_trust(self) -> OperatorTrust:
        """What this worker's machine workflows trust of operator requests; SettingsError naming a bad setting."""
        return operator_trust(self)

    def check_login(self) -> Settings:
        """What `shepherd login` needs on top of check(): an issuer, the API's audience and the client id."""
        self.check()
        check_login_settings(self)
        return self

    def check_api(self) -> Settings:
        """What the operator API needs on top of check(): an issuer and audience to verify tokens with (or an
        operator CA for client certificates), a key to sign with, a policy to decide with (each missing one named),
        and TLS unless it listens on loopback alone."""
        self.check()
        check_api_settings(self)
        return self

    def _check_bmc_password_env_prefix(self) -> None:
        prefix = self.bmc_password_env_prefix
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
            problem = f"must be the start of a variable name, such as BMC_PASSWORD_, got {prefix!r}"
            raise SettingsError("bmc_password_env_prefix", problem)
        for own in _OWN_VARIABLE_PREFIXES:
            # Either way round: SHEPHERD_DATABASE_ and S both reach SHEPHERD_DATABASE_URL.
            if own.startswith(prefix) or prefix.startswith(own):
                raise SettingsError(
                    "bmc_password_env_prefix",
                    f"must not reach the {own} variables (Shepherd's own and Temporal's secrets), got {prefix!r}",
                )

    def check_agent(self) -> Settings:
        """What a worker that starts agents needs on top of check()."""
        self.check()
        if not self.agent_executable_paths:
            raise SettingsError("agent_executable_path", "must be set to the agent executable to upload")
        for path in self.agent_executable_paths:
            if not path.is_file():
                raise SettingsError("agent_executable_path", f"{path} is not a readable file")
        if not self.agent_endpoint:
            raise SettingsError("agent_endpoint", "must be set to the host:port agents call back")
        try:
            parse_endpoint(self.agent_endpoint)
        except ValueError as error:
            raise SettingsError("agent_endpoint", str(error)) from None
        ca = self.agent_endpoint_ca_certificate_path
        if ca is not None and not ca.is_file():
            raise SettingsError("agent_endpoint_ca_certificate_path", f"{ca} is not a readable file")
        return self

    def check_heartbeat_server(self) -> Settings:
        """What the heartbeat server needs on top of check()."""
        self.check()
        check_listen_address("heartbeat_listen", self.heartbeat_listen)
        if self.heartbeat_plaintext:
            return self
        for name in ("heartbeat_tls_certificate_path", "heartbeat_tls_key_path"):
            path = getattr(self, name)
            if path is None:
                raise SettingsError(name, "must be set, or heartbeat_plaintext=true to serve without TLS")
            if not path.is_file():
                raise SettingsError(name, f"{path} is not a readable file")
        return self

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, config_path: Path | None = None, **overrides: Any
    ) -> Settings:
        """Settings from the defaults, a TOML file, ``SHEPHERD_<NAME>`` variables and overrides (CLI flags)."""
        return cls.resolve(environ, config_path=config_path, **overrides)[0]

    @classmethod
    def resolve(
        cls, environ: Mapping[str, str] | None = None, *, config_path: Path | None = None, **overrides: Any
    ) -> tuple[Settings, dict[str, str]]:
        """The settings, and where each one that is not a default came from.

        Later sources win: the TOML file (``--config``, or ``SHEPHERD_CONFIG``),
        then environment variables, then explicit overrides.
        """
        values, sources = read_sources(cls, environ, config_path, overrides)
        return cls(**values), sources
