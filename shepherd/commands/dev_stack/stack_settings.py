"""What the embedded stack is: its ports, its state, what a run was asked for, and the settings it runs with."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from foundation.operator_proof import public_key_text
from foundation.provider_instances import ProviderInstance
from foundation.setting_values import ENV_PREFIX, SettingsError, parse_endpoint
from foundation.settings import Settings
from foundation.tls import local_certificates
from processes.api_signing_key import load_signing_key
from shepherd.commands.dev_stack.api_credentials import API_HOST, api_credentials

TEMPORAL_PORT = 7233
TEMPORAL_UI_PORT = 8233
SIM_API_PORT = 8800
# Where agents call back; the heartbeat server listens here.
HEARTBEAT_PORT = 8900
AGENT_ENDPOINT = f"127.0.0.1:{HEARTBEAT_PORT}"
# The operator API, over TLS; the deploy files' port too.
API_PORT = 8443
# Prometheus /metrics of each long-running child.
METRICS_PORTS = {"worker": 9464, "heartbeat-server": 9465, "simulator": 9466}


# What the embedded stack keeps in the state dir, and --fresh deletes.
DEV_STATE = ("temporal.db", "postgres", "sim", "logs", "agent", "ssh_key", "tls", "api", "dev-providers.toml")
# The provider instance of `shepherd dev --inventory`.
INVENTORY_INSTANCE = "static"


@dataclass(frozen=True)
class DevOptions:
    """What ``shepherd dev`` was asked for: fleet size, when to stop, and chaos; refuses flags that clash."""

    machines: int = 20
    until_ready: bool = False
    timeout: float = 600.0
    fresh: bool = False
    chaos: bool = False
    chaos_interval: float = 60.0
    chaos_kills: int | None = None  # None: until stopped
    # Real machines from a static inventory instead of the simulator, or from the [[providers]] of a settings
    # file (an existing Ironic, say), and where they reach the heartbeat server.
    inventory: Path | None = None
    providers: Path | None = None
    agent_endpoint: str | None = None
    # Escape hatch: a zipapp agent for this interpreter on the machines instead of the self-contained executable.
    agent_python: str | None = None

    @property
    def simulated(self) -> bool:
        """Whether the machines are the simulator's, not real ones."""
        return self.inventory is None and self.providers is None

    def __post_init__(self) -> None:
        if self.inventory is not None and self.providers is not None:
            raise ValueError("--inventory and --providers are two ways to name real machines: give one")
        if self.simulated and (self.agent_endpoint or self.agent_python):
            raise ValueError("--agent-endpoint and --agent-python go with --inventory or --providers")
        if not self.simulated and self.chaos:
            raise ValueError("--chaos kills agents through the simulator; it does not go with real machines")
        if self.chaos_kills is not None and not self.chaos:
            raise ValueError("--chaos-kills needs --chaos")
        if self.chaos and self.until_ready and self.chaos_kills is None:
            raise ValueError("--until-ready with --chaos needs --chaos-kills, or chaos never ends")
        if self.chaos_interval <= 0:
            raise ValueError(f"--chaos-interval must be positive, got {self.chaos_interval}")


