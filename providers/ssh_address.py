"""Where SSH reaches a machine, as an operator writes it: host, host:port or [IPv6]:port, checked in one place for
the static inventory's ``ssh`` and the address an Ironic node carries."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def parse_ssh_address(value: Any, what: str, *, bare_ipv6: bool = False) -> tuple[str, int | None]:
    """(host, port, None when none is given) of host[:port] or [IPv6]:port, the host without brackets as SSH clients
    take it; ValueError naming what the value is. bare_ipv6: an IPv6 address without brackets (and so without a
    port) is taken too."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string host[:port], got {value!r}")
    bad = ValueError(f"{what} must be host[:port] or [IPv6]:port, got {value!r}")
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise bad
        port_text = rest[1:] if rest else None
        _ipv6(host, what)
    elif value.count(":") > 1:
        if not bare_ipv6:
            raise ValueError(f"{what}: an IPv6 address goes in brackets, [{value}] or [{value}]:22")
        host, port_text = value, None
        _ipv6(host, what)
    else:
        host, colon, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if colon else None
        if not HOSTNAME.fullmatch(host):
            raise bad
    if port_text is None:
        return host, None
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{what}: port must be 1-65535, got {port_text!r} in {value!r}")
    return host, int(port_text)


def _ipv6(host: str, what: str) -> None:
    """ValueError unless host is an IPv6 address."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(f"{what}: {host!r} is not an IPv6 address") from None
