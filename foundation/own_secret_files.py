"""Shepherd's own key, certificate and configuration files: every file a setting names, and those the Temporal
client's configuration and the BMDB URL name.

Nothing Shepherd reads on another's word (a BMC password file of an inventory) may be one of them: read as a
password, a key would be sent to whoever that word names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from foundation.settings import Settings
from foundation.settings_sources import CONFIG_VARIABLE
from foundation.temporal_connection import DEFAULT_CONFIG_FILE, TemporalConfigError, load_temporal_connection

# libpq's parameters and variables that name a file: its keys and certificates, and the password file.
_DATABASE_FILE_PARAMETERS = ("sslkey", "sslcert", "sslrootcert", "sslcrl", "passfile")
_DATABASE_FILE_VARIABLES = ("PGPASSFILE", "PGSSLKEY", "PGSSLCERT", "PGSSLROOTCERT", "PGSERVICEFILE")
# Where libpq looks when nothing names them.
_DATABASE_DEFAULT_FILES = ("~/.pgpass", "~/.postgresql/postgresql.key", "~/.postgresql/postgresql.crt")
# The Temporal client's variables that name a file (its certificates, its key and its configuration).
_TEMPORAL_FILE_VARIABLES = (
    "TEMPORAL_CONFIG_FILE",
    "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
)
# Provider options that name a file end so (ca_file, password_file, clouds_file), or are the inventory itself.
_FILE_OPTION_SUFFIXES = ("_file", "_path")


def own_secret_files(settings: Settings, environ: Mapping[str, str] | None = None) -> dict[Path, str]:
    """Each of Shepherd's own files, as named (not resolved), with what it is in words for a refusal."""
    environ = os.environ if environ is None else environ
    found: dict[Path, str] = {settings.effective_ssh_key_path: "Shepherd's SSH key (setting ssh_key_path)"}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, Path):
            # agent_executable_path may name several, separated by ':'.
            for part in str(value).split(":") if f.name == "agent_executable_path" else [str(value)]:
                found.setdefault(Path(part), f"the file of setting {f.name}")
    for instance in settings.providers:
        for option, value in instance.options.items():
            if isinstance(value, str) and (option == "inventory" or option.endswith(_FILE_OPTION_SUFFIXES)):
                found.setdefault(Path(value), f"option {option} of provider instance {instance.name!r}")
    if environ.get(CONFIG_VARIABLE):
        found.setdefault(Path(environ[CONFIG_VARIABLE]), f"Shepherd's settings file ({CONFIG_VARIABLE})")
    found.update(_database_files(settings, environ))
    found.update(_temporal_files(settings, environ))
    return found


def _database_files(settings: Settings, environ: Mapping[str, str]) -> dict[Path, str]:
    """The files libpq reads for BMDB: those the URLs and the PG variables name, and its defaults."""
    found: dict[Path, str] = {}
    for name in ("database_url", "heartbeat_database_url"):
        url = getattr(settings, name, None)
        if not isinstance(url, str):
            continue
        try:
            parameters = parse_qsl(urlsplit(url).query)
        except ValueError:
            continue
        for key, value in parameters:
            if key in _DATABASE_FILE_PARAMETERS and value:
                found[Path(value)] = f"BMDB's {key} (setting {name})"
    for variable in _DATABASE_FILE_VARIABLES:
        if environ.get(variable):
            found[Path(environ[variable])] = f"BMDB's {variable}"
    for default in _DATABASE_DEFAULT_FILES:
        found.setdefault(Path(default).expanduser(), f"libpq's {default}")
    return found


def _temporal_files(settings: Settings, environ: Mapping[str, str]) -> dict[Path, str]:
    """The Temporal client's configuration file and the certificates and key it or the variables name."""
    config = environ.get("TEMPORAL_CONFIG_FILE") or DEFAULT_CONFIG_FILE
    found = {Path(config).expanduser(): "the Temporal client configuration (TEMPORAL_CONFIG_FILE), with its API key"}
    for variable in _TEMPORAL_FILE_VARIABLES[1:]:
        if environ.get(variable):
            found[Path(environ[variable])] = f"the Temporal client's {variable}"
    try:
        tls = load_temporal_connection(settings, environ).tls
    except TemporalConfigError:
        # A configuration that does not load is refused where Temporal is reached; the variables above still count.
        return found
    if tls is not None:
        for what, value in (
            ("TLS client key", tls.client_private_key),
            ("TLS client certificate", tls.client_cert),
            ("TLS server CA certificate", tls.server_root_ca_cert),
        ):
            if isinstance(value, Path):
                found.setdefault(value, f"the Temporal client's {what}")
    return found
