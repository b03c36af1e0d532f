"""Sleeping for less than a millisecond, precisely, in asyncio.

asyncio rounds an idle loop's wait for its next timer up to the millisecond
(epoll's unit), so asyncio.sleep(0.0003) lasts about a millisecond. One thread
here keeps every pending wake-up and wakes each coroutine on its loop at its
time, to within the operating system's timer slack (tens of microseconds).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time


class PreciseSleeper:
    """sleep() with sub-millisecond precision; one thread, started on first use, serves every caller."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._changed = threading.Condition()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    async def sleep(self, seconds: float) -> None:
        """Wait seconds, never less, woken by the sleeper's thread rather than the event loop's coarser timer."""
        if seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        with self._changed:
            heapq.heappush(self._due, (time.monotonic() + seconds, next(self._order), loop, woken))
            if self._thread is None:
                self._thread = threading.Thread(target=self._wake_when_due, name="precise-sleep", daemon=True)
                self._thread.start()
            self._changed.notify()
        await woken

    def _wake_when_due(self) -> None:
        with self._changed:
            while True:
                if not self._due:
                    self._changed.wait()
                    continue
                left = self._due[0][0] - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                _, _, loop, woken = heapq.heappop(self._due)
                try:
                    loop.call_soon_threadsafe(_wake, woken)
                except RuntimeError:
                    pass  # its loop is closed: nobody waits any more


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # the sleeper may have been cancelled meanwhile
        woken.set_result(None)


# One for the process: a thread serves any number of sleepers.
precise_sleep = PreciseSleeper().sleep
