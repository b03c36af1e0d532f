"""The workers' watchdog: every watchdog interval, a look for the silent machines of each provider instance.

The look is the fleet pass's (FleetActivities.look: one BMDB query, the circuit breaker, a heartbeat_lost signal
to each silent machine), made here so that watching a healthy fleet costs Temporal nothing: a scheduled pass
every minute is seven billable actions a minute per provider instance, whatever the fleet's size, where a look
made by a worker costs only the signals of the machines it finds silent. The workers take turns through BMDB, so
a provider instance gets about one look an interval however many workers run, and none while a fleet pass looks.
The fleet pass still looks too, at its own interval: a fleet whose workers all fail to look is still watched.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from sqlalchemy.exc import DBAPIError
from temporalio.service import RPCError, RPCStatusCode

from activities.fleet import FleetActivities
from bmdb.connection_errors import connection_failure, first_line
from foundation.periodic import repeat_every
from foundation.settings import Settings
from lifecycle.contracts import fleet_schedule_id
from lifecycle.inputs import watchdog_input

log = logging.getLogger("shepherd.watchdog")


async def watch_fleet(stop: asyncio.Event, fleet: FleetActivities, settings: Settings, *, identity: str) -> None:
    """Look for every provider instance's silent machines each watchdog interval until stop is set.

    A look another worker made in the last half interval counts as this one's, so two workers started together
    share the looks rather than doubling them. An operator's pause of a provider's fleet schedule pauses its looks
    too: a paused fleet signals no silent machine. A look that fails (BMDB unreachable, say) is logged and made
    again at the next interval; nothing is lost, since the silence is still in BMDB then.
    """
    every = settings.watchdog_interval

    async def look_at_every_provider() -> None:
        for instance in settings.provider_instances:
            try:
                outcome = await _take_turn(fleet, settings, instance.name, by=f"worker {identity}")
            except Exception as error:  # the next interval looks again; a worker that stops watching helps no one
                log.warning(
                    "watchdog of provider %s did not look: %s; looking again in %gs",
                    instance.name,
                    _one_line(fleet, error),
                    every,
                )
                outcome = "failed"
            fleet.deps.metrics.watchdog_looks.add(1, {"provider": instance.name, "outcome": outcome})

    await repeat_every(stop, every, look_at_every_provider, "the watchdog's looks")


async def _take_turn(fleet: FleetActivities, settings: Settings, provider: str, *, by: str) -> str:
    """This worker's turn at the provider's silent machines: what came of it (looked, another_looked, paused)."""
    if await _paused(fleet, provider):
        return "paused"
    look = watchdog_input(settings, provider, datetime.now(UTC).isoformat())
    # The look logs whom it signalled and any hold itself.
    watched = await fleet.look_if_due(look, unless_within=settings.watchdog_interval / 2, by=by)
    return "another_looked" if watched is None else "looked"


async def _paused(fleet: FleetActivities, provider: str) -> bool:
    """Whether an operator paused the provider's fleet schedule; a schedule deleted by hand pauses nothing."""
    try:
        described = await fleet.deps.client.get_schedule_handle(fleet_schedule_id(provider)).describe()
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return described.schedule.state.paused


def _one_line(fleet: FleetActivities, error: Exception) -> str:
    """Why a look failed, on one line; for BMDB, its host and the cause, never its password."""
    if isinstance(error, DBAPIError | OSError):
        return connection_failure(fleet.deps.bmdb.url, error)
    return first_line(error)
