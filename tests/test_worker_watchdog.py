"""The workers' watchdog: looks for silent machines between fleet passes, in turns taken through BMDB."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from activities.fleet import FleetActivities
from bmdb.store import BMDB
from lifecycle.contracts import MachineStage, fleet_schedule_id
from lifecycle.inputs import watchdog_input
from processes.watchdog import watch_fleet
from processes.worker import ensure_fleet_schedules
from tests.fleet_stack import FleetStack, fleet_stack
from tests.test_fleet import sim_admin
from tests.test_recovery import wait_for

WATCH: dict[str, Any] = {"first_heartbeat_timeout": 20.0, "heartbeat_timeout": 2.0}


def looked_by(looks: list, provider: str) -> str | None:
    return next((look.looked_by for look in looks if look.provider == provider), None)


async def test_a_turn_is_skipped_after_a_recent_look_and_a_failed_look_is_not_recorded(bmdb: BMDB):
    provider = f"turns-{uuid.uuid4().hex[:8]}"
    async with bmdb.watchdog_turn(provider, by="worker a", unless_within=60.0) as due:
        assert due
    assert looked_by(await bmdb.watchdog_looks(), provider) == "worker a"
    async with bmdb.watchdog_turn(provider, by="worker b", unless_within=60.0) as due:
        assert not due, "worker a looked a moment ago"
    assert looked_by(await bmdb.watchdog_looks(), provider) == "worker a"
    # A fleet pass looks whenever the last look was.
    async with bmdb.watchdog_turn(provider, by="fleet pass p", unless_within=None) as due:
        assert due
    assert looked_by(await bmdb.watchdog_looks(), provider) == "fleet pass p"
    with pytest.raises(RuntimeError):
        async with bmdb.watchdog_turn(provider, by="worker c") as due:
            raise RuntimeError("BMDB went away mid-look")
    assert looked_by(await bmdb.watchdog_looks(), provider) == "fleet pass p"
    async with bmdb.watchdog_turn(provider, by="worker d", unless_within=0.001) as due:
        assert due, "the last look is older than the interval asked"


async def test_looks_of_one_provider_never_overlap_and_other_providers_do_not_wait(bmdb: BMDB):
    provider, other = f"overlap-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    first_inside, release_first = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def first() -> None:
        async with bmdb.watchdog_turn(provider, by="worker a", unless_within=60.0) as due:
            assert due
            first_inside.set()
            await release_first.wait()
            order.append("a ends")

    async def second() -> bool:
        async with bmdb.watchdog_turn(provider, by="worker b", unless_within=60.0) as due:
            order.append("b decides")
            return due

    holder = asyncio.create_task(first())
    await first_inside.wait()
    waiting = asyncio.create_task(second())
    async with bmdb.watchdog_turn(other, by="worker c", unless_within=60.0) as due:
        assert due, "another provider's look goes ahead"
    await asyncio.sleep(0.3)
    assert not waiting.done(), "the second look waits for the first to end"
    release_first.set()
    await holder
    # It then finds the first's look recorded, and leaves the provider to it.
    assert await waiting is False
    assert order == ["a ends", "b decides"]


@asynccontextmanager
async def watching(stack: FleetStack, identity: str) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(watch_fleet(stop, FleetActivities(stack.deps), stack.settings, identity=identity))
    try:
        yield
    finally:
        stop.set()
        await task


async def test_a_worker_finds_a_silent_machine_between_passes_and_it_is_recovered(
    tmp_path, temporal_client, bmdb_url, bmdb
):
    # No schedule, and no pass after the bring-up: only the worker's watchdog can find the silence.
    settings: dict[str, Any] = {**WATCH, "reconcile_interval": 3600.0, "watchdog_interval": 0.5}
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, heartbeats=True, **settings) as stack:
        await stack.run_pass()
        everyone = ["node-0001", "node-0002", "node-0003"]
        await stack.wait_for_stage(everyone, MachineStage.WATCHING)
        await ensure_fleet_schedules(stack.client, stack.settings)
        schedule = stack.client.get_schedule_handle(fleet_schedule_id("sim"))
        await schedule.pause(note="rack maintenance")
        async with watching(stack, "1@worker-a"), watching(stack, "2@worker-b"):
            assert (await sim_admin(stack, "/admin/machines/node-0002/kill-agent", {}))["killed"] >= 1
            # A paused fleet signals no silent machine, however long the silence.
            await asyncio.sleep(WATCH["heartbeat_timeout"] + 4 * stack.settings.watchdog_interval)
            assert (await stack.status("node-0002")).recovery_requested is None
            await schedule.unpause(note="done")

            async def recovered() -> bool:
                status = await stack.status("node-0002")
                return status.recovery_count == 1 and status.stage is MachineStage.WATCHING

            await wait_for(recovered, limit=60, what="the recovery the worker's watchdog asked for")
        status = await stack.status("node-0002")
        assert status.last_recovery_reason is not None and "heartbeat" in status.last_recovery_reason
        for provider_id in ("node-0001", "node-0003"):
            assert (await stack.status(provider_id)).recovery_count == 0
        assert looked_by(await bmdb.watchdog_looks(), "sim") in {"worker 1@worker-a", "worker 2@worker-b"}


async def test_a_look_that_fails_is_logged_and_made_again(tmp_path, temporal_client, bmdb_url, caplog):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1, run_worker=False) as stack:
        await ensure_fleet_schedules(stack.client, stack.settings)
        await stack.client.get_schedule_handle(fleet_schedule_id("sim")).unpause()
        unreachable = BMDB("postgresql://shepherd@127.0.0.1:9/bmdb?connect_timeout=1", pool_size=1)
        fleet = FleetActivities(replace(stack.deps, bmdb=unreachable))
        settings = stack.settings.replace(watchdog_interval=0.2)
        stop = asyncio.Event()
        with caplog.at_level(logging.WARNING, logger="shepherd.watchdog"):
            task = asyncio.create_task(watch_fleet(stop, fleet, settings, identity="1@worker-a"))

            async def failed_twice() -> bool:
                return sum("watchdog of provider sim did not look" in r.getMessage() for r in caplog.records) >= 2

            await wait_for(failed_twice, limit=30, what="two failed looks")
            stop.set()
            await task
        await unreachable.close()
        message = next(r.getMessage() for r in caplog.records if "did not look" in r.getMessage())
        assert message.startswith(
            "watchdog of provider sim did not look: BMDB at postgresql://shepherd@127.0.0.1:9/bmdb?connect_timeout=1 "
            "is unreachable: connection failed: "
        ), message
        assert message.endswith("; looking again in 0.2s") and "\n" not in message, message


async def test_a_silent_machine_is_told_once_and_left_to_the_recovery_that_confirmed_it(
    tmp_path, temporal_client, bmdb_url, bmdb
):
    # Long enough for the looks below to come within it of the first signal.
    watch = {**WATCH, "heartbeat_timeout": 6.0}
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=2, heartbeats=True, **watch) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.WATCHING)
        # The reboot's answer comes late: the recovery keeps the silent agent on record while the looks go on.
        await sim_admin(stack, "/admin/faults", {"reboot_answer_delay": 12.0})
        assert (await sim_admin(stack, "/admin/machines/node-0001/kill-agent", {}))["killed"] >= 1
        await asyncio.sleep(watch["heartbeat_timeout"] + 1)
        fleet = FleetActivities(stack.deps)

        async def look() -> list[str]:
            return (await fleet.look(watchdog_input(stack.settings, "sim", datetime.now(UTC).isoformat()))).signalled

        assert await look() == ["node-0001"]
        told = datetime.now(UTC)

        async def rebooting() -> bool:
            return (await stack.status("node-0001")).stage is MachineStage.RECOVERING

        await wait_for(rebooting, limit=30, what="the recovery the signal began")
        assert await look() == [], "its workflow was told already and is recovering"
        # A heartbeat timeout later it is not told again: its workflow confirmed the silence as its recovery began,
        # and noted so in BMDB (tests/test_silence_confirmation.py has when an unconfirmed one is told again).
        await asyncio.sleep(
            (told + timedelta(seconds=watch["heartbeat_timeout"] + 0.5) - datetime.now(UTC)).total_seconds()
        )
        assert await look() == []
        await sim_admin(stack, "/admin/faults", {"reboot_answer_delay": 0.0})

        async def recovered() -> bool:
            status = await stack.status("node-0001")
            return status.recovery_count == 1 and status.stage is MachineStage.WATCHING

        await wait_for(recovered, limit=60, what="the one recovery")
        assert (await stack.status("node-0002")).recovery_count == 0
        kinds = [
            e.kind for e in await bmdb.list_events((await bmdb.machines_with_provider_id("node-0001"))[0].machine_id)
        ]
        assert kinds.count("heartbeat_lost") == 1 and kinds.count("rebooted") == 1
