"""Admission to the heartbeat service before any check: which address a request counts against, and how many
requests (and BMDB reads) an address may cause."""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from contextvars import ContextVar

# Addresses whose request rate is tracked, least recently seen dropped first.
ADDRESSES_TRACKED = 10_000

# The address (address_of) of the request being handled, for the limits deeper down (the BMDB reads it may cause).
REQUEST_ADDRESS: ContextVar[str] = ContextVar("heartbeat_request_address", default="")


class AddressRates:
    """A token bucket an address: rate requests a second on average, burst at once; a rate of 0 is no limit.

    The addresses are a bounded memory, the least recently seen forgotten first (and given a full bucket when they
    come back).
    """

    def __init__(self, rate: float, burst: float, *, tracked: int = ADDRESSES_TRACKED) -> None:
        self.rate, self.burst, self.tracked = rate, burst, tracked
        # Address -> (tokens, when counted).
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, address: str) -> bool:
        """Take a token from the address's bucket; False when it is empty (too many requests from it)."""
        if self.rate <= 0:
            return True
        now = time.monotonic()
        tokens, then = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[address] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.tracked:
            self._buckets.popitem(last=False)
        return allowed


def address_of(peer: str, ipv6_prefix: int = 64) -> str:
    """What a gRPC peer ("ipv4:10.0.0.7:51234", "ipv6:[2001:db8::7]:51234") counts as in the per-address limits:
    its IPv4 address, or the IPv6 network of ipv6_prefix bits it is in, since one host is given a whole /64 and
    could otherwise take a fresh address for every request."""
    address = peer.partition(":")[2] or peer
    host = (address.rpartition(":")[0] or address).strip("[]")
    try:
        parsed = ipaddress.ip_address(host)
    except ValueError:
        return host  # a Unix socket, or a peer gRPC could not name
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, ipv6_prefix), strict=False))
    return host


class KeyReads:
    """How many BMDB reads of agent keys requests may cause: a budget an address and one for all together, so a
    flood of fresh machine ids or of bad signatures under a real id costs BMDB a bounded load, whoever sends it.
    A rate of 0 is no limit."""

    def __init__(self, per_address: float, overall: float) -> None:
        self._by_address = AddressRates(per_address, 2 * per_address)
        self._overall = AddressRates(overall, 2 * overall, tracked=1)

    def allow(self, address: str) -> bool:
        """Take a read from the address's budget and the overall one; False when either is spent."""
        return self._by_address.allow(address) and self._overall.allow("")
