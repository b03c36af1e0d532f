"""The provider interface: where machines come from and how they are rebooted.

A provider is the API of a bare-metal cloud, a set of BMCs, or the simulator.
Shepherd asks it for its machines and free capacity, creates machines from
capacity, reboots machines whose agent went silent, and retires decommissioned ones.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from foundation.foreign_text import foreign_text

# The longest a provider error's message is: it quotes what a provider's API or a BMC answered, whatever its size.
MESSAGE_LIMIT = 1000


def _cut_detail(result: Rebooted | Reimaged | Retired) -> None:
    """A result's detail, the provider's own words that travel into payloads and the event log, cut and escaped."""
    object.__setattr__(result, "detail", foreign_text(result.detail, MESSAGE_LIMIT))


class Availability(enum.StrEnum):
    """Whether a provider machine is ours.

    ``POSSIBLY_USED`` is for providers that cannot tell on their own; BMDB
    decides: a machine BMDB knows is ours, any other is free capacity.
    """

    KNOWN_USED = "KnownUsed"
    KNOWN_UNUSED = "KnownUnused"
    POSSIBLY_USED = "PossiblyUsed"


@dataclass(frozen=True)
class ProviderMachine:
    """One machine, or one slot of free capacity, as the provider sees it."""

    provider_id: str
    availability: Availability
    # Where SSH reaches the machine; None while it is only capacity.
    address: str | None = None
    ssh_port: int = 22
    location: str | None = None
    # The provider's own word on the machine ("active", "provisioning", ...).
    status: str | None = None
    # Who Shepherd logs in as over SSH; None: the ssh_user setting.
    ssh_user: str | None = None


@dataclass(frozen=True)
class Rebooted:
    """What a provider knows of a reboot it has done, for the wait until the machine is back."""

    # The provider saw the machine go down (its power read back off, or its API says it is booting), so SSH that
    # answers afterwards is the new boot. False: Shepherd first waits for SSH to go away, then to answer again.
    went_down: bool
    detail: str = ""

    def __post_init__(self) -> None:
        _cut_detail(self)


@dataclass(frozen=True)
class Reimaged:
    """What a provider did to reimage a machine: a fresh OS on its disk, with Shepherd's key, on its way up."""

    # The provider's own words: what it did, and what it is doing still (Ironic's rebuild runs on after the call).
    detail: str = ""

    def __post_init__(self) -> None:
        _cut_detail(self)


class RetireAction(enum.StrEnum):
    """What a provider did with a decommissioned machine."""

    # The provider took the machine back (a cloud's release, the simulator's freed slot).
    RELEASED = "released"
    # The machine stays where it is, powered off through its BMC.
    POWERED_OFF = "powered_off"
    # The provider could do nothing (no BMC, or it holds no such machine); the detail says what is left to do.
    UNTOUCHED = "untouched"


@dataclass(frozen=True)
class Retired:
    """What a provider did to retire a machine for good, in its own words."""

    action: RetireAction
    detail: str = ""

    def __post_init__(self) -> None:
        _cut_detail(self)


class ProviderError(Exception):
    """A provider call failed. ``retryable`` says whether trying again may help."""

    retryable = True

    def __init__(self, provider: str, message: str) -> None:
        # Every provider's errors pass here, with the answer they quote: cut and escaped once, for all of them.
        super().__init__(foreign_text(f"provider {provider}: {message}", MESSAGE_LIMIT))
        self.provider = provider


class ProviderUnavailable(ProviderError):
    """The provider did not answer, timed out or answered with a server error."""


class ProviderProtocolError(ProviderError):
    """The provider answered with something that is not what its API promises."""

    retryable = False


class MachineNotFound(ProviderError):
    """The provider has no machine with that id."""

    retryable = False

    def __init__(self, provider: str, provider_id: str) -> None:
        super().__init__(provider, f"no machine {provider_id!r}")
        self.provider_id = provider_id


class NotDoneYet(ProviderError):
    """The provider is still at what it was asked (a deploy, a disk cleaning): the step's back-off asks again later.

    Not retried at once: the activity ends, and the workflow's back-off, not a tight retry, paces the asking.
    """

    retryable = False


class MaintenanceHold(ProviderError):
    """The provider holds the machine in its own maintenance: nothing Shepherd retries soon can change that."""

    retryable = False


class CapacityConflict(ProviderError):
    """The capacity slot was taken by a different creation request."""

    retryable = False


class Provider(Protocol):
    """What Shepherd needs of a source of machines.

    Implementations are used from activities only: they do I/O.
    """

    @property
    def name(self) -> str:
        """The instance's name, part of workflow ids and BMDB keys (``sim``, ``rack1``)."""
        ...

    def is_valid_id(self, provider_id: str) -> bool:
        """Whether provider_id has the form this provider's ids have."""
        ...

    async def list_machines(self) -> list[ProviderMachine]:
        """Every machine of ours and every slot of free capacity."""
        ...

    async def get_machine(self, provider_id: str) -> ProviderMachine:
        """One machine; raises MachineNotFound if the provider has none with that id."""
        ...

    async def create_machine(self, provider_id: str, idempotency_key: str, ssh_public_key: str) -> ProviderMachine:
        """Create a machine from the free capacity slot provider_id.

        Repeating the call with the same idempotency_key returns the machine the
        first call created instead of creating another. ssh_public_key (OpenSSH
        format) is installed for the SSH user.
        """
        ...

    async def reboot_machine(self, provider_id: str) -> Rebooted:
        """Power-cycle the machine; return once the provider has done it, saying whether it saw the machine down."""
        ...

    async def retire_machine(self, provider_id: str) -> Retired:
        """Release the machine to the provider, or power it off, for good; the provider says which it did.

        Repeating the call is harmless: a machine released or off already is reported as such.
        """
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class Reimager(Protocol):
    """A provider that can reimage a machine, an optional capability: the recovery past the budget reimages a
    machine once before it quarantines it, and an operator may ask for one."""

    async def reimage_machine(self, provider_id: str, ssh_public_key: str) -> Reimaged:
        """Put a fresh OS on the machine, ssh_public_key (OpenSSH format) installed for the SSH user, and start it.

        Returns once the provider has taken the job on; the machine answers SSH, with a new host key, when its
        new OS is up. Repeating the call while that reimage is under way starts no second one.
        """
        ...


@runtime_checkable
class KnowsResets(Protocol):
    """A provider that keeps when a machine was last reset (rebooted, power-cycled), as a BMC's LastResetTime does,
    an optional capability: a recovery whose reboot was asked and never answered (its worker died) reads it before
    it asks again, so a reboot done is not done twice."""

    async def last_reset(self, provider_id: str) -> datetime | None:
        """When the machine was last reset, timezone-aware; None when it has not been since the provider has it."""
        ...


@runtime_checkable
class CountsLeftAlone(Protocol):
    """A provider whose listing passes over machines that are neither Shepherd's nor free capacity, an optional
    capability: it says how many it left alone, and why, so an operator sees them (`shepherd fleet`)."""

    @property
    def left_alone(self) -> Mapping[str, int]:
        """Machines its last listing left alone, by reason."""
        ...
