"""Where settings come from: a TOML file, ``SHEPHERD_*`` variables and the command line, each value read as its type.

Later sources win: the file (``--config``, or ``SHEPHERD_CONFIG``), then the environment, then the command line.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from foundation.provider_instances import provider_instances
from foundation.setting_values import ENV_PREFIX, SettingsError, parse_duration

# Variables with the prefix that belong to other parts (the agent, the simulator), and the file's path.
CONFIG_VARIABLE = ENV_PREFIX + "CONFIG"
_NON_SETTING_VARIABLES = frozenset({"agent_state_dir", "sim_machine_root", "config"})


def read_sources(
    settings_class: Any, environ: Mapping[str, str] | None, config_path: Path | None, overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of settings_class's fields that are not defaults, and where each came from."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    hints = get_type_hints(settings_class)
    known = {f.name for f in fields(settings_class)}
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
                values[name], sources[name] = provider_instances(value, path), f"file {path}"
                continue
            f = next(f for f in fields(settings_class) if f.name == name)
            values[name] = _from_toml(name, value, hints[name], bool(f.metadata.get("duration")), path)
            sources[name] = f"file {path}"
    for f in fields(settings_class):
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None and f.name == "providers":
            raise SettingsError("providers", "are [[providers]] tables of the settings file (--config), not a variable")
        if raw is not None:
            values[f.name] = _convert(f.name, raw, hints[f.name], bool(f.metadata.get("duration")))
            sources[f.name] = f"environment {ENV_PREFIX}{f.name.upper()}"
    for name, value in overrides.items():
        if value is not None:
            values[name] = value
            sources[name] = "command line"
    return values, sources


def _read_config_file(path: Path) -> dict[str, Any]:
    """The keys of a settings file, refused when it is no TOML or a setting is written as a table."""
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
    """A variable's text as the setting's type; empty is None for a setting that may be unset."""
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
