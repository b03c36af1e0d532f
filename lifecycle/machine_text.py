"""What a machine says, made safe to keep: one printable line, cut to a length, and few of them.

A machine's words travel into payloads, the event log and the history, through every continue-as-new.
"""

from __future__ import annotations

from collections.abc import Sequence

# Each text a machine sends is cut to a line this long, and at most this many warnings are kept.
MAX_TEXT = 300
MAX_WARNINGS = 10


def machine_text(text: str, limit: int = MAX_TEXT) -> str:
    """What a machine said, on one line of printable characters, at most limit long (the cut is said)."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 4]).split())
    if len(line) <= limit and len(text) <= limit * 4:
        return line
    cut = f"... ({len(text)} chars)"
    return line[: limit - len(cut)] + cut


def machine_warnings(warnings: Sequence[str]) -> list[str]:
    """At most MAX_WARNINGS of a machine's warnings, each cut by machine_text; the rest counted in a last one."""
    kept = [machine_text(w) for w in warnings[:MAX_WARNINGS]]
    if len(warnings) > MAX_WARNINGS:
        kept.append(f"and {len(warnings) - MAX_WARNINGS} more warnings")
    return kept
