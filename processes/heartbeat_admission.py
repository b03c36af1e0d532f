"""Admission to the heartbeat service before any check: how many requests an address may send."""

from __future__ import annotations

import time
from collections import OrderedDict

# Addresses whose request rate is tracked, least recently seen dropped first.
ADDRESSES_TRACKED = 10_000


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
