"""A recovery asked by heartbeat_lost goes ahead only when BMDB still finds the agent silent, with its provider's
recoveries not held: the confirm_silence activity on the real BMDB."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncssh
import pytest
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.deps import ActivityDeps
from activities.fleet import CONFIRMED_SILENCE_TOLD_AGAIN_AFTER, _told_lately
from activities.recovery import RecoveryActivities
from bmdb.records import SilentMachine
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.ssh_identity import public_key_openssh
from lifecycle.contracts import SilenceCheck, SilenceCheckInput
from lifecycle.takeover import key_fingerprint

KEY = b"k" * 32
SETTINGS = Settings(first_heartbeat_timeout=600.0, heartbeat_timeout=60.0)


@pytest.fixture
def recovery(bmdb: BMDB, temporal_client: Client) -> RecoveryActivities:
    key = asyncssh.generate_private_key("ssh-ed25519")
    deps = ActivityDeps(
        settings=SETTINGS,
        bmdb=bmdb,
        providers={},
        client=temporal_client,
        ssh_key=key,
        ssh_public_key=public_key_openssh(key),
    )
    return RecoveryActivities(deps)


async def confirm(recovery: RecoveryActivities, machine_id: uuid.UUID, fingerprint: str | None) -> SilenceCheck:
    check = SilenceCheckInput(str(machine_id), "sim", fingerprint)
    return await ActivityEnvironment().run(recovery.confirm_silence, check)


async def silent_machine(bmdb: BMDB, provider_id: str = "node-0001") -> uuid.UUID:
    """A machine whose agent started an hour ago and never called, past the 600 s first-heartbeat timeout."""
    machine_id, _ = await bmdb.admit_machine("sim", provider_id)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC) - timedelta(hours=1), KEY)
    return machine_id


async def unconfirmed_events(bmdb: BMDB, machine_id: uuid.UUID) -> list[str]:
    return [e.detail for e in await bmdb.list_events(machine_id) if e.kind == "heartbeat_lost_unconfirmed"]


async def test_a_silent_agent_is_confirmed_and_nothing_is_logged(bmdb, recovery):
    machine_id = await silent_machine(bmdb)
    check = await confirm(recovery, machine_id, key_fingerprint(KEY))
    assert check.confirmed and check.detail.startswith("no heartbeat since the agent started at")
    # A signal without the agent's fingerprint, as older watchdogs sent, is about whichever agent is on record.
    assert (await confirm(recovery, machine_id, None)).confirmed
    assert await unconfirmed_events(bmdb, machine_id) == []


async def test_an_agent_that_heartbeats_is_not_recovered(bmdb, recovery):
    machine_id = await silent_machine(bmdb)
    assert await bmdb.record_heartbeat(machine_id, KEY, datetime.now(UTC))
    check = await confirm(recovery, machine_id, key_fingerprint(KEY))
    assert not check.confirmed and check.detail.startswith("not recovered: its agent heartbeats")
    assert await unconfirmed_events(bmdb, machine_id) == [check.detail]


async def test_another_agent_than_the_one_watched_is_not_recovered(bmdb, recovery):
    machine_id = await silent_machine(bmdb)
    check = await confirm(recovery, machine_id, key_fingerprint(b"o" * 32))
    assert not check.confirmed and "not the one it watches" in check.detail


async def test_a_machine_the_watchdog_does_not_watch_is_not_recovered(bmdb, recovery):
    machine_id = await silent_machine(bmdb)
    assert await bmdb.set_maintenance(machine_id, True, "by alice: DIMM")
    assert not (await confirm(recovery, machine_id, key_fingerprint(KEY))).confirmed


async def test_held_recoveries_hold_a_signalled_one_until_released_or_its_grace_ends(bmdb, recovery):
    machine_id = await silent_machine(bmdb)
    await bmdb.hold_recoveries("sim", reason="40 of 50 silent", silent_count=40, threshold=5, sample=["node-0001"])
    check = await confirm(recovery, machine_id, key_fingerprint(KEY))
    assert not check.confirmed and check.detail == "not recovered: the recoveries of provider sim are held"
    # Another provider's hold holds nothing here.
    await bmdb.hold_recoveries("other", reason="all silent", silent_count=9, threshold=5, sample=[])
    await bmdb.release_recoveries("sim", by="alice", reason="switch fixed")
    assert (await confirm(recovery, machine_id, key_fingerprint(KEY))).confirmed, "released: recoveries go ahead"

    # A hold that has just ended: a machine silent since before it gets the grace to come back.
    await bmdb.hold_recoveries("sim", reason="40 of 50 silent", silent_count=40, threshold=5, sample=[])
    await bmdb.end_recovery_hold("sim", "the silence is over")
    check = await confirm(recovery, machine_id, key_fingerprint(KEY))
    assert not check.confirmed and "its grace after the hold runs" in check.detail


async def test_the_watchdog_notes_whom_it_told_per_agent_and_forgets_it_when_the_recovery_does_not_go_ahead(
    bmdb, recovery
):
    machine_id = await silent_machine(bmdb)

    async def signalled_at() -> datetime | None:
        rule = {"first_heartbeat_within": 600.0, "heartbeat_within": 60.0}
        [found] = await bmdb.silent_machines("sim", as_of=datetime.now(UTC), **rule)
        return found.signalled_at

    assert await signalled_at() is None
    [found] = await bmdb.silent_machines(
        "sim", as_of=datetime.now(UTC), first_heartbeat_within=600.0, heartbeat_within=60.0
    )
    await bmdb.record_silence_signalled([found])
    told = await signalled_at()
    assert told is not None and abs((datetime.now(UTC) - told).total_seconds()) < 60
    # The news was about another agent than the one on record: no recovery, and the next look tells it afresh.
    assert not (await confirm(recovery, machine_id, key_fingerprint(b"o" * 32))).confirmed
    assert await signalled_at() is None
    await bmdb.record_silence_signalled([found])
    # A new agent's silence is news whatever was told of the one before.
    await bmdb.record_agent_started(machine_id, datetime.now(UTC) - timedelta(minutes=30), KEY)
    assert await signalled_at() is None


async def test_a_confirmed_silence_is_noted_for_its_agent_alone(bmdb, recovery):
    machine_id = await silent_machine(bmdb)

    async def noted() -> SilentMachine:
        rule = {"first_heartbeat_within": 600.0, "heartbeat_within": 60.0}
        [found] = await bmdb.silent_machines("sim", as_of=datetime.now(UTC), **rule)
        return found

    assert (await noted()).confirmed_at is None
    assert (await confirm(recovery, machine_id, key_fingerprint(KEY))).confirmed
    confirmed = await noted()
    assert confirmed.confirmed_at is not None and confirmed.signalled_at is not None
    # Told again (a workflow reset to before its recovery): the confirmation of the same agent stands.
    await bmdb.record_silence_signalled([confirmed])
    assert (await noted()).confirmed_at == confirmed.confirmed_at
    # A new agent's silence is unconfirmed, whatever was confirmed of the one before.
    await bmdb.record_agent_started(machine_id, datetime.now(UTC) - timedelta(minutes=30), KEY)
    new = await noted()
    assert new.signalled_at is None and new.confirmed_at is None
    await bmdb.record_silence_signalled([new])
    told = await noted()
    assert told.signalled_at is not None and told.confirmed_at is None


@pytest.mark.parametrize(
    ("signalled", "confirmed", "told_lately"),
    [
        (None, None, False),
        (timedelta(seconds=30), None, True),
        # Unconfirmed a heartbeat timeout on: told again, in case the signal was lost.
        (timedelta(seconds=61), None, False),
        # Confirmed: left to its recovery, however long its reboot waits its turn.
        (timedelta(seconds=61), timedelta(seconds=60), True),
        (timedelta(minutes=59), timedelta(minutes=59), True),
        # An hour on, told again, in case its workflow was reset to before the confirmation.
        (timedelta(minutes=61), timedelta(minutes=61), False),
    ],
)
def test_a_look_tells_a_silent_machine_again_only_when_its_recovery_may_have_lost_the_news(
    signalled, confirmed, told_lately
):
    now = datetime.now(UTC)
    machine = SilentMachine(
        uuid.uuid4(),
        "node-0001",
        agent_started_at=now - timedelta(hours=2),
        agent_heartbeat_at=now - timedelta(hours=2),
        signalled_at=None if signalled is None else now - signalled,
        confirmed_at=None if confirmed is None else now - confirmed,
    )
    assert CONFIRMED_SILENCE_TOLD_AGAIN_AFTER == timedelta(hours=1)
    assert _told_lately(machine, now, heartbeat_within=60.0) is told_lately
