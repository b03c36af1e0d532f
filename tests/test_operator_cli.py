"""The operator's commands: machines (filters, JSON), status, events, fleet (passes, pause, resume, trigger)."""

from __future__ import annotations

import io
import json
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncssh
import pytest
from sqlalchemy import insert, update
from temporalio.client import WorkflowFailureError

from bmdb.schema import machine_provided, machines
from bmdb.store import BMDB, MachineRecord
from foundation.ssh_sessions import host_key_fingerprint
from lifecycle.contracts import FORCE_RECOVER_SIGNAL, MachineStage
from operations.machine_names import MachineNotFound, resolve_machine
from processes.worker import ensure_fleet_schedules
from shepherd.commands.base import operator
from shepherd.commands.machines import MachineView, format_machines, machine_json
from tests.fleet_stack import fleet_stack
from tests.test_recovery import WATCH, wait_for

NO_SCHEDULE = "a worker creates it when it starts"
ANY_KEY_PINNED = "the first host key to answer will be pinned, and a host_key_pinned event will name it"
NOT_FOUND = "it is neither a BMDB machine id (or a unique prefix of one), a provider id nor a workflow id"


async def add_machine(bmdb: BMDB, machine_id: str, provider: str, provider_id: str) -> None:
    async with bmdb.engine.begin() as conn:
        await conn.execute(insert(machines).values(machine_id=uuid.UUID(machine_id)))
        await conn.execute(
            insert(machine_provided).values(
                machine_id=uuid.UUID(machine_id), provider=provider, provider_id=provider_id, status="provided"
            )
        )


async def test_a_machine_is_found_by_any_of_its_names(bmdb):
    await add_machine(bmdb, "abcd0000-0000-4000-8000-000000000001", "sim", "node-0001")
    await add_machine(bmdb, "abcd1111-0000-4000-8000-000000000002", "other", "node-0001")
    await add_machine(bmdb, "12345678-0000-4000-8000-000000000003", "my-cloud", "rack-1")

    async def provider_id_of(name: str) -> tuple[str, str]:
        record = await resolve_machine(bmdb, name)
        return record.provider, record.provider_id

    assert await provider_id_of("abcd0000-0000-4000-8000-000000000001") == ("sim", "node-0001")
    assert await provider_id_of("abcd0") == ("sim", "node-0001")
    assert await provider_id_of("ABCD1") == ("other", "node-0001")
    assert await provider_id_of("machine-other-node-0001") == ("other", "node-0001")
    assert await provider_id_of("machine-my-cloud-rack-1") == ("my-cloud", "rack-1")
    assert await provider_id_of("rack-1") == ("my-cloud", "rack-1")
    assert await provider_id_of(" 1234 ") == ("my-cloud", "rack-1")

    for ambiguous in ("abcd", "node-0001"):
        with pytest.raises(MachineNotFound) as caught:
            await resolve_machine(bmdb, ambiguous)
        assert str(caught.value).startswith(f"{ambiguous!r} is ambiguous: it names abcd")
        assert "machine-sim-node-0001" in str(caught.value) and "machine-other-node-0001" in str(caught.value)
    for unknown in ("node-0009", "abc", "", "machine-sim-rack-1", "1234%", "abcd_"):
        with pytest.raises(MachineNotFound) as caught:
            await resolve_machine(bmdb, unknown)
        assert str(caught.value) == f"no machine {unknown!r}: {NOT_FOUND}"


