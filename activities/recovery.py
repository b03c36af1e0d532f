"""RECOVERING: reboot the machine through its provider and forget its agent."""

from __future__ import annotations

import logging
import uuid

from temporalio import activity

from activities.deps import ActivityDeps, provider_errors
from lifecycle.contracts import RebootInput

log = logging.getLogger(__name__)


class RecoveryActivities:
    """Side effects of RECOVERING: reboot the machine through its provider and forget its agent in BMDB."""

    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn
    async def reboot_machine(self, input: RebootInput) -> None:
        """Power-cycle the machine, then delete its agent-started and heartbeat records.

        Run twice, it reboots twice: harmless for a machine being recovered,
        and the records are deleted either way.
        """
        cause = input.cause.partition(":")[0].replace(" ", "_")  # heartbeat_lost or forced
        try:
            async with provider_errors():
                await self.deps.provider(input.provider).reboot_machine(input.provider_id)
        except Exception:
            self.deps.metrics.reboots.add(1, {"cause": cause, "outcome": "error"})
            raise
        self.deps.metrics.reboots.add(1, {"cause": cause, "outcome": "ok"})
        await self.deps.bmdb.forget_agent(uuid.UUID(input.machine_id), f"rebooted: {input.cause}")
        log.info("rebooted %s machine %s: %s", input.provider, input.provider_id, input.cause)
