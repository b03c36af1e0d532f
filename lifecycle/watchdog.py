"""The watchdog's circuit breaker: when silent machines mean our fault, not theirs, hold every recovery.

Machines fail one by one. Many of them silent at once, or no heartbeat accepted
from any machine at all, more likely means the heartbeat path, BMDB, a
certificate or the network failed, and rebooting the fleet would turn our
outage into the operators' outage.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from lifecycle.contracts import RecoveryHoldRule


def hold_threshold(rule: RecoveryHoldRule, watched: int) -> int:
    """How many of a provider's machines may be silent at once before its recoveries are held."""
    return max(rule.min_machines, math.ceil(rule.fraction * watched))


def hold_reason(rule: RecoveryHoldRule, *, silent: int, watched: int, last_heartbeat_age: float | None) -> str | None:
    """Why this pass must hold the provider's recoveries; None when recovering the silent machines is safe.

    last_heartbeat_age: seconds since the newest heartbeat accepted from any machine of any provider (the heartbeat
    path is shared), None when BMDB holds none. Healthy machines call every heartbeat interval, so a quiet path
    shows long before any machine counts as silent, even in a fleet too small for the count to trip.
    """
    if silent == 0:
        return None
    threshold = hold_threshold(rule, watched)
    if silent > threshold:
        return (
            f"{silent} of {watched} watched machines silent at once, more than {threshold}: "
            "more likely the heartbeat path, BMDB or the network than the machines"
        )
    if last_heartbeat_age is None:
        return "no heartbeat accepted from any machine yet: the heartbeat path looks down"
    if last_heartbeat_age > rule.quiet_path_after:
        return (
            f"no heartbeat accepted from any machine for {last_heartbeat_age:.0f}s "
            f"(more than {rule.quiet_path_after:g}s): the heartbeat path looks down"
        )
    return None


def spared_after_hold(
    rule: RecoveryHoldRule, *, last_seen: datetime, hold_ended: datetime | None, as_of: datetime
) -> bool:
    """Whether a silent machine is left alone because it fell silent while its provider's recoveries were held.

    Its agent may still be waiting out its retry back-off from our outage; it gets grace_after_hold from the
    hold's end to come back before it is recovered.
    """
    if hold_ended is None or last_seen >= hold_ended:
        return False
    return as_of < hold_ended + timedelta(seconds=rule.grace_after_hold)
