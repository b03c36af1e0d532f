"""Typed settings, read from ``SHEPHERD_*`` environment variables and checked at start.

Every setting has a default that suits a production deployment; the embedded
stack (``shepherd dev``) overrides the slow ones so a fleet comes up in minutes.
A bad value is refused with an error that names the setting, before anything
starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

ENV_PREFIX = "SHEPHERD_"

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


class SettingsError(ValueError):
    """A setting has a value Shepherd cannot run with."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"setting {setting} ({ENV_PREFIX}{setting.upper()}): {problem}")
        self.setting = setting


LOG_FORMATS = ("text", "json")


def check_listen_address(setting: str, value: str) -> tuple[str, int]:
    """(host, port) of a host:port setting; port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(setting, f"must be host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def parse_endpoint(text: str) -> tuple[str, int]:
    """(host, port) of a host:port others connect to: both present, the port 1-65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port, got {text!r}")
    return host, int(port)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``1.5s``, ``250ms``, ``5m`` or ``4h``."""
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration (examples: 30s, 250ms, 5m, 4h)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]


_SHOWN_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def format_duration(seconds: float, *, most_units: int = len(_SHOWN_UNITS)) -> str:
    """A duration as an operator reads it: 250ms, 1.5s, 45s, 1m30s, 2h30m, 1h00m05s, 30d.

    Under a minute it keeps its fraction; from a minute on it is whole seconds in days, hours, minutes and
    seconds, each unit after the first two digits wide, units of zero at the end left off. most_units keeps only
    the largest ones, cut as a clock cuts (5h12m for 5h12m40s), for a column of fixed width.
    """
    if seconds < 0:
        return "-" + format_duration(-seconds, most_units=most_units)
    if seconds < 60:
        return f"{seconds * 1000:g}ms" if 0 < seconds < 1 else f"{seconds:g}s"
    rest = round(seconds)
    counts: list[tuple[int, str]] = []
    for unit, size in _SHOWN_UNITS:
        count, rest = divmod(rest, size)
        if count or counts:
            counts.append((count, unit))
    counts = counts[:most_units]
    while counts[-1][0] == 0:
        counts.pop()
    (first, first_unit), *others = counts
    return f"{first}{first_unit}" + "".join(f"{count:02d}{unit}" for count, unit in others)


# A provider instance's name is part of workflow ids, schedule ids and task queues.
_INSTANCE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_INSTANCE_KEYS = ("name", "type", "activities_per_second")


@dataclass(frozen=True)
class ProviderInstance:
    """One source of machines a deployment manages: a name, a provider type and that type's options."""

    # Part of workflow ids, BMDB keys and the Provider search attribute.
    name: str
    # An entry point of the group shepherd.providers (sim and static are Shepherd's own).
    type: str
    # The type's own options (the static provider's inventory, the simulator's api_url); checked by the type.
    options: Mapping[str, Any] = field(default_factory=dict)
    # Temporal's server-side limit on this instance's provider activities, across all workers; 0: none.
    activities_per_second: float = 0.0


def _provider_instances(value: Any, path: Path) -> tuple[ProviderInstance, ...]:
    """The [[providers]] tables of a settings file, checked for shape; the types check their own options."""
    if not isinstance(value, list) or not all(isinstance(table, dict) for table in value):
        raise SettingsError("providers", f"must be [[providers]] tables in {path}")
    instances = []
    for number, table in enumerate(value, 1):
        where = f"[[providers]] table {number} in {path}"
        name, kind = table.get("name"), table.get("type")
        if not isinstance(name, str) or not _INSTANCE_NAME.match(name):
            raise SettingsError("providers", f"{where}: name must match {_INSTANCE_NAME.pattern}, got {name!r}")
        if not isinstance(kind, str) or not kind:
            raise SettingsError("providers", f"{where} ({name}): type must name a provider type, got {kind!r}")
        rate = table.get("activities_per_second", 0.0)
        if isinstance(rate, bool) or not isinstance(rate, int | float) or rate < 0:
            raise SettingsError("providers", f"{where} ({name}): activities_per_second must be >= 0, got {rate!r}")
        options = {key: option for key, option in table.items() if key not in _INSTANCE_KEYS}
        instances.append(ProviderInstance(name, kind, options, float(rate)))
    names = [instance.name for instance in instances]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise SettingsError("providers", f"each name once in {path}; given more than once: {', '.join(twice)}")
    return tuple(instances)


