"""plan_reconcile: the seed Provisioner's decisions, as table tests."""

from __future__ import annotations

import re
import uuid

import pytest

from bmdb.schema import PROVIDED_STATUS_CREATING, PROVIDED_STATUS_PROVIDED
from bmdb.store import ProvidedMachine
from lifecycle.reconcile import plan_reconcile, resolve_availability
from providers import Availability, ProviderMachine

USED, UNUSED, POSSIBLY = Availability.KNOWN_USED, Availability.KNOWN_UNUSED, Availability.POSSIBLY_USED


def valid(provider_id: str) -> bool:
    return re.fullmatch(r"node-\d{4}", provider_id) is not None


def in_provider(provider_id: str, availability: Availability = UNUSED) -> ProviderMachine:
    return ProviderMachine(provider_id=provider_id, availability=availability)


def in_bmdb(provider_id: str, status: str = PROVIDED_STATUS_PROVIDED, *, retired: bool = False) -> ProvidedMachine:
    return ProvidedMachine(uuid.uuid4(), "sim", provider_id, status, retired=retired)


def node(n: int) -> str:
    return f"node-{n:04d}"


PROVIDED = {"node-0001"}


@pytest.mark.parametrize(
    ("provider_id", "availability", "wanted"),
    [
        pytest.param("node-0002", USED, USED, id="skip KnownUsed"),
        pytest.param("node-0002", UNUSED, UNUSED, id="skip KnownUnused"),
        pytest.param("", POSSIBLY, UNUSED, id="invalid ID"),
        pytest.param("node-0002", POSSIBLY, UNUSED, id="valid ID, not in BMDB"),
        pytest.param("node-0001", POSSIBLY, USED, id="valid ID, in BMDB"),
    ],
)
def test_resolve_possibly_used(provider_id, availability, wanted):
    machine = in_provider(provider_id, availability)
    assert resolve_availability(machine, PROVIDED.__contains__, valid) is wanted


def test_brings_free_capacity_up_to_the_chunk_size_in_id_order():
    provider = [in_provider(node(n)) for n in (5, 3, 1, 4, 2)]
    plan = plan_reconcile(provider, [], max_machines=0, chunk_size=3, is_valid_id=valid)
    assert [m.provider_id for m in plan.to_create] == [node(1), node(2), node(3)]
    assert not plan.refused


def test_max_count_limits_what_one_pass_creates():
    provider = [in_provider(node(1), USED), in_provider(node(2), USED)] + [in_provider(node(n)) for n in range(3, 20)]
    bmdb = [in_bmdb(node(1)), in_bmdb(node(2))]
    plan = plan_reconcile(provider, bmdb, max_machines=5, chunk_size=20, is_valid_id=valid)
    assert [m.provider_id for m in plan.to_create] == [node(3), node(4), node(5)]
    assert plan.managed_count == 2


def test_nothing_created_at_the_limit():
    provider = [in_provider(node(1), USED), in_provider(node(2))]
    plan = plan_reconcile(provider, [in_bmdb(node(1))], max_machines=1, chunk_size=20, is_valid_id=valid)
    assert plan.to_create == []
    assert "limit" in plan.note


def test_nothing_created_without_capacity():
    plan = plan_reconcile(
        [in_provider(node(1), USED)], [in_bmdb(node(1))], max_machines=0, chunk_size=20, is_valid_id=valid
    )
    assert plan.to_create == [] and plan.note == "no free capacity"


def test_provider_machine_missing_in_bmdb_refuses_the_pass_and_names_it():
    provider = [in_provider(node(1), USED), in_provider(node(2))]
    plan = plan_reconcile(provider, [], max_machines=0, chunk_size=20, is_valid_id=valid)
    assert plan.refused and plan.to_create == []
    assert [d.provider_id for d in plan.disagreements] == [node(1)]
    assert "BMDB has no record" in str(plan.disagreements[0])


def test_bmdb_machine_missing_in_provider_refuses_the_pass_and_names_it():
    record = in_bmdb(node(7))
    plan = plan_reconcile([in_provider(node(2))], [record], max_machines=0, chunk_size=20, is_valid_id=valid)
    assert plan.refused and plan.to_create == []
    assert plan.disagreements[0].machine_id == record.machine_id
    assert node(7) in str(plan.disagreements[0]) and str(record.machine_id) in str(plan.disagreements[0])


