"""The sub-millisecond sleep the heartbeat server's stand-in waits use."""

from __future__ import annotations

import asyncio
import time

from foundation.precise_sleep import PreciseSleeper


async def test_sleepers_wake_in_the_order_they_are_due_and_never_early():
    sleeper = PreciseSleeper()
    due: dict[float, float] = {}
    woken: list[float] = []

    async def sleep(seconds: float) -> None:
        started = time.monotonic()
        due[seconds] = started + seconds
        await sleeper.sleep(seconds)
        assert time.monotonic() - started >= seconds
        woken.append(seconds)

    await asyncio.gather(*(sleep(seconds) for seconds in (0.008, 0.001, 0.004, 0.002, 0.006)))
    # In the order they fall due, which is the order of their lengths unless a busy machine started them apart.
    assert woken == sorted(due, key=due.__getitem__)


async def test_a_cancelled_sleeper_does_not_hold_up_the_others():
    sleeper = PreciseSleeper()
    cancelled = asyncio.create_task(sleeper.sleep(0.001))
    await asyncio.sleep(0)
    cancelled.cancel()
    await sleeper.sleep(0.002)
    assert cancelled.cancelled()


async def test_nothing_to_wait_for_returns_at_once():
    sleeper = PreciseSleeper()
    await sleeper.sleep(0)
    await sleeper.sleep(-1)
    assert sleeper._thread is None, "no thread is started for it"


def test_one_sleeper_serves_several_event_loops():
    sleeper = PreciseSleeper()
    for _ in range(2):
        asyncio.run(sleeper.sleep(0.001))