def _duration(default: float, doc: str) -> Any:
    return field(default=default, metadata={"duration": True, "doc": doc})


def _setting(default: Any, doc: str) -> Any:
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
    reconcile_interval: float = _duration(60.0, "Time between reconcile passes (the schedule)")
    device_creation_interval: float = _duration(5.0, "Time between two machine creations")

    # Worker
    max_concurrent_activities: int = _setting(200, "Activities one worker runs at once")
    max_activities_per_second: float = _setting(0.0, "Activity rate limit of one worker; 0 for none")
    max_concurrent_workflow_tasks: int = _setting(100, "Workflow tasks one worker runs at once")
    max_cached_workflows: int = _setting(
        1000, "Workflow runs one worker keeps in memory; the others are replayed from their history at their next task"
    )
    shutdown_grace: float = _duration(10.0, "How long a stopping worker lets running activities finish")

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
    def effective_ssh_key_path(self) -> Path:
        return self.ssh_key_path or self.state_dir / "ssh_key"

    def replace(self, **changes: Any) -> Settings:
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
            ("heartbeat_processes", 1),
        ):
            if getattr(self, name) < low:
                raise SettingsError(name, f"must be at least {low}, got {getattr(self, name)}")
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
        if self.heartbeat_max_skew > self.heartbeat_timeout:
            raise SettingsError(
                "heartbeat_max_skew",
                f"must not exceed heartbeat_timeout ({self.heartbeat_timeout:g}s), got {self.heartbeat_max_skew:g}s: "
                "a heartbeat that old would be accepted from a machine the watchdog reads as silent",
            )
        if not self.agent_target_path.startswith("/"):
            raise SettingsError("agent_target_path", f"must be an absolute path, got {self.agent_target_path!r}")
        if not self.providers and not _INSTANCE_NAME.match(self.provider):
            raise SettingsError("provider", f"must match {_INSTANCE_NAME.pattern}, got {self.provider!r}")
        if self.database_url is not None and not self.database_url.startswith(("postgresql://", "postgresql+")):
            raise SettingsError("database_url", "must be a postgresql:// URL")
        return self

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
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        hints = get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        for key in environ:
            if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() not in known:
                if key[len(ENV_PREFIX) :].lower() in _NON_SETTING_VARIABLES:
                    continue
                raise SettingsError(key[len(ENV_PREFIX) :].lower(), "is not a setting Shepherd knows")
        path = config_path or (Path(environ[CONFIG_VARIABLE]) if environ.get(CONFIG_VARIABLE) else None)
        if path is not None:
            for name, value in _read_config_file(path).items():
                if name not in known:
                    raise SettingsError(name, f"is not a setting Shepherd knows (in {path})")
                if name == "providers":
                    values[name], sources[name] = _provider_instances(value, path), f"file {path}"
                    continue
                f = next(f for f in fields(cls) if f.name == name)
                values[name] = _from_toml(name, value, hints[name], bool(f.metadata.get("duration")), path)
                sources[name] = f"file {path}"
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and f.name == "providers":
                raise SettingsError(
                    "providers", "are [[providers]] tables of the settings file (--config), not a variable"
                )
            if raw is not None:
                values[f.name] = _convert(f.name, raw, hints[f.name], bool(f.metadata.get("duration")))
                sources[f.name] = f"environment {ENV_PREFIX}{f.name.upper()}"
        for name, value in overrides.items():
            if value is not None:
                values[name] = value
                sources[name] = "command line"
        return cls(**values), sources


