"""What a doctor check finds: ok, warn or fail with a detail and facts for --json, and one line of the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NoReturn


class Status(StrEnum):
    """How a check went."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"

    @property
    def shown(self) -> str:
        """The status as the report prints it."""
        # A failure stands out in a column of lower-case words.
        return "FAIL" if self is Status.FAIL else self.value


@dataclass(frozen=True)
class Check:
    """One line of doctor's report: which check, how it went, what it saw, and facts for --json."""

    name: str
    status: Status
    detail: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """The check as one line of the report."""
        return f"{self.status.shown:<7} {self.name}: {self.detail}"

    def document(self) -> dict[str, Any]:
        """The check as --json shows it."""
        return {"name": self.name, "status": self.status.value, "detail": self.detail, **self.facts}


class Failed(Exception):
    """Raised by a probe: the check failed, for the reason in the message; facts go to --json."""

    def __init__(self, detail: str, **facts: Any) -> None:
        super().__init__(detail)
        self.facts = facts


def fail(detail: str, **facts: Any) -> NoReturn:
    """End a probe: the check failed for this reason."""
    raise Failed(detail, **facts)


@dataclass(frozen=True)
class Verdict:
    """What a probe found when it did not fail: ok or warn, the detail and facts."""

    status: Status
    detail: str
    facts: Mapping[str, Any] = field(default_factory=dict)


def ok(detail: str, **facts: Any) -> Verdict:
    """A probe found all well."""
    return Verdict(Status.OK, detail, facts)


def warn(detail: str, **facts: Any) -> Verdict:
    """A probe found something to look at, which does not fail doctor."""
    return Verdict(Status.WARN, detail, facts)


def plural(number: int, thing: str) -> str:
    """'1 machine' or '3 machines': a count and its thing, as a line reads it."""
    return f"{number} {thing}" if number == 1 else f"{number} {thing}s"
