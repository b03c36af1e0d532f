"""Settings as an operator reads them: every setting as TOML or JSON, the help table, secrets hidden."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from foundation.redaction import HIDDEN, redact_options, redact_url, redact_value, secret_name
from foundation.setting_values import ENV_PREFIX
from foundation.settings import Settings

# redact_url lives in foundation.redaction; the commands and BMDB have always found it here.
__all__ = ["describe", "effective_settings", "redact_url"]


def effective_settings(
    settings: Settings,
    sources: Mapping[str, str],
    *,
    as_json: bool = False,
    secret_options: Mapping[str, Collection[str] | None] | None = None,
) -> str:
    """Every setting as TOML a config file can take back (or JSON), secrets hidden: the credentials of every URL,
    and the provider options each instance's type marks secret (secret_options, by instance name; None for an
    instance whose type cannot say, all of whose options are then hidden)."""
    values: dict[str, Any] = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, str) and value and secret_name(f.name):
            value = HIDDEN
        values[f.name] = str(value) if isinstance(value, Path) else redact_value(value)
    # The instances in effect, the implicit one included: what the worker will run.
    secret = secret_options or {}
    tables = [
        {
            "name": i.name,
            "type": i.type,
            **redact_options(i.options, secret.get(i.name, ())),
            "activities_per_second": i.activities_per_second,
        }
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
