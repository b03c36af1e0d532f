"""PROVISIONING: create the machine in its provider and record it in BMDB."""

from __future__ import annotations

import logging
import uuid

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.deps import ActivityDeps, provider_errors
from lifecycle.contracts import ProvisionInput, ProvisionResult

log = logging.getLogger(__name__)


class ProvisioningActivities:
    """Side effects of PROVISIONING: create the machine at its provider and record it in BMDB."""

    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn
    async def provision_machine(self, input: ProvisionInput) -> ProvisionResult:
        """Create the machine from its capacity slot; safe to run again.

        The idempotency key is the machine's workflow id, so a retry after a
        lost reply gets the machine the first call created.
        """
        provider = self.deps.provider(input.provider)
        async with provider_errors():
            machine = await provider.create_machine(input.provider_id, input.idempotency_key, self.deps.ssh_public_key)
        if machine.address is None:
            # Real providers take minutes to hand out an address; the step's
            # back-off asks again.
            raise ApplicationError(
                f"{input.provider} machine {input.provider_id} has no address yet (status {machine.status})",
                type="MachineNotReady",
                non_retryable=True,
            )
        try:
            first_time = await self.deps.bmdb.record_provided(
                uuid.UUID(input.machine_id),
                address=machine.address,
                ssh_port=machine.ssh_port,
                location=machine.location,
            )
        except KeyError as error:
            raise ApplicationError(str(error), type="MachineNotInBMDB", non_retryable=True) from error
        if first_time:
            log.info(
                "provided %s machine %s at %s:%d", input.provider, input.provider_id, machine.address, machine.ssh_port
            )
        return ProvisionResult(address=machine.address, ssh_port=machine.ssh_port, location=machine.location)
