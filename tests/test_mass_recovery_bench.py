"""bench.mass_recovery: the storm's damage counted from the provider's reboot counts and BMDB's events; the floor run
for a few machines."""

from __future__ import annotations

from bench.mass_recovery import Options, measure_floor, storm_damage

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


async def test_the_floor_takes_each_machine_over_with_shepherds_agent_and_hears_it(tmp_path):
    options = Options(
        machines=3, rate=10.0, activities_per_second=10.0, heartbeat_timeout=60.0, reconcile_interval=5.0, limit=60.0
    )
    floor = await measure_floor(tmp_path / "floor", options, concurrency=3, limit=60.0)
    assert floor.failures == 0
    assert floor.damage.rebooted == 3 and floor.damage.rebooted_twice == []
    # Each new agent answered its takeover, then started its daemon, which was heard from.
    assert 0 < floor.answered_seconds <= floor.seconds
    # Each machine heard from was powered off: its agent's bootloader and the interpreter under it stopped.
    assert floor.agent_processes_stopped == 6
