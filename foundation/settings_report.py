"""Settings as an operator reads them: every setting as TOML or JSON, the help table, a URL without its passwords."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from foundation.setting_values import ENV_PREFIX
from foundation.settings import Settings

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
