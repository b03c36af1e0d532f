"""AGENT_STARTING: start the takeover agent over SSH and record its key; and stop it, for a decommission."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.deps import ActivityDeps, heartbeating, provider_errors
from bmdb.store import BMDB, HostKeyPinned, HostKeyUnexpected, MachineRecord
from foundation.ssh_sessions import host_key_fingerprint
from lifecycle.contracts import AgentFacts, DecommissionInput, StartAgentInput
from lifecycle.takeover import HostKeyPin, PinRefused, TakeoverSettings, key_fingerprint, stop_agent, take_over
from lifecycle.takeover_failures import TakeoverError, TakeoverFailure, unexpected_host_key
from providers import MachineNotFound

log = logging.getLogger(__name__)

# A takeover whose SSH session did not come up in time is tried again within its step, a second or two later, as
# a blip: when a rack comes back, the worker and the machines are busy with the other takeovers, and the next try
# usually gets through where the step's back-off (the seed's 5 minutes) would hold the machine up.
RETRIED_WITHIN_THE_STEP = frozenset({TakeoverFailure.CONNECT_TIMEOUT})


# How often a takeover heartbeats; well within its heartbeat timeout (the workflow's TAKEOVER_HEARTBEAT_TIMEOUT).
TAKEOVER_HEARTBEAT_SECONDS = 3.0


def takeover_failed(error: TakeoverError) -> ApplicationError:
    """The activity's error for a failed takeover: tried again at once (the activity's blip retries) when the
    failure is a connect timeout; else left to the workflow's back-off, as the seed's takeover is."""
    return ApplicationError(
        str(error), type=error.failure.name, non_retryable=error.failure not in RETRIED_WITHIN_THE_STEP
    )


def _facts(started_at: datetime, public_key: bytes, warnings: list[str]) -> AgentFacts:
    return AgentFacts(started_at=started_at.isoformat(), key_fingerprint=key_fingerprint(public_key), warnings=warnings)


def bmdb_pin(bmdb: BMDB, machine_id: uuid.UUID) -> HostKeyPin:
    """The takeover's pin of a first contact's host key in BMDB, which refuses it when another key was pinned first
    or an operator expects another fingerprint."""

    async def pin(host_key: str) -> PinRefused | None:
        try:
            await bmdb.pin_host_key(machine_id, host_key)
        except HostKeyPinned as pinned:
            return PinRefused(other_key=pinned.pinned)
        except HostKeyUnexpected as unexpected:
            return PinRefused(expected_fingerprint=unexpected.expected)
        return None

    return pin


class TakeoverActivities:
    """Side effects of AGENT_STARTING: start the agent over SSH, then record its key and the host key in BMDB."""

    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    def _takeover_settings(self) -> TakeoverSettings:
        # Looked up at each takeover: an agent executable or a CA bundle replaced meanwhile is the one handed out.
        return TakeoverSettings.of(self.deps.settings, *self.deps.takeover_files())

    @activity.defn
    async def start_agent(self, input: StartAgentInput) -> AgentFacts:
        """Upload and run the agent; record its key. Safe to run again."""
        async with heartbeating(TAKEOVER_HEARTBEAT_SECONDS):
            return await self._start_agent(input)

    async def _start_agent(self, input: StartAgentInput) -> AgentFacts:
        machine_id = uuid.UUID(input.machine_id)
        record = await self._record(machine_id)
        if record.agent_started_at is not None and record.agent_public_key is not None:
            # An earlier attempt started the agent and its reply was lost; unless it is the running agent this
            # takeover replaces, which keeps heartbeating, and stays on record, until the new one's key replaces it.
            if input.replaces is None or key_fingerprint(record.agent_public_key) != input.replaces:
                return _facts(record.agent_started_at, record.agent_public_key, [])

        async with provider_errors():
            machine = await self.deps.provider(input.provider).get_machine(input.provider_id)
        if machine.address is None:
            raise ApplicationError(
                f"{input.provider} machine {input.provider_id} has no address",
                type="MachineNotReady",
                non_retryable=True,
            )
        target = self.deps.target(input.machine_id, machine, record.ssh_host_key)

        pin = bmdb_pin(self.deps.bmdb, machine_id)
        try:
            result = await take_over(target, self._takeover_settings(), self.deps.ssh_key, pin)
        except TakeoverError as error:
            self.deps.metrics.takeovers.add(1, {"outcome": error.failure.name.lower()})
            await self.deps.bmdb.add_event(machine_id, "agent_start_failed", str(error))
            raise takeover_failed(error) from error

        started_at = datetime.now(UTC)
        facts = _facts(started_at, result.agent_public_key, list(result.warnings))
        # Which agent build runs where: the event log answers it for every takeover.
        detail = f"agent key {facts.key_fingerprint}; agent sha256 {result.agent_sha256} on {result.machine}"
        if facts.warnings:
            detail += "; warnings: " + "; ".join(facts.warnings)
        # The key was pinned at the handshake; a pinned one was checked in it. The record checks again, in its
        # transaction, so no takeover is recorded beside another host key.
        try:
            await self.deps.bmdb.record_takeover(
                machine_id, started_at, result.agent_public_key, result.host_key, detail
            )
        except HostKeyPinned as pinned:
            problem = (
                f"host key {host_key_fingerprint(pinned.pinned)} was pinned by another takeover, this server "
                f"showed {host_key_fingerprint(result.host_key)}; its agent is not recorded"
            )
            await self.deps.bmdb.add_event(machine_id, "agent_start_failed", problem)
            raise ApplicationError(problem, type=TakeoverFailure.HOST_KEY_CHANGED.name, non_retryable=True) from None
        except HostKeyUnexpected as unexpected:
            # An operator reset the pin, naming a fingerprint, after this takeover's handshake pinned its key.
            refused = unexpected_host_key(target, unexpected.expected, unexpected.seen)
            await self.deps.bmdb.add_event(machine_id, "agent_start_failed", f"{refused}; its agent is not recorded")
            raise ApplicationError(str(refused), type=refused.failure.name, non_retryable=True) from None
        self.deps.metrics.takeovers.add(1, {"outcome": "ok"})
        log.info("agent started on %s machine %s (%s)", input.provider, input.provider_id, detail)
        return facts

    @activity.defn
    async def stop_agent(self, input: DecommissionInput) -> str:
        """Stop the agent over SSH where the machine answers; what happened, in a line. Never fails on the machine:
        an agent out of reach stops once its heartbeats are refused, or when the machine powers off."""
        record = await self._record(uuid.UUID(input.machine_id))
        try:
            async with provider_errors():
                machine = await self.deps.provider(input.provider).get_machine(input.provider_id)
        except MachineNotFound:
            return f"{input.provider} has no machine {input.provider_id}: no agent to stop"
        if machine.address is None:
            return f"{input.provider} lists no address for {input.provider_id}: no agent was started"
        target = self.deps.target(input.machine_id, machine, record.ssh_host_key)
        try:
            answer = await stop_agent(target, self._takeover_settings(), self.deps.ssh_key)
        except TakeoverError as error:
            log.warning("cannot stop the agent on %s machine %s: %s", input.provider, input.provider_id, error)
            return f"not stopped over SSH ({error.problem}); its heartbeats are refused from now on"
        log.info("stopped the agent on %s machine %s: %s", input.provider, input.provider_id, answer)
        return f"stopped over SSH: {answer}"

    async def _record(self, machine_id: uuid.UUID) -> MachineRecord:
        record = await self.deps.bmdb.get_machine(machine_id)
        if record is None:
            raise ApplicationError(f"BMDB has no machine {machine_id}", type="MachineNotInBMDB", non_retryable=True)
        return record
