"""Group commit of agent heartbeats.

Heartbeats that arrive while earlier ones are being written wait and go to
BMDB together, in one statement, so a busy server writes fewer, larger
statements and an idle one still writes each heartbeat at once. Every caller
hears its own heartbeat's outcome, checked as if it had been written alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque

from bmdb.store import BMDB, Heartbeat, HeartbeatsNotRecorded

# Statements written at once. BMDB writes heartbeats on one connection, so more would only queue there; the next
# batch fills while one is written.
WRITERS = 1
# Heartbeats in one statement at most.
BATCH_SIZE = 1_000


class HeartbeatBatcher:
    """Records heartbeats in BMDB in batches: record() returns whether its own heartbeat was recorded."""

    def __init__(self, bmdb: BMDB, *, writers: int = WRITERS, batch_size: int = BATCH_SIZE) -> None:
        self.bmdb = bmdb
        self.writers = writers
        self.batch_size = batch_size
        self._queue: deque[tuple[Heartbeat, asyncio.Future[bool]]] = deque()
        # Writers run while heartbeats wait and end when none do: an idle server holds no task.
        self._writing: set[asyncio.Task[None]] = set()
        # Statements written and heartbeats in them: how well batching works, for the benchmark and the tests.
        self.statements = 0
        self.heartbeats = 0

    async def record(self, heartbeat: Heartbeat) -> bool:
        """Whether this heartbeat was recorded: False if it is a replay or its agent key is not the machine's."""
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append((heartbeat, outcome))
        if len(self._writing) < self.writers:
            self._writing.add(asyncio.create_task(self._write_while_queued()))
        return await outcome

    async def close(self) -> None:
        """Stop writing; heartbeats still waiting are answered as not recorded, with the reason."""
        for writer in list(self._writing):
            writer.cancel()
        await asyncio.gather(*self._writing, return_exceptions=True)
        self._fail([outcome for _, outcome in self._queue], "the heartbeat server is stopping")
        self._queue.clear()

    async def _write_while_queued(self) -> None:
        try:
            await self._write_batches()
        finally:
            # At once, not in a done callback a loop turn later: a heartbeat queued meanwhile would find this writer
            # still counted, start none, and wait forever.
            self._writing.discard(asyncio.current_task())

    async def _write_batches(self) -> None:
        while batch := self._next_batch():
            try:
                recorded = await self.bmdb.record_heartbeats([heartbeat for heartbeat, _ in batch])
            except asyncio.CancelledError:
                self._fail([outcome for _, outcome in batch], "the heartbeat server is stopping")
                raise
            except HeartbeatsNotRecorded as error:
                self._fail([outcome for _, outcome in batch], str(error))
                continue
            except Exception as error:
                # A fault of ours, not BMDB's: its callers hear it rather than wait forever, and it is raised.
                self._fail([outcome for _, outcome in batch], f"writing failed: {error!r}")
                raise
            self.statements += 1
            self.heartbeats += len(batch)
            for heartbeat, outcome in batch:
                if not outcome.done():  # its caller may have given up meanwhile
                    outcome.set_result(heartbeat.machine_id in recorded)

    def _next_batch(self) -> list[tuple[Heartbeat, asyncio.Future[bool]]]:
        """The oldest waiting heartbeats, one a machine: a second one of a machine waits for the next batch, so
        the two are checked against each other in the order they came."""
        batch: list[tuple[Heartbeat, asyncio.Future[bool]]] = []
        machines: set[uuid.UUID] = set()
        later: list[tuple[Heartbeat, asyncio.Future[bool]]] = []
        while self._queue and len(batch) < self.batch_size:
            item = self._queue.popleft()
            if item[1].done():
                continue
            if item[0].machine_id in machines:
                later.append(item)
                continue
            machines.add(item[0].machine_id)
            batch.append(item)
        self._queue.extendleft(reversed(later))
        return batch

    @staticmethod
    def _fail(outcomes: list[asyncio.Future[bool]], reason: str) -> None:
        for outcome in outcomes:
            if not outcome.done():
                outcome.set_exception(HeartbeatsNotRecorded(reason))