async def test_machines_filters_and_json(tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002", "node-0003"], MachineStage.WATCHING)
        await stack.machine("node-0002").terminate("retired by hand")
        env = stack.environment(bmdb_url)

        code, out, err = await shepherd_cli(env, "machines", "--stage", "watching")
        assert code == 0, err
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["node-0001", "node-0003"]
        code, out, _ = await shepherd_cli(env, "machines", "--stage", "-")
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["node-0002"]
        code, out, _ = await shepherd_cli(env, "machines", "--provider", "elsewhere")
        assert code == 0 and out.splitlines()[1:] == []

        code, out, err = await shepherd_cli(env, "machines", "--json")
        assert code == 0, err
        rows = json.loads(out)
        assert [row["provider_id"] for row in rows] == ["node-0001", "node-0002", "node-0003"]
        first = rows[0]
        record = (await bmdb.machines_with_provider_id("node-0001"))[0]
        assert first["machine_id"] == str(record.machine_id) and first["workflow_id"] == "machine-sim-node-0001"
        assert first["stage"] == "WATCHING" and rows[1]["stage"] is None
        assert first["address"] == "127.0.0.1" and isinstance(first["ssh_port"], int)
        assert first["agent_started_at"] and first["recoveries"] == 0 and first["bmdb_status"] == "provided"


async def test_events_of_a_machine(tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        env = stack.environment(bmdb_url)
        record = (await bmdb.machines_with_provider_id("node-0001"))[0]
        await bmdb.add_event(record.machine_id, "note", "x" * 200)

        code, out, err = await shepherd_cli(env, "events", str(record.machine_id)[:8])
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == f"node-0001 (machine-sim-node-0001), BMDB machine {record.machine_id}"
        kinds = ["note", "agent_started", "host_key_pinned", "provided", "admitted"]
        assert [line.split()[2] for line in lines[2:]] == kinds
        assert max(len(line) for line in lines[1:]) <= 80 and lines[2].endswith("x...")

        code, out, err = await shepherd_cli(env, "events", "machine-sim-node-0001", "--json", "--limit", "2")
        assert code == 0, err
        log = json.loads(out)
        assert log["machine_id"] == str(record.machine_id)
        assert [e["kind"] for e in log["events"]] == ["note", "agent_started"]
        assert log["events"][0]["detail"] == "x" * 200

        code, out, err = await shepherd_cli(env, "events", "node-0404")
        assert (code, out) == (1, "") and err == f"shepherd events: no machine 'node-0404': {NOT_FOUND}\n"


async def test_status_of_a_machine_joins_its_workflow_and_its_heartbeats(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli
):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=2, heartbeats=True, **WATCH) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.WATCHING)
        await stack.machine("node-0001").signal(FORCE_RECOVER_SIGNAL, {"reason": "disk errors"})

        async def recovered_and_heartbeating():
            status = await stack.status("node-0001")
            record = (await bmdb.machines_with_provider_id("node-0001"))[0]
            watching = status.recovery_count == 1 and status.stage is MachineStage.WATCHING
            return record if watching and record.agent_heartbeat_at else None

        record = await wait_for(recovered_and_heartbeating, limit=30, what="recovery and a new heartbeat")
        env = stack.environment(bmdb_url)

        code, out, err = await shepherd_cli(env, "status", str(record.machine_id)[:6])
        assert code == 0, err
        rows = {line[:19].strip(): line[20:] for line in out.splitlines()}
        assert max(len(line) for line in out.splitlines()) <= 80
        assert rows["machine"] == f"node-0001 (sim), BMDB {record.machine_id}"
        assert rows["workflow"] == "machine-sim-node-0001, RUNNING"
        assert rows["stage"].startswith("WATCHING since ")
        assert rows["last heartbeat"].endswith(" ago)") and rows["agent key"].startswith("SHA256:")
        assert rows["recoveries"] == "1" and rows["last recovery"] == "forced: disk errors"

        code, out, err = await shepherd_cli(env, "status", "machine-sim-node-0001", "--json")
        assert code == 0, err
        detail = json.loads(out)
        assert detail["machine_id"] == str(record.machine_id) and detail["workflow_state"] == "RUNNING"
        assert detail["status"]["stage"] == "WATCHING" and detail["status"]["recovery_count"] == 1
        assert detail["last_heartbeat_at"] and detail["recoveries"] == 1 and detail["status_missing"] is None

        await stack.machine("node-0002").terminate("retired by hand")
        code, out, err = await shepherd_cli(env, "status", "node-0002")
        assert code == 0, err
        assert "machine-sim-node-0002, TERMINATED" in out and "the workflow is not running" in out

        await add_machine(bmdb, "feed0000-0000-4000-8000-000000000009", "sim", "node-0009")
        code, out, err = await shepherd_cli(env, "status", "node-0009", "--json")
        assert code == 0, err
        detail = json.loads(out)
        assert detail["workflow_state"] == "NOT STARTED" and detail["status"] is None
        assert detail["last_heartbeat_at"] is None and "next fleet pass starts it" in detail["status_missing"]

        code, out, err = await shepherd_cli(env, "status", "node-0404")
        assert (code, out) == (1, "") and err == f"shepherd status: no machine 'node-0404': {NOT_FOUND}\n"


