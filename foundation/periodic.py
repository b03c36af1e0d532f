"""Work a process repeats at an interval for as long as it runs: its gauges, the watchdog's looks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def repeat_every(stop: asyncio.Event, interval: float, action: Callable[[], Awaitable[None]], what: str) -> None:
    """Run action every interval until stop is set; a failed one is logged, naming what, and run again next time:
    a round missed beats a process that stops."""
    while not stop.is_set():
        try:
            await action()
        except Exception as error:
            log.warning("%s failed: %s", what, error)
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except TimeoutError:
            pass
