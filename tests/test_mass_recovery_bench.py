"""bench.mass_recovery: the storm's damage counted from the provider's reboot counts and BMDB's events."""

from __future__ import annotations

from bench.mass_recovery import storm_damage

SLOTS = ["node-0001", "node-0002", "node-0003", "node-0004"]


def test_one_reboot_each_is_no_damage():
    events = [(slot, "rebooted") for slot in SLOTS]
    damage = storm_damage(SLOTS, dict.fromkeys(SLOTS, 1), events)
    assert damage.rebooted == 4
    assert damage.rebooted_twice == damage.reimaged == damage.quarantined == damage.never_rebooted == []


def test_a_second_reboot_shows_from_either_side():
    reboots = {"node-0001": 2, "node-0002": 1, "node-0003": 1}
    events = [
        ("node-0001", "rebooted"),
        ("node-0002", "rebooted"),
        ("node-0002", "rebooted"),
        ("node-0003", "rebooted"),
    ]
    damage = storm_damage(SLOTS, reboots, events)
    # node-0001's second reboot reached the provider unrecorded; node-0002's was recorded twice.
    assert damage.rebooted_twice == ["node-0001", "node-0002"]
    assert damage.rebooted == 3
    assert damage.never_rebooted == ["node-0004"]


def test_reimages_and_quarantines_are_named_once_each():
    events = [("node-0003", "reimaged"), ("node-0003", "reimaged"), ("node-0004", "quarantined")]
    damage = storm_damage(SLOTS, dict.fromkeys(SLOTS, 1), events)
    assert damage.reimaged == ["node-0003"]
    assert damage.quarantined == ["node-0004"]
    assert damage.rebooted_twice == []
