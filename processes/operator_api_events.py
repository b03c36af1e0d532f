"""The operator API's event log: a caller's share of it, and the stream that follows it as server-sent events.

The stream follows BMDB by reading the log past the last id it sent, once a second. LISTEN/NOTIFY would wake it
sooner, but a notification sent while the API's connection is down (PostgreSQL restarting, a fail-over) is lost
for good, and so would be the event; reading by id finds every event again once BMDB answers, and a client that
reconnects with Last-Event-ID is answered the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from aiohttp import web
from temporalio.client import Client

from bmdb.store import BMDB, Event
from lifecycle.contracts import MACHINE_WORKFLOW_TYPE, machine_workflow_id
from processes.operator_api_errors import ApiError

log = logging.getLogger("shepherd.api")

# How often the stream reads the log for new events.
POLL_SECONDS = 1.0
# A comment this often keeps proxies and clients from taking a quiet stream for a dead one.
KEEPALIVE_SECONDS = 15.0
# Ids are taken when an insert begins and seen when it commits, so a lower id can appear after a higher one: the
# stream waits this long at a gap for it, then takes the gap for an insert rolled back and goes on.
GAP_WAIT_SECONDS = 5.0
# Events read at once; a client far behind catches up in batches of this many.
BATCH = 500
# Between tries to read BMDB while it cannot be read, growing to the most.
RETRY_SECONDS, RETRY_MAX_SECONDS = 1.0, 10.0
# Machine workflows named in one visibility query when checking which are within a scope.
IDS_PER_QUERY = 100


def last_event_id(header: str | None) -> int | None:
    """The Last-Event-ID a reconnecting client sent (None: a new stream); ApiError 400 for anything but an id."""
    if header is None or not header.strip():
        return None
    text = header.strip()
    if not text.isdigit() or not text.isascii():
        raise ApiError(400, f"Last-Event-ID must be the id of an event this stream sent (a whole number), got {text!r}")
    return int(text)


async def machines_within(temporal: Client, scope: str, workflow_ids: Iterable[str]) -> set[str]:
    """Which of the machine workflows a grant's scope (a visibility query) selects."""
    # A quote or backslash cannot be put in a query safely, so such an id is never shown to be in the scope.
    wanted = sorted({w for w in workflow_ids if "'" not in w and "\\" not in w})
    within: set[str] = set()
    for start in range(0, len(wanted), IDS_PER_QUERY):
        ids = ", ".join(f"'{w}'" for w in wanted[start : start + IDS_PER_QUERY])
        query = f"WorkflowType = '{MACHINE_WORKFLOW_TYPE}' AND ({scope}) AND WorkflowId IN ({ids})"
        within |= {execution.id async for execution in temporal.list_workflows(query)}
    return within


async def visible(temporal: Client, scope: str | None, events: list[Event]) -> list[Event]:
    """The events a caller whose grants reach scope may see: all of them without a scope; else those of the
    machines it selects, and none of the fleet's own (they are not a machine's, so no scope of machines holds
    them)."""
    if scope is None:
        return events
    names = {e: machine_workflow_id(e.provider, e.provider_id) for e in events if e.provider and e.provider_id}
    within = await machines_within(temporal, scope, names.values())
    return [e for e in events if e in names and names[e] in within]


def event_record(event: Event) -> bytes:
    """One event as a server-sent event: its kind, its BMDB id, and its JSON."""
    data = {
        "id": event.event_id,
        "at": event.at.isoformat(),
        "kind": event.kind,
        "detail": event.detail,
        "machine_id": None if event.machine_id is None else str(event.machine_id),
        "provider": event.provider,
        "provider_id": event.provider_id,
    }
    # A kind is one word; the JSON is one line, so no field can break the record.
    return f"event: {event.kind}\nid: {event.event_id}\ndata: {json.dumps(data)}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment line, which clients ignore: a keep-alive, or a word for whoever reads the raw stream."""
    return f": {' '.join(text.split())}\n\n".encode()


class LogFollower:
    """Reads BMDB's event log past an id, in the order of the ids, holding back at a gap (GAP_WAIT_SECONDS)."""

    def __init__(
        self, after: int, *, gap_wait: float = GAP_WAIT_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.after = after
        self._gap_wait, self._clock = gap_wait, clock
        self._gaps: dict[int, float] = {}  # the first id missing at each gap -> when it was first seen missing

    async def read(self, bmdb: BMDB) -> list[Event]:
        """The next events past self.after that can be sent; self.after moves past them with advance()."""
        events = await bmdb.events_after(self.after, BATCH)
        now, expected = self._clock(), self.after + 1
        # Every gap of the batch is timed from now, so a client catching up waits once, not once a gap.
        for event in events:
            assert event.event_id is not None
            if event.event_id != expected:
                self._gaps.setdefault(expected, now)
            expected = event.event_id + 1
        ready, expected = [], self.after + 1
        for event in events:
            assert event.event_id is not None
            if event.event_id != expected and now - self._gaps[expected] < self._gap_wait:
                break
            ready.append(event)
            expected = event.event_id + 1
        return ready

    def advance(self, events: list[Event]) -> None:
        """Past these events, once they were sent (or left out for the caller's scope)."""
        if events:
            assert events[-1].event_id is not None
            self.after = events[-1].event_id
            self._gaps = {missing: seen for missing, seen in self._gaps.items() if missing > self.after}


@dataclass
class StreamSlots:
    """The event streams open at once, at most `most` (setting api_max_streams)."""

    most: int
    open: int = field(default=0)

    def take(self) -> None:
        """A slot for one more stream; ApiError 503 when all are taken."""
        if self.open >= self.most:
            full = f"{self.open} event streams are open, the most this API serves (api_max_streams)"
            raise ApiError(503, full, {"Retry-After": "10"})
        self.open += 1

    def give_back(self) -> None:
        self.open -= 1


async def follow(
    response: web.StreamResponse,
    follower: LogFollower,
    bmdb: Callable[[], Awaitable[BMDB]],
    keep: Callable[[list[Event]], Awaitable[list[Event]]],
    closing: asyncio.Event,
) -> None:
    """Send every new event that keep() leaves of each batch, until the client goes or the API closes. While BMDB
    (or Temporal, which keep() asks) cannot be read, the stream says so once in a comment and tries again, and
    goes on from the last event it sent: it never skips an event, nor sends one twice."""
    last_write, delay, failing = time.monotonic(), RETRY_SECONDS, False
    while not closing.is_set():
        try:
            events = await follower.read(await bmdb())
            shown = await keep(events)
        except Exception as error:  # BMDB or Temporal down, restarting, refusing: all retried the same way
            if not failing:
                log.warning("event stream: cannot read the event log: %s", error)
                await response.write(
                    comment(f"the event log cannot be read now; trying again, from event {follower.after}")
                )
                last_write = time.monotonic()
            failing = True
            await _pause(closing, delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)
            continue
        if failing:
            await response.write(comment("the event log is read again"))
        failing, delay = False, RETRY_SECONDS
        for event in shown:
            await response.write(event_record(event))
        follower.advance(events)
        if shown:
            last_write = time.monotonic()
        elif time.monotonic() - last_write >= KEEPALIVE_SECONDS:
            await response.write(comment("keep-alive"))
            last_write = time.monotonic()
        if len(events) < BATCH:
            await _pause(closing, POLL_SECONDS)


async def _pause(closing: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(closing.wait(), seconds)
    except TimeoutError:
        pass
