"""Another clock against this host's: how far apart they surely are, read between two readings of this host's."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from shepherd.commands.doctor_checks.verdicts import Verdict, fail, ok, warn

# Clocks kept by NTP agree within milliseconds; a second apart means time keeping is broken on one of them.
CLOCK_WARN_SECONDS = 1.0
# Far below what the heartbeat checks tolerate (heartbeat_max_skew, 5 minutes by default), yet clearly wrong.
CLOCK_FAIL_SECONDS = 30.0


@dataclass(frozen=True)
class ClockReading:
    """Another clock read between two readings of this host's (seconds since the epoch)."""

    before: float
    remote: datetime
    after: float

    @property
    def offset(self) -> float:
        """How far the other clock is ahead of this host's (negative: behind), from the middle of the bracket."""
        return self.remote.timestamp() - (self.before + self.after) / 2

    @property
    def uncertainty(self) -> float:
        """The other clock was read somewhere within the bracket: the offset is right to within half of it."""
        return (self.after - self.before) / 2


def clock_verdict(whose: str, reading: ClockReading, how: str) -> Verdict:
    """Ok, warn or fail by how far apart the clocks surely are: the offset less its uncertainty."""
    offset, uncertainty = reading.offset, reading.uncertainty
    facts = {"offset_seconds": round(offset, 6), "uncertainty_seconds": round(uncertainty, 6)}
    direction = "ahead of" if offset >= 0 else "behind"
    detail = f"{whose} clock is {abs(offset):.3f}s {direction} this host's (± {uncertainty:.3f}s; {how})"
    surely = abs(offset) - uncertainty
    advice = "keep both in step with NTP (chrony, systemd-timesyncd)"
    if surely > CLOCK_FAIL_SECONDS:
        fail(f"{detail}: more than {CLOCK_FAIL_SECONDS:g}s apart; {advice}", **facts)
    if surely > CLOCK_WARN_SECONDS:
        return warn(f"{detail}: more than {CLOCK_WARN_SECONDS:g}s apart; {advice}", **facts)
    if uncertainty > CLOCK_WARN_SECONDS:
        return warn(f"{detail}: the round trip was too slow to tell within {CLOCK_WARN_SECONDS:g}s", **facts)
    return ok(detail, **facts)