# Variables with the prefix that belong to other parts (the agent, the simulator), and the file's path.
CONFIG_VARIABLE = ENV_PREFIX + "CONFIG"
_NON_SETTING_VARIABLES = frozenset({"agent_state_dir", "sim_machine_root", "config"})


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as error:
        raise SettingsError("config", f"cannot read {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise SettingsError("config", f"{path} is not valid TOML: {error}") from None
    for name, value in document.items():
        if isinstance(value, dict) or (
            isinstance(value, list) and value and name != "providers" and any(isinstance(item, dict) for item in value)
        ):
            raise SettingsError(name, f"is a table in {path}; settings are plain keys, like temporal_address = ...")
    return document


def _from_toml(name: str, value: Any, hint: Any, duration: bool, path: Path) -> Any:
    """A TOML value as the setting's type; strings are read as an environment variable would be."""
    if isinstance(value, str):
        return _convert(name, value, hint, duration)
    arguments = [a for a in get_args(hint) if a is not type(None)]
    target = arguments[0] if arguments else hint
    fits = (
        (target is bool and isinstance(value, bool))
        or (target is int and isinstance(value, int) and not isinstance(value, bool))
        or (target is float and isinstance(value, int | float) and not isinstance(value, bool))
    )
    if not fits:
        expected = "a duration" if duration else getattr(target, "__name__", str(target))
        raise SettingsError(name, f"must be {expected}, got {value!r} ({type(value).__name__}) in {path}")
    return float(value) if target is float else value


def _convert(name: str, raw: str, hint: Any, duration: bool) -> Any:
    text = raw.strip()
    arguments = [a for a in get_args(hint) if a is not type(None)]
    optional = len(arguments) < len(get_args(hint))
    target = arguments[0] if arguments else hint
    if optional and text == "":
        return None
    try:
        if duration:
            return parse_duration(text)
        if target is bool:
            return _parse_bool(text)
        return target(text)
    except ValueError as exc:
        raise SettingsError(name, f"cannot use {raw!r}: {exc}") from None


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


# libpq takes secrets as URL parameters too: postgresql://host/db?password=...
_SECRET_PARAMETERS = re.compile(r"([?&](?:password|sslpassword)=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """The URL without its passwords, in the credentials or the parameters, for messages and logs."""
    url = _SECRET_PARAMETERS.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("?", 1)[0]:
        return url
    credentials, _, host = rest.partition("?")[0].rpartition("@")
    query = rest[len(credentials) + 1 + len(host) :]
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{query}" if ":" in credentials else url


def effective_settings(settings: Settings, sources: Mapping[str, str], *, as_json: bool = False) -> str:
    """Every setting as TOML a config file can take back (or JSON), the database password hidden."""
    values: dict[str, Any] = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.name == "database_url" and value:
            value = redact_url(value)
        values[f.name] = str(value) if isinstance(value, Path) else value
    # The instances in effect, the implicit one included: what the worker will run.
    tables = [
        {"name": i.name, "type": i.type, **i.options, "activities_per_second": i.activities_per_second}
        for i in settings.provider_instances
    ]
    values["providers"] = tables
    if as_json:
        return json.dumps({"settings": values, "sources": dict(sources)}, indent=2, default=str) + "\n"
    lines = []
    for name, value in values.items():
        source = sources.get(name, "default")
        if name == "providers":
            continue
        if value is None:
            lines.append(f"# {name} is unset  ({source})")
        else:
            lines.append(f"{name} = {_toml_value(value)}  # {source}")
    for table in tables:
        lines += ["", f"[[providers]]  # {sources.get('providers', 'from the provider setting')}"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def describe() -> list[tuple[str, str, str]]:
    """(environment variable, default, meaning) of every setting, for help texts and docs."""
    return [
        (ENV_PREFIX + f.name.upper(), "" if f.default is None else str(f.default), f.metadata.get("doc", ""))
        for f in fields(Settings)
    ]
