"""A reboot done whose answer never came back (the worker died with the provider's call under way) is not done again:
the retry reads the provider's record of resets first. On the real simulator and BMDB; at the end a worker process
killed at that moment."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncssh
import pytest
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.deps import ActivityDeps
from activities.recovery import RecoveryActivities
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.ssh_identity import public_key_openssh
from lifecycle.contracts import FORCE_RECOVER_SIGNAL, MachineStage, RebootInput, RebootResult
from providers import ProviderProtocolError, ProviderUnavailable
from providers.sim import SimProvider, parse_last_reset
from simulator import Simulator, SimulatorConfig
from tests.fleet_stack import fleet_stack, shepherd_environment
from tests.test_fleet import sim_admin

NODE = "node-0001"


@dataclasses.dataclass
class SimMachine:
    simulator: Simulator
    provider: SimProvider
    machine_id: uuid.UUID
    recovery: RecoveryActivities

    async def reboots(self) -> dict[str, int]:
        return dict((await sim_admin(self.simulator.api_url, "/admin/state"))["reboots"])


@pytest.fixture
async def machine(tmp_path: Path, bmdb: BMDB, temporal_client: Client) -> AsyncIterator[SimMachine]:
    simulator = Simulator(SimulatorConfig(machines=1, state_dir=tmp_path / "sim", api_port=0, boot_seconds=0.2))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    key = asyncssh.generate_private_key("ssh-ed25519")
    try:
        await provider.create_machine(NODE, "key-1", public_key_openssh(key))
        machine_id, _ = await bmdb.admit_machine("sim", NODE)
        deps = ActivityDeps(
            settings=Settings(boot_deadline=60.0),
            bmdb=bmdb,
            providers={"sim": provider},
            client=temporal_client,
            ssh_key=key,
            ssh_public_key=public_key_openssh(key),
        )
        yield SimMachine(simulator, provider, machine_id, RecoveryActivities(deps))
    finally:
        await provider.close()
        await simulator.stop()


async def reboot(machine: SimMachine, cycle: str = "cycle-1") -> RebootResult:
    environment = ActivityEnvironment()
    environment.info = dataclasses.replace(
        environment.info, started_time=datetime.now(UTC), start_to_close_timeout=timedelta(seconds=60)
    )
    request = RebootInput("sim", NODE, str(machine.machine_id), "agent silent", cycle=cycle)
    return await environment.run(machine.recovery.reboot_through_provider, request)


async def test_a_reboot_done_but_never_answered_is_not_done_again(machine, bmdb):
    # The attempt before noted its ask, and the simulator rebooted the machine; the answer never reached it.
    await bmdb.ask_reboot(machine.machine_id, "cycle-1", datetime.now(UTC))
    await machine.provider.reboot_machine(NODE)
    result = await reboot(machine)
    assert result.went_down
    assert "by an attempt that died unanswered was done: provider sim's record: reset at" in result.detail
    assert await machine.reboots() == {NODE: 1}


async def test_a_reboot_asked_but_never_done_is_asked_again(machine, bmdb):
    # The attempt before died between its note and the call: the machine runs on from before.
    await machine.provider.reboot_machine(NODE)
    await bmdb.ask_reboot(machine.machine_id, "cycle-1", datetime.now(UTC) + timedelta(seconds=30))
    result = await reboot(machine)
    assert result.detail == "the simulator took SSH down for the boot"
    assert await machine.reboots() == {NODE: 2}


async def test_the_first_ask_reboots_and_a_provider_error_lets_the_retry_ask_afresh(machine, bmdb):
    await sim_admin(machine.simulator.api_url, "/admin/faults", {"api_error_rate": 1.0})
    with pytest.raises(ProviderUnavailable):
        await reboot(machine)
    # The provider answered, with an error: the next attempt asks as for the first time, without waiting.
    await sim_admin(machine.simulator.api_url, "/admin/faults", {"api_error_rate": 0.0})
    result = await reboot(machine)
    assert result.detail == "the simulator took SSH down for the boot"
    assert await machine.reboots() == {NODE: 1}
    # Once the reboot is recorded, its ask goes with it: another cycle asks afresh.
    assert await bmdb.record_reboot(machine.machine_id, "cycle-1", "rebooted: agent silent")
    assert await bmdb.ask_reboot(machine.machine_id, "cycle-1", datetime.now(UTC)) is None


async def test_a_worker_killed_with_the_reboot_done_and_unanswered_does_not_reboot_twice(
    tmp_path, temporal_client, bmdb_url, bmdb
):
    # The simulator power-cycles the machine at once and answers only a minute later: the worker dies in between.
    async with fleet_stack(
        tmp_path,
        temporal_client,
        bmdb_url,
        machines=1,
        run_worker=False,
        sim_boot_seconds=0.5,
        reboot_timeout=1.0,
        provider_timeout=120.0,
    ) as stack:
        log = (tmp_path / "worker.log").open("ab")

        def start_worker() -> subprocess.Popen[bytes]:
            environment = {**os.environ, **shepherd_environment(stack.settings, bmdb_url)}
            command = [sys.executable, "-m", "shepherd", "worker"]
            return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=log)

        first = start_worker()
        second = None
        try:
            await stack.run_pass()
            await stack.wait_for_stage([NODE], MachineStage.WATCHING)
            await sim_admin(stack, "/admin/faults", {"reboot_answer_delay": 60.0})
            await stack.machine(NODE).signal(FORCE_RECOVER_SIGNAL, {"reason": "lost answer", "by": "tester"})
            for _ in range(300):
                if (await sim_admin(stack, "/admin/state"))["reboots"].get(NODE):
                    break
                await asyncio.sleep(0.1)
            first.send_signal(signal.SIGKILL)
            first.wait()
            await sim_admin(stack, "/admin/faults", {"reboot_answer_delay": 0.0})

            # The attempt times out (reboot_timeout + 30 s) and the retry runs on a worker started afresh.
            second = start_worker()

            async def recovered() -> bool:
                status = await stack.status(NODE)
                return status.recovery_count == 1 and status.stage is MachineStage.WATCHING

            for _ in range(600):
                if await recovered():
                    break
                await asyncio.sleep(0.2)
            assert await recovered(), (tmp_path / "worker.log").read_text()[-3000:]
            assert (await sim_admin(stack, "/admin/state"))["reboots"] == {NODE: 1}
            records = await bmdb.list_machines()
            kinds = [event.kind for event in await bmdb.list_events(records[0].machine_id)]
            assert kinds.count("rebooted") == 1
        finally:
            for worker in (first, second):
                if worker is not None and worker.poll() is None:
                    worker.send_signal(signal.SIGTERM)
                    worker.wait(30)
            log.close()


MACHINE = {"id": NODE, "availability": "KnownUsed", "address": "127.0.0.1", "ssh_port": 2222, "status": "active"}


def test_the_simulators_reset_time_is_read_or_refused_naming_the_field():
    assert parse_last_reset({**MACHINE, "last_reset_at": None}, "get machine") is None
    at = parse_last_reset({**MACHINE, "last_reset_at": "2026-11-28T10:00:00+00:00"}, "get machine")
    assert at == datetime(2026, 11, 28, 10, tzinfo=UTC)
    for bad in ("2026-11-28T10:00:00", "yesterday", 1764324000, ["2026-11-28T10:00:00+00:00"], "\x1b[31m" * 50):
        with pytest.raises(ProviderProtocolError, match="field 'last_reset_at' must be an ISO 8601 time") as refused:
            parse_last_reset({**MACHINE, "last_reset_at": bad}, "get machine")
        assert len(str(refused.value)) < 300
    with pytest.raises(ProviderProtocolError, match="field 'id'"):
        parse_last_reset({**MACHINE, "id": 7, "last_reset_at": None}, "get machine")
