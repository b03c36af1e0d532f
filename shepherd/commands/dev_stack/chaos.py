"""``shepherd dev --chaos``: agents killed through the simulator, for the fleet to recover."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import aiohttp

from lifecycle.contracts import (
    MachineStage,
    machine_workflow_id,
)
from shepherd.commands.dev_stack.stack_settings import DevOptions


class Chaos:
    """Kills the agent of a random WATCHING machine every interval, through the simulator's admin API.

    A machine struck once is left alone until its recovery has begun, so every
    kill leads to one recovery; kills go to the machines killed least so far.
    """

    def __init__(self, api_url: str, options: DevOptions, say: Callable[[str], None]) -> None:
        self.api_url = api_url
        self.interval = options.chaos_interval
        self.limit = options.chaos_kills
        self.say = say
        self.kills = 0
        self.awaiting_recovery: set[str] = set()
        self.kills_of: dict[str, int] = {}
        self.next_strike = time.monotonic() + self.interval
        self.random = random.Random()

    def done(self) -> bool:
        """Whether every kill asked for (--chaos-kills) was made."""
        return self.limit is not None and self.kills >= self.limit

    async def maybe_strike(self, stages: dict[str, str]) -> None:
        """Kill one WATCHING machine's agent when the interval has passed, the least killed first."""
        watching = {wid for wid, stage in stages.items() if stage == MachineStage.WATCHING}
        self.awaiting_recovery &= watching
        if self.done() or time.monotonic() < self.next_strike:
            return
        candidates = sorted(watching - self.awaiting_recovery)
        if not candidates:
            return
        # The least killed first: one machine killed over and over would spend its recovery budget and be
        # quarantined, as it would be in production.
        fewest = min(self.kills_of.get(c, 0) for c in candidates)
        workflow_id = self.random.choice([c for c in candidates if self.kills_of.get(c, 0) == fewest])
        provider_id = workflow_id.removeprefix(machine_workflow_id("sim", ""))
        self.next_strike = time.monotonic() + self.interval
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{self.api_url}/admin/machines/{provider_id}/kill-agent") as response,
            ):
                response.raise_for_status()
                killed = (await response.json())["killed"]
        except (aiohttp.ClientError, KeyError, ValueError) as error:
            self.say(f"chaos: could not kill the agent of {provider_id}: {error}")
            return
        if not killed:
            self.say(f"chaos: {provider_id} had no agent running")
            return
        self.kills += 1
        self.kills_of[workflow_id] = self.kills_of.get(workflow_id, 0) + 1
        self.awaiting_recovery.add(workflow_id)
        limit = f"/{self.limit}" if self.limit is not None else ""
        self.say(f"chaos: killed the agent of {provider_id} (kill {self.kills}{limit}); watch it recover")
