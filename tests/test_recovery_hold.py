"""The watchdog's circuit breaker: many machines silent at once, or no heartbeat at all, holds every recovery."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from bmdb.store import BMDB
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from lifecycle.contracts import MachineStage, RecoveryHoldRule, fleet_schedule_id
from lifecycle.inputs import recovery_hold_rule
from lifecycle.watchdog import hold_reason, hold_threshold, spared_after_hold
from operations.client import OperatorClient
from operations.documents import release_lines
from operations.fleet_control import HoldRelease
from processes.worker import ensure_fleet_schedules
from proto import AGENT_MAX_RETRY_INTERVAL
from shepherd.commands.fleet import FleetAction, FleetPass, format_passes, held_lines, print_fleet
from tests.fleet_stack import fleet_stack
from tests.test_fleet import sim_admin
from tests.test_recovery import wait_for
from workflows.fleet import FleetWorkflow

RULE = RecoveryHoldRule(min_machines=5, fraction=0.1, quiet_path_after=90.0, grace_after_hold=600.0)
WATCH: dict[str, Any] = {"first_heartbeat_timeout": 20.0, "heartbeat_timeout": 2.0}


def test_threshold_is_the_larger_of_the_count_and_the_fraction():
    assert hold_threshold(RULE, 0) == 5
    assert hold_threshold(RULE, 50) == 5
    assert hold_threshold(RULE, 51) == 6
    assert hold_threshold(RULE, 100_000) == 10_000


@pytest.mark.parametrize(
    ("silent", "watched", "age", "held"),
    [
        (0, 20, None, None),  # nothing silent: nothing to hold, whatever the heartbeat path
        (5, 20, 1.0, None),  # at the threshold: recover
        (6, 20, 1.0, "6 of 20 watched machines silent at once, more than 5"),
        (20, 20, 1.0, "20 of 20 watched machines silent at once"),
        (10, 100, 1.0, None),
        (11, 100, 1.0, "11 of 100 watched machines silent at once, more than 10"),
        (1, 20, 60.0, None),  # others still call: one machine's silence is its own
        (1, 20, 100.0, "no heartbeat accepted from any machine for 100s (more than 90s)"),
        (1, 1, None, "no heartbeat accepted from any machine yet"),
    ],
)
def test_hold_reason(silent: int, watched: int, age: float | None, held: str | None):
    reason = hold_reason(RULE, silent=silent, watched=watched, last_heartbeat_age=age)
    assert (reason is None) == (held is None), reason
    if held is not None:
        assert reason is not None and reason.startswith(held)


def test_machines_silent_since_before_a_hold_ended_get_the_grace_to_come_back():
    ended = datetime(2026, 11, 23, 3, 0, tzinfo=UTC)
    before, after = ended - timedelta(minutes=5), ended + timedelta(seconds=1)

    def spared(last_seen: datetime, minutes_after_the_end: float, hold_ended: datetime | None = ended) -> bool:
        as_of = ended + timedelta(minutes=minutes_after_the_end)
        return spared_after_hold(RULE, last_seen=last_seen, hold_ended=hold_ended, as_of=as_of)

    assert spared(before, 1) and spared(before, 9.9)
    assert not spared(before, 10), "the grace is over: a machine still silent is recovered"
    assert not spared(after, 1), "it came back after the hold and fell silent again: its own silence"
    assert not spared(before, 1, hold_ended=None)


def test_the_rule_from_settings_covers_the_agents_longest_retry():
    rule = recovery_hold_rule(Settings())
    assert (rule.min_machines, rule.fraction) == (5, 0.1)
    assert rule.quiet_path_after == 90.0, "three heartbeat intervals of 30s"
    assert rule.grace_after_hold == 600.0, "the heartbeat timeout, above the agents' 300s retry cap and an interval"
    short = recovery_hold_rule(Settings(heartbeat_timeout=20.0, heartbeat_interval=5.0))
    assert (short.quiet_path_after, short.grace_after_hold) == (15.0, AGENT_MAX_RETRY_INTERVAL + 5.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [("recovery_hold_min_machines", 0), ("recovery_hold_fraction", 0.0), ("recovery_hold_fraction", 1.5)],
)
def test_hold_settings_are_checked(name: str, value: Any):
    with pytest.raises(SettingsError, match=name):
        Settings(**{name: value}).check()
    with pytest.raises(SettingsError, match="recovery_hold_fraction"):
        Settings(recovery_hold_fraction=float("nan")).check()


async def test_a_hold_begins_once_is_released_once_and_ends_with_the_silence(bmdb: BMDB):
    assert await bmdb.held_recoveries() == []
    assert await bmdb.release_recoveries("sim", by="alice", reason="x") == (None, False)

    held, began = await bmdb.hold_recoveries("sim", reason="20 silent", silent_count=20, threshold=5, sample=["a", "b"])
    assert began and held.sample == ["a", "b"] and held.released_at is None
    again, began = await bmdb.hold_recoveries("sim", reason="21 silent", silent_count=21, threshold=5, sample=["a"])
    assert not began and again.held_since == held.held_since and again.silent_count == 21

    released, now = await bmdb.release_recoveries("sim", by="alice@ops", reason="the rack lost power")
    assert now and released is not None and released.released_by == "alice@ops"
    kept, now = await bmdb.release_recoveries("sim", by="bob", reason="me too")
    assert not now and kept is not None and kept.released_by == "alice@ops"
    # A pass that still finds too many silent keeps the release.
    still, _ = await bmdb.hold_recoveries("sim", reason="19 silent", silent_count=19, threshold=5, sample=["a"])
    assert still.released_by == "alice@ops"

    assert (await bmdb.end_recovery_hold("sim", "2 silent")) is not None
    assert await bmdb.end_recovery_hold("sim", "0 silent") is None
    assert await bmdb.held_recoveries() == []
    assert (await bmdb.watched_machines("sim")).hold_ended_at is not None
    assert await bmdb.release_recoveries("sim", by="bob", reason="late") == (None, False)

    # The next surge is a new hold: its own start, no release.
    fresh, began = await bmdb.hold_recoveries("sim", reason="30 silent", silent_count=30, threshold=5, sample=["c"])
    assert began and fresh.held_since > held.held_since and fresh.released_at is None
    assert (await bmdb.watched_machines("sim")).hold_ended_at is None
    kinds = [(e.kind, e.detail) for e in reversed(await bmdb.list_events(None))]
    assert kinds == [
        ("recoveries_held", "provider sim: 20 silent; silent: a, b"),
        ("recoveries_released", "provider sim: held recoveries released by alice@ops: the rack lost power"),
        ("recoveries_resumed", "provider sim: 2 silent"),
        ("recoveries_held", "provider sim: 30 silent; silent: c"),
    ]


async def test_watched_machines_count_agents_and_the_newest_heartbeat(bmdb: BMDB):
    assert (await bmdb.watched_machines("sim")).count == 0
    now = datetime.now(UTC)
    first, _ = await bmdb.admit_machine("sim", "a")
    second, _ = await bmdb.admit_machine("sim", "b")
    await bmdb.admit_machine("sim", "c")  # no agent: not watched
    for machine_id in (first, second):
        await bmdb.record_agent_started(machine_id, now, machine_id.bytes * 2)
    assert (await bmdb.watched_machines("sim")).last_heartbeat_at is None
    assert await bmdb.record_heartbeat(first, first.bytes * 2, now - timedelta(seconds=5))
    watched = await bmdb.watched_machines("sim")
    assert watched.count == 2 and watched.last_heartbeat_at is not None
    assert (await bmdb.watched_machines("other")).count == 0


async def test_many_silent_machines_are_held_until_an_operator_releases_them(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli
):
    # One machine silent is a machine's fault; two of three are more than the rule allows here.
    # A pass an hour: the only scheduled pass after the release is the one the release starts.
    settings = {**WATCH, "recovery_hold_min_machines": 1, "recovery_hold_fraction": 0.1, "reconcile_interval": 3600.0}
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, heartbeats=True, **settings) as stack:
        await stack.run_pass()
        everyone = ["node-0001", "node-0002", "node-0003"]
        await stack.wait_for_stage(everyone, MachineStage.WATCHING)
        for provider_id in ("node-0001", "node-0002"):
            assert (await sim_admin(stack, f"/admin/machines/{provider_id}/kill-agent", {}))["killed"] >= 1
        await asyncio.sleep(WATCH["heartbeat_timeout"] + 1)

        held = await stack.run_pass()
        assert held.silent == []
        hold = held.recoveries_held
        assert hold is not None and not hold.released
        assert (hold.silent_count, hold.threshold, hold.sample) == (2, 1, ["node-0001", "node-0002"])
        assert hold.reason.startswith("2 of 3 watched machines silent at once, more than 1")
        # A second pass holds again, and records no second event.
        assert (await stack.run_pass()).recoveries_held is not None
        assert [e.kind for e in await bmdb.list_events(None)] == ["recoveries_held"]
        for provider_id in everyone:
            status = await stack.status(provider_id)
            assert (status.stage, status.recovery_count, status.recovery_requested) == (MachineStage.WATCHING, 0, None)

        await ensure_fleet_schedules(stack.client, stack.settings)
        out = io.StringIO()
        await print_fleet(OperatorClient(stack.settings, temporal=stack.client), ["sim"], FleetAction(), out=out)
        shown = out.getvalue()
        assert "RECOVERIES HELD since" in shown and "silent: node-0001, node-0002" in shown
        assert "shepherd fleet --release-recoveries --provider sim" in shown

        environment = stack.environment(bmdb_url)
        with pytest.raises(SystemExit) as usage:
            await shepherd_cli(environment, "fleet", "--release-recoveries")
        assert usage.value.code == 2
        asked_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        code, out_text, err = await shepherd_cli(
            environment, "fleet", "--release-recoveries", "--reason", "two agents really died", "--by", "alice"
        )
        assert code == 0, err
        assert out_text.startswith("provider sim: released the recoveries held since"), out_text
        assert out_text.splitlines()[0].endswith("(2 machines silent): a pass started now signals them"), out_text

        async def scheduled_pass_started() -> Any:
            # Temporal marks what a schedule started; the test's own passes are started by hand.
            query = f'TemporalScheduledById = "{fleet_schedule_id("sim")}" AND StartTime > "{asked_at}"'
            return next(iter([execution async for execution in stack.client.list_workflows(query, limit=1)]), None)

        started = await wait_for(scheduled_pass_started, limit=30, what="the pass the release started")
        # That pass signals them; a look after it finds them told already.
        handle = stack.client.get_workflow_handle_for(FleetWorkflow.run, started.id, run_id=started.run_id)
        released = await handle.result()
        assert released.silent == ["node-0001", "node-0002"]
        assert released.recoveries_held is not None and released.recoveries_held.released_by == "alice (unverified)"
        assert (await stack.run_pass()).silent == []

        async def recovered() -> bool:
            statuses = [await stack.status(p) for p in ("node-0001", "node-0002")]
            return all(s.recovery_count == 1 and s.stage is MachineStage.WATCHING for s in statuses)

        await wait_for(recovered, limit=60, what="recovery of the released machines")
        assert (await stack.status("node-0003")).recovery_count == 0

        # Back under the threshold: the hold ends, and the next surge is held afresh.
        async def heartbeating_again() -> bool:
            return (await stack.run_pass()).recoveries_held is None

        await wait_for(heartbeating_again, limit=30, what="the hold to end")
        kinds = [e.kind for e in await bmdb.list_events(None)]
        assert kinds == ["recoveries_resumed", "recoveries_released", "recoveries_held"]
        code, out_text, err = await shepherd_cli(environment, "fleet", "--json")
        assert code == 0, err
        assert json.loads(out_text)["providers"][0]["recoveries_held"] is None


async def test_no_heartbeat_from_any_machine_holds_even_a_few_silent_ones(tmp_path, temporal_client, bmdb_url, bmdb):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=2, heartbeats=True, **WATCH) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.WATCHING)
        for provider_id in ("node-0001", "node-0002"):
            assert (await sim_admin(stack, f"/admin/machines/{provider_id}/kill-agent", {}))["killed"] >= 1
        await asyncio.sleep(WATCH["heartbeat_timeout"] + 1)

        result = await stack.run_pass()
        assert result.silent == []
        assert result.recoveries_held is not None
        assert "no heartbeat accepted from any machine for" in result.recoveries_held.reason
        for provider_id in ("node-0001", "node-0002"):
            assert (await stack.status(provider_id)).recovery_requested is None


async def test_a_heartbeat_outage_longer_than_the_timeout_reboots_no_machine(tmp_path, temporal_client, bmdb_url, bmdb):
    machines = ["node-0001", "node-0002", "node-0003"]
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, heartbeats=True, **WATCH) as stack:
        assert stack.heartbeat_path is not None
        await stack.run_pass()
        await stack.wait_for_stage(machines, MachineStage.WATCHING)
        await wait_for(lambda: _all_heartbeating(bmdb, 3), what="every agent's first heartbeat")

        await stack.heartbeat_path.stop()
        await asyncio.sleep(WATCH["heartbeat_timeout"] + 1.5)
        held = await stack.run_pass()
        assert held.silent == [] and held.recoveries_held is not None
        restarted = datetime.now(UTC)
        await stack.heartbeat_path.start()

        # Passes go on while the agents come back, each at its own jittered retry.
        async def every_agent_back() -> bool:
            result = await stack.run_pass()
            assert result.silent == [], f"a pass after the outage signalled {result.silent}"
            return await _all_heartbeating(bmdb, 3, since=restarted) and result.recoveries_held is None

        await wait_for(every_agent_back, limit=60, what="every agent back after the outage")
        for _ in range(2):
            assert (await stack.run_pass()).silent == []
        for provider_id in machines:
            assert (await stack.status(provider_id)).recovery_count == 0
        assert [e.kind for e in await bmdb.list_events(None)] == ["recoveries_resumed", "recoveries_held"]
        for record in await bmdb.list_machines():
            assert "rebooted" not in [e.kind for e in await bmdb.list_events(record.machine_id)]


async def _all_heartbeating(bmdb: BMDB, count: int, since: datetime | None = None) -> bool:
    records = await bmdb.list_machines()
    beating = [r for r in records if r.agent_heartbeat_at and (since is None or r.agent_heartbeat_at > since)]
    return len(beating) == count


def test_shepherd_fleet_shows_a_released_hold_and_the_spared_machines():
    hold = {
        "provider": "rack1",
        "since": "2026-11-23T03:12:09.5+00:00",
        "reason": "180 of 200 watched machines silent at once, more than 20",
        "silent_count": 180,
        "threshold": 20,
        "sample": ["node-0001", "node-0002"],
        "released_at": "2026-11-23T03:40:00+00:00",
        "released_by": "alice@ops",
        "release_reason": "rack 4 PDU replaced",
    }
    passes = [FleetPass(datetime(2026, 11, 23, 3, 41), "completed", {"recoveries_held": hold, "spared_after_hold": 3})]
    assert held_lines(passes) == [
        "RECOVERIES HELD since 2026-11-23 03:12:09: 180 of 200 watched machines silent at",
        "  once, more than 20",
        "  silent: node-0001, node-0002 ...",
        "  released by alice@ops: rack 4 PDU replaced",
    ]
    assert "  spared: 3 silent since before a hold ended, given time to come back" in format_passes(passes)
    assert held_lines([FleetPass(None, "completed", {"silent": []})]) == []


def test_a_released_hold_says_when_its_pass_comes():
    held = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    lines = release_lines(
        [
            HoldRelease("rack1", held, 40, True, pass_started=True),
            HoldRelease("rack2", held, 41, True, pass_started=False),
            HoldRelease("rack3", held, 42, True),
        ]
    )
    assert [line.split("silent): ")[1] for line in lines] == [
        "a pass started now signals them",
        "the fleet schedule is paused: the first look after `shepherd fleet --resume` signals them",
        "the workers' next look signals them",
    ]
