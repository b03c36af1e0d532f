"""What a machine says, made safe to keep: one printable line, cut to a length, and few of them.

A machine's words travel into payloads, the event log and the history, through every continue-as-new. So do an
activity's failures, whose words are often a machine's or a provider's: a workflow keeps them cut as well.
"""

from __future__ import annotations

from collections.abc import Sequence

from foundation.foreign_text import foreign_text

# Each text a machine sends is cut to a line this long, and at most this many warnings are kept.
MAX_TEXT = 300
MAX_WARNINGS = 10
# An activity's failure as a workflow keeps it (its status's last error, a stuck record).
MAX_FAILURE = 1000


def machine_text(text: str, limit: int = MAX_TEXT) -> str:
    """What a machine said, on one line of printable characters, at most limit long (the cut is said)."""
    return foreign_text(text, limit)


def failure_text(text: str) -> str:
    """An activity's failure as a workflow keeps it: one printable line of at most MAX_FAILURE characters.

    Deterministic, so a workflow may call it."""
    return foreign_text(text, MAX_FAILURE)


def machine_warnings(warnings: Sequence[str]) -> list[str]:
    """At most MAX_WARNINGS of a machine's warnings, each cut by machine_text; the rest counted in a last one."""
    kept = [machine_text(w) for w in warnings[:MAX_WARNINGS]]
    if len(warnings) > MAX_WARNINGS:
        kept.append(f"and {len(warnings) - MAX_WARNINGS} more warnings")
    return kept