def dev_settings(base: Settings, state: Path, options: DevOptions) -> Settings:
    """Settings of the embedded stack: everything local, back-offs and watch times short enough to watch.

    With an inventory the machines are real: the one provider instance reads it, every listed machine is taken
    (no limit), the heartbeat server listens on every interface at the port of --agent-endpoint, and the BMC
    password files are the inventory's folder's unless bmc_secrets_dir says otherwise. With a providers file, its
    [[providers]] are the stack's, and --machines is how many machines a pass takes at most.

    The operator API serves TLS on loopback and takes the local operator's client certificate (api_credentials);
    the worker trusts its signing key, and still accepts requests sent straight to Temporal.
    """
    api = api_credentials(state / "api")
    endpoint = options.agent_endpoint or AGENT_ENDPOINT
    host, port = parse_endpoint(endpoint)
    certificates = local_certificates(state / "tls" if endpoint == AGENT_ENDPOINT else state / "tls" / host, host)
    machines, listen = options.machines, AGENT_ENDPOINT
    providers: tuple[ProviderInstance, ...] = ()
    secrets_dir = base.bmc_secrets_dir
    if options.inventory is not None:
        machines, listen = 0, f"0.0.0.0:{port}"
        # On one host, the operator's own inventory next to its password files: their folder is where /etc/shepherd/bmc
        # would be in a deployment. Shepherd's own keys stay refused there too.
        secrets_dir = secrets_dir or options.inventory.parent
        providers = (ProviderInstance(INVENTORY_INSTANCE, "static", {"inventory": str(options.inventory)}),)
    elif options.providers is not None:
        listen = f"0.0.0.0:{port}"
        providers = Settings.from_env({}, config_path=options.providers).providers
        if not providers:
            raise SettingsError("providers", f"{options.providers} has no [[providers]] tables")
    return base.replace(
        heartbeat_listen=listen,
        heartbeat_tls_certificate_path=certificates.server_certificate,
        heartbeat_tls_key_path=certificates.server_key,
        agent_endpoint_ca_certificate_path=certificates.ca_certificate,
        heartbeat_interval=5.0,
        heartbeat_timeout=20.0,
        # One host, one clock: no more skew than the short timeout allows.
        heartbeat_max_skew=10.0,
        first_heartbeat_timeout=60.0,
        recovery_backoff_initial=5.0,
        recovery_backoff_maximum=60.0,
        recovery_backoff_multiplier=1.5,
        temporal_address=f"127.0.0.1:{TEMPORAL_PORT}",
        temporal_namespace="default",
        state_dir=state,
        sim_api_url=f"http://127.0.0.1:{SIM_API_PORT}",
        agent_executable_path=state / "agent",
        agent_endpoint=endpoint,
        max_machines=machines,
        chunk_size=min(machines or 50, 50),
        reconcile_interval=10.0,
        watchdog_interval=5.0,
        device_creation_interval=0.2,
        provision_backoff_initial=5.0,
        provision_backoff_maximum=60.0,
        agent_start_backoff_initial=5.0,
        agent_start_backoff_maximum=60.0,
        agent_start_backoff_multiplier=1.5,
        providers=providers,
        provider="sim",
        bmc_secrets_dir=secrets_dir,
        api_listen=f"{API_HOST}:{API_PORT}",
        api_signing_key_path=api.signing_key,
        api_policy_path=api.policy,
        api_tls_certificate_path=api.server_certificate,
        api_tls_key_path=api.server_key,
        api_client_ca_path=api.ca_certificate,
        api_trusted_keys=public_key_text(load_signing_key(api.signing_key).public_key),
    ).check()


def providers_file(settings: Settings, path: Path) -> Path:
    """A settings file of the stack's provider instances: what children read, [[providers]] having no variable."""
    lines = []
    for instance in settings.providers:
        lines += ["[[providers]]", f"name = {json.dumps(instance.name)}", f"type = {json.dumps(instance.type)}"]
        if instance.activities_per_second:
            # The rate limit is the instance's, not an option of its type: without it the children would run the
            # provider's queue unlimited.
            lines.append(f"activities_per_second = {json.dumps(instance.activities_per_second)}")
        lines += [f"{key} = {json.dumps(value)}" for key, value in instance.options.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def embedded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """environ without the operator's Temporal configuration: the embedded stack's processes reach its own dev
    server in plain text, whatever TLS, API key or profile the shell sets for a production cluster."""
    kept = {name: value for name, value in environ.items() if not name.startswith("TEMPORAL_")}
    return {**kept, "TEMPORAL_CONFIG_FILE": os.devnull}


def settings_environment(settings: Settings) -> dict[str, str]:
    """SHEPHERD_* variables that give a child process these settings (provider instances: see below)."""
    env = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        # [[providers]] tables have no variable; the child reads them from the same settings file.
        if value is not None and f.name != "providers":
            env[ENV_PREFIX + f.name.upper()] = str(value)
    return env