async def test_reset_host_key_lets_a_reinstalled_machine_be_taken_over_at_once(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli, capsys
):
    # A back-off of an hour: only retry_now brings the takeover back within the test. The reboot is
    # instant, so the first takeover after it meets the changed host key rather than a booting machine.
    settings: dict[str, Any] = {**WATCH, "agent_start_backoff_initial": 3600.0, "agent_start_backoff_maximum": 3600.0}
    async with fleet_stack(
        tmp_path, temporal_client, bmdb_url, machines=1, heartbeats=True, sim_boot_seconds=0.0, **settings
    ) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        record = (await bmdb.machines_with_provider_id("node-0001"))[0]
        real_key = record.ssh_host_key
        assert real_key is not None
        # As if the machine had been reinstalled: the key it shows is not the one pinned.
        old_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
        async with bmdb.engine.begin() as conn:
            await conn.execute(
                update(machine_provided)
                .where(machine_provided.c.machine_id == record.machine_id)
                .values(ssh_host_key=old_key)
            )
        await stack.machine("node-0001").signal(FORCE_RECOVER_SIGNAL, {"reason": "reinstalled"})
        status = await stack.wait_for_error("node-0001")
        assert status.stage is MachineStage.AGENT_STARTING
        assert status.last_error and status.last_error.startswith("HOST_KEY_CHANGED: ")
        assert "shepherd reset-host-key" in status.last_error
        env = stack.environment(bmdb_url)

        code, out, err = await shepherd_cli(
            env, "reset-host-key", "node-0001", "--reason", "reinstalled by DC ops", "--by", "dc-ops"
        )
        assert code == 0, err
        old_fingerprint = host_key_fingerprint(old_key)
        assert out == (
            f"node-0001: host key pin {old_fingerprint} reset (reinstalled by DC ops); "
            f"machine-sim-node-0001 was asked to retry now: {ANY_KEY_PINNED}\n"
        )
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING, limit=30)
        assert (await bmdb.get_machine(record.machine_id)).ssh_host_key == real_key
        events = await bmdb.list_events(record.machine_id)
        assert any(
            e.kind == "host_key_reset"
            and e.detail == f"by dc-ops (unverified): reinstalled by DC ops; was {old_fingerprint}"
            for e in events
        )
        # Who did what: the forced recovery (from a signal that named no one), the reboot, the reset, the retry.
        code, out, err = await shepherd_cli(env, "events", "node-0001", "--actions", "--json")
        assert code == 0, err
        assert [(e["kind"], e["detail"]) for e in json.loads(out)["events"]] == [
            ("retry_asked", "by dc-ops (unverified): host key pin reset: reinstalled by DC ops"),
            ("host_key_reset", f"by dc-ops (unverified): reinstalled by DC ops; was {old_fingerprint}"),
            ("rebooted", "rebooted: forced: reinstalled"),
            ("recovery_forced", "by unknown (unverified): reinstalled"),
        ]

        # A pin that changed since it was read is not reset.
        assert not await bmdb.reset_host_key(record.machine_id, old_key, "stale")
        assert (await bmdb.get_machine(record.machine_id)).ssh_host_key == real_key

        # Reinstalled again, and the operator names the key's fingerprint: a key without it (as an impostor's
        # that answers first) is refused, nothing is pinned, and the machine is not rebooted for it.
        real_fingerprint = host_key_fingerprint(real_key)
        expected = host_key_fingerprint(old_key)
        code, out, err = await shepherd_cli(
            env, "reset-host-key", "node-0001", "--reason", "reinstalled", "--expect-fingerprint", expected
        )
        assert code == 0, err
        assert out.startswith(f"node-0001: host key pin {real_fingerprint} reset (reinstalled); machine-sim-node-0001")
        assert out.endswith(f": only a host key with fingerprint {expected} will be pinned\n")
        await stack.machine("node-0001").signal(FORCE_RECOVER_SIGNAL, {"reason": "reinstalled again"})
        status = await stack.wait_for_error("node-0001")
        assert status.stage is MachineStage.AGENT_STARTING
        assert status.last_error and status.last_error.startswith("HOST_KEY_CHANGED: ")
        assert f"the SSH host key is {real_fingerprint}, the operator who reset its pin expects {expected}" in (
            status.last_error
        )
        record = await bmdb.get_machine(record.machine_id)
        assert (record.ssh_host_key, record.expected_host_key_fingerprint) == (None, expected)
        console = ("--reason", "as on the console", "--expect-fingerprint", real_fingerprint)
        code, out, err = await shepherd_cli(env, "reset-host-key", "node-0001", *console)
        assert code == 0, err
        assert out == (
            "node-0001: no host key pinned; the expectation reset (as on the console); "
            f"machine-sim-node-0001 was asked to retry now: only a host key with fingerprint {real_fingerprint} "
            "will be pinned\n"
        )
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING, limit=30)
        assert (await bmdb.get_machine(record.machine_id)).ssh_host_key == real_key
        events = await bmdb.list_events(record.machine_id)
        assert [e.kind for e in events].count("rebooted") == 2, "one reboot for each forced recovery, none more"
        # At the first takeover, after the first reset and after the last; the refused key never was.
        pinned = [e.detail for e in events if e.kind == "host_key_pinned"]
        assert pinned == [f"host key {real_fingerprint} pinned at first contact"] * 3
        with pytest.raises(SystemExit) as usage:
            await shepherd_cli(env, "reset-host-key", "node-0001", "--reason", "x", "--expect-fingerprint", "ab:cd")
        assert usage.value.code == 2
        assert "'ab:cd' is no SHA256 host key fingerprint: expected SHA256: and 43 base64 characters" in (
            capsys.readouterr().err
        )

        await add_machine(bmdb, "feed0000-0000-4000-8000-000000000009", "sim", "node-0009")
        code, out, err = await shepherd_cli(env, "reset-host-key", "node-0009", "--reason", "x")
        assert (code, err) == (0, "")
        assert out == f"node-0009 has no pinned host key; {ANY_KEY_PINNED}\n"
        code, out, err = await shepherd_cli(env, "reset-host-key", "node-0404", "--reason", "x")
        assert (code, out) == (1, "") and err == f"shepherd reset-host-key: no machine 'node-0404': {NOT_FOUND}\n"
        with pytest.raises(SystemExit) as usage:
            await shepherd_cli(env, "reset-host-key", "node-0001")
        assert usage.value.code == 2


