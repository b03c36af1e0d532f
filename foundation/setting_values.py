"""The text forms settings take, durations, host:port addresses and URLs, and the error that names a bad setting."""

from __future__ import annotations

import ipaddress
import math
import re
from urllib.parse import urlsplit

ENV_PREFIX = "SHEPHERD_"

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


class SettingsError(ValueError):
    """A setting has a value Shepherd cannot run with."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"setting {setting} ({ENV_PREFIX}{setting.upper()}): {problem}")
        self.setting = setting


def check_listen_address(setting: str, value: str) -> tuple[str, int]:
    """(host, port) of a host:port setting; port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(setting, f"must be host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def is_finite_number(value: object) -> bool:
    """Whether value is a number a setting may hold: an int or a float (not a bool), neither nan nor infinite. TOML
    writes nan and inf as numbers; nan passes every comparison, and inf makes timers that never fire."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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


def https_url_problem(url: str) -> str | None:
    """Why url cannot be trusted to say who signs what (an identity provider's, its keys'): None for an https://
    URL with a host, or an http:// one to a loopback address, where no one else on the path can answer instead."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return f"is not a URL: {url!r}"
    if parts.scheme not in ("https", "http") or not host:
        return f"must be an https:// URL, got {url!r}"
    if parts.scheme == "http" and not is_loopback(host):
        return f"must be an https:// URL (http:// only to a loopback address), got {url!r}"
    return None


def is_loopback(host: str) -> bool:
    """Whether a host name or address is this host's loopback alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
