"""DECOMMISSIONING: forget the machine's agent, retire the machine through its provider, mark it retired in BMDB.

Stopping the agent over SSH is TakeoverActivities.stop_agent. Each step is safe to repeat: a provider asked twice
reports the machine released or off already, and BMDB retires a machine once.
"""

from __future__ import annotations

import logging
import uuid

from temporalio import activity

from activities.deps import ActivityDeps, provider_errors
from lifecycle.contracts import DecommissionInput, RetireInput, RetireResult

log = logging.getLogger(__name__)


class DecommissionActivities:
    """Side effects of DECOMMISSIONING in BMDB and at the provider."""

    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn
    async def forget_decommissioned_agent(self, input: DecommissionInput) -> None:
        """Forget the agent in BMDB: the watchdog stops watching it, and its heartbeats are refused from now on."""
        await self.deps.bmdb.forget_silent_agent(
            uuid.UUID(input.machine_id),
            f"asked by {input.by}: {input.reason}; its agent is forgotten, and its heartbeats refused",
            kind="decommissioning",
        )

    @activity.defn
    async def retire_through_provider(self, input: DecommissionInput) -> RetireResult:
        """Release the machine to its provider, or power it off, as the provider can."""
        async with provider_errors():
            retired = await self.deps.provider(input.provider).retire_machine(input.provider_id)
        log.info(
            "retired %s machine %s through its provider (%s): %s",
            input.provider,
            input.provider_id,
            retired.action,
            retired.detail,
        )
        return RetireResult(action=retired.action.value, detail=retired.detail)

    @activity.defn
    async def record_retired(self, input: RetireInput) -> None:
        """Mark the machine retired in BMDB, with a ``decommissioned`` event; a repeat changes nothing."""
        if not await self.deps.bmdb.retire(uuid.UUID(input.machine_id), input.detail):
            log.info("machine %s was retired already", input.machine_id)