async def test_fleet_shows_passes_and_pauses_resumes_and_triggers_the_schedule(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli
):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, max_machines=1) as stack:
        env = stack.environment(bmdb_url)
        code, out, err = await shepherd_cli(env, "fleet")
        assert (code, out) == (1, "")
        assert err == f"shepherd fleet: there is no fleet schedule 'shepherd-fleet-sim' yet: {NO_SCHEDULE}\n"

        await stack.run_pass()
        # Someone else takes a machine behind Shepherd's back: the next pass is refused.
        await stack.deps.provider("sim").create_machine("node-0002", "someone-else", stack.deps.ssh_public_key)
        await ensure_fleet_schedules(temporal_client, stack.settings)
        with pytest.raises(WorkflowFailureError):
            await stack.run_pass()

        code, out, err = await shepherd_cli(env, "fleet", "--passes", "2")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith("schedule shepherd-fleet-sim: running, every 15m, next pass ")
        assert lines[2].split()[2:] == ["refused", "3", "1", "0", "0", "0"]
        assert lines[3].startswith("  why: refused: provider and BMDB disagree on 1 machine(s): node-0002")
        assert lines[4].startswith("       ") and "BMDB has no record of it" in lines[4]
        passes = [line for line in lines[2:] if not line.startswith(" ")]
        assert passes[1].split()[2:] == ["completed", "3", "0", "1", "0", "0"]
        assert max(len(line) for line in lines) <= 80

        code, out, err = await shepherd_cli(
            env, "fleet", "--pause", "--note", "rack maintenance", "--by", "alice", "--passes", "1"
        )
        assert code == 0, err
        assert out.splitlines()[:2] == [
            "paused the fleet schedule shepherd-fleet-sim: no passes until `shepherd fleet --resume`",
            "schedule shepherd-fleet-sim: PAUSED (rack maintenance; by alice (unverified)), every 15m",
        ]
        code, out, err = await shepherd_cli(env, "fleet", "--json", "--passes", "1")
        [facts] = json.loads(out)["providers"]
        assert facts["provider"] == "sim"
        assert (
            facts["schedule"]["paused"] is True
            and facts["schedule"]["note"] == "rack maintenance; by alice (unverified)"
        )
        assert facts["passes"][0]["outcome"] == "refused" and facts["passes"][0]["result"]["plan"]["bmdb_count"] == 1

        code, out, err = await shepherd_cli(env, "fleet", "--resume", "--passes", "1")
        assert code == 0 and out.splitlines()[1].startswith("schedule shepherd-fleet-sim: running")
        code, out, err = await shepherd_cli(env, "fleet", "--trigger", "--by", "bob", "--passes", "3")
        assert code == 0 and out.startswith("started a fleet pass of sim now\n")
        with pytest.raises(SystemExit) as usage:
            await shepherd_cli(env, "fleet", "--by", "bob")
        assert usage.value.code == 2

        # Every machine's and the fleet's actions, newest first; the fleet's have no machine.
        code, out, err = await shepherd_cli(env, "events", "--actions", "--json")
        assert code == 0, err
        actions = [(e["provider_id"], e["kind"], e["detail"]) for e in json.loads(out)["events"]]
        assert actions[:3] == [
            (None, "fleet_triggered", "provider sim: by bob (unverified)"),
            (None, "fleet_resumed", f"provider sim: by {operator()} (unverified)"),
            (None, "fleet_paused", "provider sim: by alice (unverified): rack maintenance"),
        ]
        code, out, err = await shepherd_cli(env, "events", "--actions")
        assert out.splitlines()[2].split()[2:4] == ["(fleet)", "fleet_triggered"]
        code, out, err = await shepherd_cli(env, "events")
        assert code == 0 and out.splitlines()[0] == "the fleet's events"
        assert "reconcile_refused" in [line.split()[2] for line in out.splitlines()[2:]]
        assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize(
    "command, dead, setting",
    [
        (["machines"], "temporal", "temporal_address"),
        (["machines"], "bmdb", "database_url"),
        (["events", "node-0001"], "bmdb", "database_url"),
        (["status", "node-0001"], "temporal", "temporal_address"),
        (["status", "node-0001"], "bmdb", "database_url"),
        (["reset-host-key", "node-0001", "--reason", "y"], "temporal", "temporal_address"),
        (["reset-host-key", "node-0001", "--reason", "y"], "bmdb", "database_url"),
        (["fleet"], "temporal", "temporal_address"),
        (["recover", "machine-sim-node-0001", "--reason", "y"], "temporal", "temporal_address"),
        (["recover", "node-0001", "--reason", "y"], "bmdb", "database_url"),
    ],
)
async def test_unreachable_services_are_one_line_and_exit_1(
    command, dead, setting, tmp_path, temporal_env, shepherd_cli
):
    temporal = temporal_env.client.service_client.config.target_host
    env = {
        "SHEPHERD_TEMPORAL_ADDRESS": "127.0.0.1:1" if dead == "temporal" else temporal,
        "SHEPHERD_DATABASE_URL": f"postgresql://shepherd:pw@/bmdb?host={tmp_path}",
    }
    code, out, err = await shepherd_cli(env, *command)
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"shepherd {command[0]}: ") and setting in err and "pw@" not in err


