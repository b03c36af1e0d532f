"""The fleet reconcile decision, as a pure function of two listings.

This is the Provisioner of Monogon's shepherd: bring free provider capacity
under management, subject to a machine limit and a per-pass chunk, but only
when the provider and BMDB agree on which machines are ours. Any disagreement
means something outside Shepherd changed the fleet, and creating more machines
on top of that would make it worse.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from providers import Availability, ProviderMachine


class RecordedMachine(Protocol):
    """A machine as BMDB records it, as far as the rule reads it (bmdb.store.ProvidedMachine is one)."""

    @property
    def machine_id(self) -> uuid.UUID:
        """The machine's BMDB id."""

    @property
    def provider_id(self) -> str:
        """The machine's id at its provider."""

    @property
    def being_created(self) -> bool:
        """Admitted, and not yet created by its provider."""

    @property
    def missing(self) -> bool:
        """Marked when the provider stopped listing it."""

    @property
    def retired(self) -> bool:
        """Decommissioned: never adopted, started or watched again."""


@dataclass(frozen=True)
class Disagreement:
    """One machine the provider and BMDB disagree on, and how; any one refuses the pass's creations."""

    provider_id: str
    machine_id: uuid.UUID | None
    problem: str

    def __str__(self) -> str:
        machine = f" (BMDB machine {self.machine_id})" if self.machine_id else ""
        return f"{self.provider_id}{machine}: {self.problem}"


@dataclass(frozen=True)
class ReconcilePlan:
    """What plan_reconcile decides: the counts, the capacity to bring under management, the disagreements, why."""

    provider_count: int
    bmdb_count: int
    # Machines in BMDB, consistent with the provider, counted against the limit.
    managed_count: int
    # Free capacity to bring under management in this pass, in provider-id order.
    to_create: list[ProviderMachine] = field(default_factory=list)
    disagreements: list[Disagreement] = field(default_factory=list)
    # BMDB rows whose provider id this provider could never have issued.
    invalid_ids: list[str] = field(default_factory=list)
    # Machines the provider listed under an id of a form it never issues: never brought under management.
    invalid_listed: list[str] = field(default_factory=list)
    # BMDB machines the provider stopped listing in this pass, and marked ones it lists again.
    newly_missing: list[str] = field(default_factory=list)
    back_again: list[str] = field(default_factory=list)
    # Why nothing (more) is created, for logs and the fleet status.
    note: str = ""

    @property
    def refused(self) -> bool:
        """Whether the pass creates nothing because the provider and BMDB disagree."""
        return bool(self.disagreements)


def resolve_availability(
    machine: ProviderMachine, in_bmdb: Callable[[str], bool], is_valid_id: Callable[[str], bool]
) -> Availability:
    """Turn PossiblyUsed into KnownUsed or KnownUnused: BMDB knows what is ours."""
    if machine.availability is not Availability.POSSIBLY_USED:
        return machine.availability
    if not is_valid_id(machine.provider_id):
        return Availability.KNOWN_UNUSED
    return Availability.KNOWN_USED if in_bmdb(machine.provider_id) else Availability.KNOWN_UNUSED


def plan_reconcile(
    provider_machines: Sequence[ProviderMachine],
    bmdb_machines: Sequence[RecordedMachine],
    *,
    max_machines: int,
    chunk_size: int,
    is_valid_id: Callable[[str], bool],
) -> ReconcilePlan:
    """Decide one reconcile pass. max_machines 0 means no limit."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if max_machines < 0:
        raise ValueError(f"max_machines must not be negative, got {max_machines}")

    # A decommissioned machine is history: whatever the provider says of its id, no pass adopts it again.
    retired = {m.provider_id for m in bmdb_machines if m.retired}
    bmdb_machines = [m for m in bmdb_machines if not m.retired]
    invalid_ids = sorted(m.provider_id for m in bmdb_machines if not is_valid_id(m.provider_id))
    bmdb = {m.provider_id: m for m in bmdb_machines if is_valid_id(m.provider_id)}

    used: set[str] = set()
    unused: dict[str, ProviderMachine] = {}
    invalid_listed: list[str] = []
    for machine in provider_machines:
        if machine.provider_id in retired:
            continue
        if not is_valid_id(machine.provider_id):
            # An id of a form the provider never issues goes into no BMDB row, URL or workflow id.
            invalid_listed.append(machine.provider_id)
            continue
        availability = resolve_availability(machine, bmdb.__contains__, is_valid_id)
        if availability is Availability.KNOWN_USED:
            used.add(machine.provider_id)
        else:
            unused[machine.provider_id] = machine

    disagreements = [
        Disagreement(
            provider_id, None, "the provider says it is ours, BMDB has no record of it: find who took it there"
        )
        for provider_id in sorted(used - bmdb.keys())
    ]
    newly_missing: list[str] = []
    for provider_id, record in sorted(bmdb.items()):
        if provider_id in used:
            continue
        # A machine admitted but not yet created is free capacity to the
        # provider until its workflow creates it: that is no disagreement.
        if record.being_created and provider_id in unused:
            continue
        if provider_id in unused:
            problem = "BMDB has it as provided, the provider lists it as free capacity: find who released it there"
        else:
            problem = (
                "BMDB has it, the provider does not know it: list it there again (a static inventory: put it back "
                "in the file); until then Shepherd leaves it alone and creates nothing"
            )
            if not record.missing:
                newly_missing.append(provider_id)
        disagreements.append(Disagreement(provider_id, record.machine_id, problem))
    listed = used | unused.keys()
    back_again = sorted(provider_id for provider_id, record in bmdb.items() if record.missing and provider_id in listed)

    base = ReconcilePlan(
        provider_count=len(provider_machines),
        bmdb_count=len(bmdb_machines),
        managed_count=len(bmdb),
        invalid_ids=invalid_ids,
        invalid_listed=sorted(invalid_listed),
        newly_missing=newly_missing,
        back_again=back_again,
    )
    if disagreements:
        return replace(
            base,
            disagreements=disagreements,
            note=f"refused: provider and BMDB disagree on {len(disagreements)} machine(s)",
        )
    if max_machines and len(bmdb) >= max_machines:
        return replace(base, note=f"at the limit of {max_machines} machines")
    available = [m for provider_id, m in sorted(unused.items()) if provider_id not in bmdb]
    if not available:
        return replace(base, note="no free capacity")
    wanted = min(len(available), chunk_size)
    if max_machines:
        wanted = min(wanted, max_machines - len(bmdb))
    return replace(base, to_create=available[:wanted], note=f"creating {wanted} of {len(available)} free")
