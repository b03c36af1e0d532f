"""The checks' shared run: each within the time limit, skipped when one it needs failed, with what they share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path

from temporalio.client import Client

from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.temporal_connection import TemporalConnection
from shepherd.commands.doctor_checks.verdicts import Check, Failed, Status, Verdict


class Checkup:
    """Runs checks, each within the time limit, and keeps their lines; the parts' checks share what it holds."""

    def __init__(
        self, settings: Settings, *, timeout: float, environ: Mapping[str, str], embedded: Path | None = None
    ) -> None:
        self.settings = settings
        self.timeout = timeout
        # Where the Temporal configuration is read from: the embedded stack ignores the operator's.
        self.environ = environ
        self.embedded = embedded
        self.checks: dict[str, Check] = {}
        self.client: Client | None = None
        self.connection: TemporalConnection | None = None
        self.bmdb: BMDB | None = None
        self.peer_certificate: bytes = b""
        self.stack = AsyncExitStack()

    async def check(self, name: str, probe: Callable[[], Awaitable[Verdict]], needs: Sequence[str] = ()) -> None:
        """Run one probe within the time limit and keep its line; skipped when a check it needs failed."""
        blocked = [need for need in needs if self.checks[need].status in (Status.FAIL, Status.SKIPPED)]
        if blocked:
            failed = list(dict.fromkeys(root for need in blocked for root in self._failed_roots(need)))
            why = f"needs {', '.join(blocked)}"
            why += ", which failed" if failed == blocked else f"; {', '.join(failed)} failed"
            self.checks[name] = Check(name, Status.SKIPPED, why, {"needs": blocked, "failed": failed})
            return
        try:
            verdict = await asyncio.wait_for(probe(), self.timeout)
        except Failed as failure:
            self.checks[name] = Check(name, Status.FAIL, str(failure), failure.facts)
        except TimeoutError:
            detail = f"no answer within {self.timeout:g}s (--timeout)"
            self.checks[name] = Check(name, Status.FAIL, detail, {"timeout_seconds": self.timeout})
        except Exception as error:  # a doctor reports what it did not foresee, as a failure, and goes on
            self.checks[name] = Check(name, Status.FAIL, f"{type(error).__name__}: {error}")
        else:
            self.checks[name] = Check(name, verdict.status, verdict.detail, verdict.facts)

    def _failed_roots(self, name: str) -> list[str]:
        """The failed checks that a check failed or was skipped for: itself, or those its needs were skipped for."""
        check = self.checks[name]
        if check.status is Status.FAIL:
            return [name]
        return [root for need in check.facts.get("needs", ()) for root in self._failed_roots(need)]