def test_shepherd_machines_names_the_stuck_machines_below_the_table():
    now = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)

    def view(provider_id: str, stuck_since: datetime | None) -> MachineView:
        record = MachineRecord(
            uuid.uuid4(),
            "sim",
            provider_id,
            "provided",
            "10.0.0.1",
            22,
            None,
            None,
            None,
            None,
            None,
            stuck_since=stuck_since,
        )
        return MachineView(record, "AGENT_STARTING", 0)

    lines = format_machines([view("node-0001", now - timedelta(hours=4, minutes=12)), view("node-0002", None)], now)
    assert len(lines) == 4 and lines[1].split()[2] == "AGENT_STARTING"
    assert lines[-1] == "stuck past their stage's deadline: node-0001 (4h12m)"
    assert machine_json(view("node-0003", now))["stuck_since"] == now.isoformat()


async def test_releasing_the_held_recoveries_of_every_provider_instance_asks_first(tmp_path, shepherd_cli, monkeypatch):
    config = tmp_path / "shepherd.toml"
    rack = '[[providers]]\nname = "{}"\ntype = "sim"\napi_url = "http://127.0.0.1:9"\n'
    config.write_text(rack.format("rack1") + rack.format("rack2"))
    # Nothing answers there: a command that got past the question would fail to reach Temporal or BMDB.
    env = {
        "SHEPHERD_CONFIG": str(config),
        "SHEPHERD_STATE_DIR": str(tmp_path / "state"),
        "SHEPHERD_TEMPORAL_ADDRESS": "127.0.0.1:9",
        "SHEPHERD_DATABASE_URL": "postgresql://nobody@127.0.0.1:9/bmdb",
    }
    monkeypatch.setattr(sys, "stdin", io.StringIO("n\n"))
    code, out, err = await shepherd_cli(env, "fleet", "--release-recoveries", "--reason", "the switch is back")
    assert (code, err) == (1, "")
    assert out == (
        "release the held recoveries of all 2 provider instances (rack1, rack2)? [y/N] \n"
        "nothing done; name one with --provider, or give --yes\n"
    )
    with pytest.raises(SystemExit) as usage:
        await shepherd_cli(env, "fleet", "--trigger", "--yes")
    assert usage.value.code == 2