def test_provided_machine_listed_as_free_capacity_is_a_disagreement():
    plan = plan_reconcile([in_provider(node(1))], [in_bmdb(node(1))], max_machines=0, chunk_size=20, is_valid_id=valid)
    assert plan.refused
    assert "free capacity" in plan.disagreements[0].problem


def test_admitted_machine_not_yet_created_counts_as_managed_not_as_capacity():
    provider = [in_provider(node(1)), in_provider(node(2))]
    plan = plan_reconcile(
        provider, [in_bmdb(node(1), PROVIDED_STATUS_CREATING)], max_machines=0, chunk_size=20, is_valid_id=valid
    )
    assert not plan.refused
    assert [m.provider_id for m in plan.to_create] == [node(2)]
    assert plan.managed_count == 1


def test_possibly_used_machine_known_to_bmdb_is_managed():
    provider = [in_provider(node(1), POSSIBLY), in_provider(node(2), POSSIBLY)]
    plan = plan_reconcile(provider, [in_bmdb(node(1))], max_machines=0, chunk_size=20, is_valid_id=valid)
    assert not plan.refused
    assert [m.provider_id for m in plan.to_create] == [node(2)]


def test_bmdb_rows_with_invalid_ids_are_reported_and_ignored():
    plan = plan_reconcile(
        [in_provider(node(1))], [in_bmdb("garbage")], max_machines=0, chunk_size=20, is_valid_id=valid
    )
    assert plan.invalid_ids == ["garbage"]
    assert not plan.refused
    assert [m.provider_id for m in plan.to_create] == [node(1)]


@pytest.mark.parametrize(("max_machines", "chunk_size"), [(-1, 1), (0, 0)])
def test_bad_limits_are_refused(max_machines, chunk_size):
    with pytest.raises(ValueError, match=r"max_machines|chunk_size"):
        plan_reconcile([], [], max_machines=max_machines, chunk_size=chunk_size, is_valid_id=valid)


def test_a_machine_the_provider_stops_listing_is_newly_missing_once_and_back_when_listed_again():
    missing_now = ProvidedMachine(uuid.uuid4(), "sim", node(1), PROVIDED_STATUS_PROVIDED)
    marked_before = ProvidedMachine(uuid.uuid4(), "sim", node(2), PROVIDED_STATUS_PROVIDED, missing=True)
    still_marked = ProvidedMachine(uuid.uuid4(), "sim", node(3), PROVIDED_STATUS_PROVIDED, missing=True)
    plan = plan_reconcile(
        [in_provider(node(2), POSSIBLY)],
        [missing_now, marked_before, still_marked],
        max_machines=0,
        chunk_size=20,
        is_valid_id=valid,
    )
    assert plan.newly_missing == [node(1)] and plan.back_again == [node(2)]
    # The pass is refused while BMDB has machines the provider does not know, and says what to do.
    assert plan.refused and [d.provider_id for d in plan.disagreements] == [node(1), node(3)]
    assert "list it there again" in plan.disagreements[0].problem


@pytest.mark.parametrize(
    "listed",
    [
        pytest.param(UNUSED, id="released: free capacity again"),
        pytest.param(POSSIBLY, id="powered off: still listed"),
        pytest.param(USED, id="listed as ours"),
        pytest.param(None, id="gone from the provider"),
    ],
)
def test_a_decommissioned_machine_is_never_adopted_again_whatever_its_provider_says(listed):
    provider = [in_provider(node(2)), in_provider(node(3), USED)]
    if listed:
        provider.append(in_provider(node(1), listed))
    bmdb = [in_bmdb(node(1), retired=True), in_bmdb(node(3))]
    plan = plan_reconcile(provider, bmdb, max_machines=2, chunk_size=20, is_valid_id=valid)
    assert not plan.refused and plan.newly_missing == []
    # It no longer counts against the limit either: node-0002 may take its place.
    assert [m.provider_id for m in plan.to_create] == [node(2)]
    assert plan.managed_count == 1


def test_listed_ids_of_a_form_the_provider_never_issues_are_left_alone_not_refused():
    hostile = ["../admin/faults?", "node-0002/reboot", "", "node-1"]
    provider = [in_provider(h) for h in hostile] + [in_provider(node(3)), in_provider("../x", USED)]
    plan = plan_reconcile(provider, [], max_machines=0, chunk_size=20, is_valid_id=valid)
    assert not plan.refused
    assert [m.provider_id for m in plan.to_create] == [node(3)]
    assert plan.invalid_listed == sorted([*hostile, "../x"])
