"""BMDB on a real PostgreSQL: migrations and idempotent writes."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncssh
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

from bmdb import migrate
from bmdb.schema import metadata
from bmdb.store import BMDB, BMDBUnavailable, HostKeyPinned, HostKeyUnexpected, sqlalchemy_url
from foundation.settings_report import redact_url
from foundation.ssh_sessions import host_key_fingerprint


def test_migrations_build_exactly_the_schema_the_code_uses(bmdb_url):
    engine = create_engine(sqlalchemy_url(bmdb_url))
    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert differences == []
    assert migrate.current_revision(bmdb_url) == migrate.head_revision()


def test_migrate_twice_is_harmless(bmdb_url):
    migrate.upgrade(bmdb_url)
    assert migrate.current_revision(bmdb_url) == migrate.head_revision()


async def test_admission_is_idempotent_even_when_concurrent(bmdb):
    results = await asyncio.gather(*(bmdb.admit_machine("sim", "node-0001") for _ in range(8)))
    machine_ids = {machine_id for machine_id, _ in results}
    assert len(machine_ids) == 1
    assert sum(created for _, created in results) == 1
    assert [m.provider_id for m in await bmdb.list_provided("sim")] == ["node-0001"]
    events = await bmdb.list_events(machine_ids.pop())
    assert [e.kind for e in events] == ["admitted"]


async def test_same_provider_id_of_another_provider_is_another_machine(bmdb):
    first, _ = await bmdb.admit_machine("sim", "node-0001")
    second, _ = await bmdb.admit_machine("other", "node-0001")
    assert first != second


async def test_record_provided_logs_once(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    assert await bmdb.record_provided(machine_id, address="127.0.0.1", ssh_port=2222, location="rack-1")
    assert not await bmdb.record_provided(machine_id, address="127.0.0.1", ssh_port=2222, location="rack-1")
    record = await bmdb.get_machine(machine_id)
    assert record is not None
    assert (record.status, record.address, record.ssh_port, record.location) == (
        "provided",
        "127.0.0.1",
        2222,
        "rack-1",
    )
    assert [e.kind for e in await bmdb.list_events(machine_id)] == ["provided", "admitted"]


async def test_record_provided_of_unknown_machine_is_an_error(bmdb):
    import uuid

    with pytest.raises(KeyError, match="no provided record"):
        await bmdb.record_provided(uuid.uuid4(), address=None, ssh_port=None, location=None)


async def test_takeover_pins_the_first_host_key_and_logs_every_start(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.record_provided(machine_id, address="127.0.0.1", ssh_port=2222, location=None)
    first, second = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)
    await bmdb.record_takeover(machine_id, first, b"a" * 32, "ssh-ed25519 AAAAfirst", "agent key A")
    await bmdb.record_takeover(machine_id, second, b"b" * 32, "ssh-ed25519 AAAAfirst", "agent key B")
    # A takeover that met another server (it lost a race to the first contact) records nothing.
    with pytest.raises(HostKeyPinned) as caught:
        await bmdb.record_takeover(machine_id, second, b"c" * 32, "ssh-ed25519 AAAAother", "agent key C")
    assert caught.value.pinned == "ssh-ed25519 AAAAfirst"
    record = await bmdb.get_machine(machine_id)
    assert record is not None
    assert record.ssh_host_key == "ssh-ed25519 AAAAfirst"
    assert (record.agent_started_at, record.agent_public_key) == (second, b"b" * 32)
    started = [e.detail for e in await bmdb.list_events(machine_id) if e.kind == "agent_started"]
    assert started == ["agent key B", "agent key A"]


async def test_the_host_key_is_pinned_at_the_first_handshake_and_a_racing_other_key_is_refused(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await asyncio.gather(*(bmdb.pin_host_key(machine_id, "ssh-ed25519 AAAAfirst") for _ in range(5)))
    with pytest.raises(HostKeyPinned):
        await bmdb.pin_host_key(machine_id, "ssh-ed25519 AAAAsecond")
    assert (await bmdb.get_machine(machine_id)).ssh_host_key == "ssh-ed25519 AAAAfirst"
    with pytest.raises(KeyError):
        await bmdb.pin_host_key(uuid.uuid4(), "ssh-ed25519 AAAAfirst")


def _host_key() -> tuple[str, str]:
    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    return key, host_key_fingerprint(key)


async def test_a_pin_reset_that_names_a_fingerprint_lets_only_a_key_with_it_be_pinned(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    (old, old_fp), (right, right_fp), (impostor, impostor_fp) = _host_key(), _host_key(), _host_key()
    await bmdb.pin_host_key(machine_id, old)
    assert await bmdb.reset_host_key(machine_id, old, "reinstalled", expected=right_fp)
    record = await bmdb.get_machine(machine_id)
    assert (record.ssh_host_key, record.expected_host_key_fingerprint) == (None, right_fp)

    # The impostor answers first: at the handshake, and in a takeover's record that raced the reset.
    with pytest.raises(HostKeyUnexpected) as caught:
        await bmdb.pin_host_key(machine_id, impostor)
    assert (caught.value.expected, caught.value.seen) == (right_fp, impostor_fp)
    with pytest.raises(HostKeyUnexpected):
        await bmdb.record_takeover(machine_id, datetime.now(UTC), b"i" * 32, impostor, "agent key I")
    record = await bmdb.get_machine(machine_id)
    assert (record.ssh_host_key, record.expected_host_key_fingerprint) == (None, right_fp)
    assert record.agent_started_at is None, "the impostor's agent is not recorded"

    await bmdb.pin_host_key(machine_id, right)
    record = await bmdb.get_machine(machine_id)
    assert (record.ssh_host_key, record.expected_host_key_fingerprint) == (right, None)
    pinned = [e.detail for e in await bmdb.list_events(machine_id) if e.kind == "host_key_pinned"]
    assert pinned == [f"host key {right_fp} pinned at first contact", f"host key {old_fp} pinned at first contact"]

    # A reset of a pin it did not see changes nothing; one without a fingerprint lets any key be pinned again.
    assert not await bmdb.reset_host_key(machine_id, old, "stale", expected=impostor_fp)
    assert not await bmdb.reset_host_key(machine_id, None, "stale", expected=impostor_fp)
    assert (await bmdb.get_machine(machine_id)).expected_host_key_fingerprint is None
    assert await bmdb.reset_host_key(machine_id, right, "reinstalled again", expected=right_fp)
    assert await bmdb.reset_host_key(machine_id, None, "any key will do")
    await bmdb.pin_host_key(machine_id, impostor)
    assert (await bmdb.get_machine(machine_id)).ssh_host_key == impostor


async def test_a_reimage_forgets_an_expected_fingerprint_with_the_pin(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    (old, _), (_, expected_fp), (new_os, _) = _host_key(), _host_key(), _host_key()
    await bmdb.pin_host_key(machine_id, old)
    assert await bmdb.reset_host_key(machine_id, old, "reinstalled", expected=expected_fp)
    assert await bmdb.record_reboot(machine_id, "run-1", "reimaged: budget spent", reimaged=True)
    assert (await bmdb.get_machine(machine_id)).expected_host_key_fingerprint is None
    await bmdb.pin_host_key(machine_id, new_os)


async def test_a_recovery_cycle_records_its_reboot_once(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"k" * 32)
    assert not await bmdb.reboot_recorded(machine_id, "run-1")
    assert await bmdb.record_reboot(machine_id, "run-1", "rebooted: heartbeat lost")
    assert await bmdb.reboot_recorded(machine_id, "run-1")
    record = await bmdb.get_machine(machine_id)
    assert record is not None and record.agent_started_at is None, "the old agent is forgotten"
    # A retry whose first answer was lost changes nothing: no second event, and a new agent is kept.
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"n" * 32)
    assert not await bmdb.record_reboot(machine_id, "run-1", "rebooted: heartbeat lost")
    record = await bmdb.get_machine(machine_id)
    assert record is not None and record.agent_public_key == b"n" * 32
    assert await bmdb.record_reboot(machine_id, "run-2", "rebooted: forced: disk")
    assert [e.kind for e in await bmdb.list_events(machine_id)].count("rebooted") == 2
    assert (await bmdb.recovery_counts(machine_id))[machine_id] == 2


async def test_a_quarantined_machine_is_neither_silent_nor_watched_until_released(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"k" * 32)
    later = datetime.now(UTC) + timedelta(hours=1)

    async def silent() -> list[str]:
        found = await bmdb.silent_machines("sim", as_of=later, first_heartbeat_within=60, heartbeat_within=60)
        return [m.provider_id for m in found]

    assert await silent() == ["node-0001"] and (await bmdb.watched_machines("sim")).count == 1
    assert await bmdb.set_quarantined(machine_id, True, "3 recoveries within 1:00:00")
    assert not await bmdb.set_quarantined(machine_id, True, "again")
    assert await silent() == [] and (await bmdb.watched_machines("sim")).count == 0
    assert await bmdb.set_quarantined(machine_id, False, "released by alice: PSU replaced")
    assert not await bmdb.set_quarantined(machine_id, False, "again")
    assert await silent() == ["node-0001"]
    events = [(e.kind, e.detail) for e in await bmdb.list_events(machine_id)]
    assert events[:2] == [
        ("released", "released by alice: PSU replaced"),
        ("quarantined", "3 recoveries within 1:00:00"),
    ]


async def test_a_stuck_flag_is_set_once_counted_by_provider_and_cleared(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.admit_machine("sim", "node-0002")
    assert await bmdb.count_stuck() == {}
    assert await bmdb.set_stuck(machine_id, True, "AGENT_STARTING for 4:00:00")
    assert not await bmdb.set_stuck(machine_id, True, "again")
    assert await bmdb.count_stuck() == {"sim": 1}
    record = await bmdb.get_machine(machine_id)
    assert record is not None and record.stuck_since is not None
    assert await bmdb.set_stuck(machine_id, False, "AGENT_STARTING done after 4:10:00")
    assert await bmdb.count_stuck() == {}
    kinds = [e.kind for e in await bmdb.list_events(machine_id)]
    assert kinds[:2] == ["unstuck", "stuck"]


async def test_a_machine_in_maintenance_is_not_watched_and_its_silent_agent_can_be_forgotten(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"k" * 32)
    later = datetime.now(UTC) + timedelta(hours=1)
    assert await bmdb.set_maintenance(machine_id, True, "by alice: DIMM")
    assert not await bmdb.set_maintenance(machine_id, True, "again")
    assert await bmdb.silent_machines("sim", as_of=later, first_heartbeat_within=60, heartbeat_within=60) == []
    assert (await bmdb.watched_machines("sim")).count == 0
    assert await bmdb.set_maintenance(machine_id, False, "by alice: done")

    assert not await bmdb.agent_alive(machine_id, 600), "no heartbeat yet"
    assert await bmdb.record_heartbeat(machine_id, b"k" * 32, datetime.now(UTC))
    assert await bmdb.agent_alive(machine_id, 600)
    assert await bmdb.forget_silent_agent(machine_id, "silent after maintenance")
    assert not await bmdb.forget_silent_agent(machine_id, "again")
    record = await bmdb.get_machine(machine_id)
    assert record is not None and record.agent_started_at is None and record.agent_heartbeat_at is None
    kinds = [e.kind for e in await bmdb.list_events(machine_id)]
    assert kinds[:3] == ["agent_forgotten", "maintenance_off", "maintenance_on"]


async def test_a_retired_machine_is_marked_once_keeps_its_rows_and_is_never_watched(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"k" * 32)
    assert await bmdb.set_maintenance(machine_id, True, "by alice: DIMM")
    assert await bmdb.forget_silent_agent(machine_id, "asked by bob: end of lease", kind="decommissioning")
    assert await bmdb.retire(machine_id, "asked by bob: end of lease; provider sim: released")
    assert not await bmdb.retire(machine_id, "twice")

    record = await bmdb.get_machine(machine_id)
    assert record is not None and record.retired_at is not None
    assert record.retired_reason == "asked by bob: end of lease; provider sim: released"
    assert record.agent_started_at is None
    [provided] = await bmdb.list_provided("sim")
    assert provided.retired and provided.machine_id == machine_id
    later = datetime.now(UTC) + timedelta(hours=1)
    assert await bmdb.silent_machines("sim", as_of=later, first_heartbeat_within=60, heartbeat_within=60) == []
    assert (await bmdb.watched_machines("sim")).count == 0
    # Its heartbeats are refused: no agent key is on record.
    assert not await bmdb.record_heartbeat(machine_id, b"k" * 32, datetime.now(UTC))
    kinds = [e.kind for e in await bmdb.list_events(machine_id)]
    assert kinds[:3] == ["decommissioned", "decommissioning", "maintenance_on"]
    assert (await bmdb.admit_machine("sim", "node-0001")) == (machine_id, False), "the id is never taken again"


async def test_a_lost_heartbeat_is_logged_once_per_agent(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    started = datetime.now(UTC) - timedelta(hours=1)
    await bmdb.record_agent_started(machine_id, started, b"k" * 32)
    silent = await bmdb.silent_machines("sim", as_of=datetime.now(UTC), first_heartbeat_within=60, heartbeat_within=60)
    assert [m.machine_id for m in silent] == [machine_id]
    assert await bmdb.record_heartbeats_lost(silent) == 1
    assert await bmdb.record_heartbeats_lost(silent) == 0, "the next pass finds it silent again: no second event"
    [event] = await bmdb.list_events(machine_id, limit=1)
    assert event.kind == "heartbeat_lost" and event.detail.startswith("no heartbeat since the agent started at")
    # A new agent that falls silent is a new story.
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), b"n" * 32)
    again = await bmdb.silent_machines(
        "sim", as_of=datetime.now(UTC) + timedelta(hours=1), first_heartbeat_within=60, heartbeat_within=60
    )
    assert await bmdb.record_heartbeats_lost(again) == 1


async def test_agent_started_is_an_upsert(bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    await bmdb.record_agent_started(machine_id, datetime(2026, 1, 1, tzinfo=UTC), b"a" * 32)
    await bmdb.record_agent_started(machine_id, datetime(2026, 1, 2, tzinfo=UTC), b"b" * 32)
    record = await bmdb.get_machine(machine_id)
    assert record is not None
    assert record.agent_public_key == b"b" * 32
    assert record.agent_started_at == datetime(2026, 1, 2, tzinfo=UTC)
    assert (await bmdb.count_by_status())["agent_started"] == 1


async def test_unreachable_database_is_named_without_its_password(tmp_path):
    url = f"postgresql://shepherd:s3cret@/nowhere?host={tmp_path}"
    db = BMDB(url)
    with pytest.raises(BMDBUnavailable) as caught:
        await db.ping()
    await db.close()
    assert "s3cret" not in str(caught.value)
    assert "unreachable" in str(caught.value)


def test_redact_url():
    assert redact_url("postgresql://u:pw@host:5432/db") == "postgresql://u:***@host:5432/db"
    assert redact_url("postgresql://u@host/db") == "postgresql://u@host/db"
    assert redact_url("postgresql://postgres:@/postgres?host=/tmp") == "postgresql://postgres:***@/postgres?host=/tmp"
    assert redact_url("postgresql://u@h/db?password=s3cret&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert redact_url("postgresql:///db?host=/tmp&PassWord=s3cret") == "postgresql:///db?host=/tmp&PassWord=***"
    assert redact_url("postgresql://u:p@ss@h/db?sslpassword=k&x=a@b") == (
        "postgresql://u:***@h/db?sslpassword=***&x=a@b"
    )


async def test_silent_machines_follow_the_seeds_rule(bmdb):
    from datetime import timedelta

    now = datetime.now(UTC)
    started = {
        "node-0001": now - timedelta(minutes=31),
        "node-0002": now - timedelta(minutes=31),
        "node-0003": now - timedelta(minutes=29),
    }
    machines = {}
    for provider_id, started_at in started.items():
        machines[provider_id], _ = await bmdb.admit_machine("sim", provider_id)
        await bmdb.record_agent_started(machines[provider_id], started_at, provider_id.encode().ljust(32, b"."))
    await bmdb.admit_machine("sim", "node-0004")  # no agent started: never silent
    # node-0002 sends a heartbeat now (the database's clock).
    assert await bmdb.record_heartbeat(machines["node-0002"], b"node-0002".ljust(32, b"."), now)

    async def silent(minutes_from_now: int) -> list[str]:
        as_of = now + timedelta(minutes=minutes_from_now)
        found = await bmdb.silent_machines("sim", as_of=as_of, first_heartbeat_within=1800, heartbeat_within=600)
        return [m.provider_id for m in found]

    # No heartbeat 30 minutes after the agent started.
    assert await silent(0) == ["node-0001"]
    assert await silent(2) == ["node-0001", "node-0003"]
    # The last heartbeat older than 10 minutes.
    assert await silent(9) == ["node-0001", "node-0003"]
    assert await silent(11) == ["node-0001", "node-0002", "node-0003"]
    causes = await bmdb.silent_machines(
        "sim", as_of=now + timedelta(minutes=11), first_heartbeat_within=1800, heartbeat_within=600
    )
    assert "no heartbeat since" in causes[0].cause() and "last heartbeat at" in causes[1].cause()
    # After a reboot the agent is forgotten until the next takeover.
    await bmdb.forget_agent(machines["node-0001"], "rebooted: test")
    assert await silent(11) == ["node-0002", "node-0003"]
    assert (await bmdb.list_events(machines["node-0001"]))[0].kind == "rebooted"


async def test_machines_a_provider_stops_listing_are_marked_once_and_never_silent(bmdb):
    from datetime import timedelta

    provider = "listing-test"
    now = datetime.now(UTC)
    machines = {}
    for provider_id in ("a", "b"):
        machines[provider_id], _ = await bmdb.admit_machine(provider, provider_id)
        await bmdb.record_agent_started(machines[provider_id], now - timedelta(hours=1), provider_id.encode() * 32)

    async def silent() -> list[str]:
        found = await bmdb.silent_machines(provider, as_of=now, first_heartbeat_within=60, heartbeat_within=60)
        return [m.provider_id for m in found]

    assert await silent() == ["a", "b"]
    assert await bmdb.record_provider_listing(provider, ["a"], []) == (["a"], [])
    # Marked already: a later pass that still misses it changes and logs nothing.
    assert await bmdb.record_provider_listing(provider, ["a"], []) == ([], [])
    assert await silent() == ["b"]
    [missing] = await bmdb.machines_with_provider_id("a")
    assert missing.missing_since is not None
    assert [p.missing for p in await bmdb.list_provided(provider)] == [True, False]

    assert await bmdb.record_provider_listing(provider, [], ["a"]) == ([], ["a"])
    assert await silent() == ["a", "b"]
    kinds = [event.kind for event in await bmdb.list_events(machines["a"])]
    assert kinds[:2] == ["back_at_provider", "missing_at_provider"] and kinds.count("missing_at_provider") == 1
