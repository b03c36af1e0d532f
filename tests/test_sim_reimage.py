"""The simulator's reimage through SimProvider: a reboot onto a fresh disk, with a new host key and the key given,
seen over real SSH; kept across a restart of the simulator; a repeat under way starts no second one; and what it
refuses."""

from __future__ import annotations

import json
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncssh
import pytest
from temporalio.common import MetricMeter

from foundation.metrics import meter_of, metrics_runtime
from foundation.ssh_sessions import ssh_answers
from providers import MachineNotFound, ProviderProtocolError, ProviderUnavailable, Reimaged, Reimager
from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig
from tests.ports import free_port
from tests.test_fleet import sim_admin
from tests.test_observability import scrape, total
from tests.test_recovery import wait_for

SLOT = "node-0001"
# Short, so that a reimaged machine is soon up again; the tests wait for it, never for a time.
BOOT_SECONDS = 0.2
# Long enough that a machine reimaged in a test is still booting when the test ends.
NEVER_UP = 600.0


@dataclass
class Fleet:
    """A simulator of two slots, started in this process, and its provider client."""

    simulator: Simulator
    provider: SimProvider
    state_dir: Path

    @property
    def machine_port(self) -> int:
        """Where the machine of SLOT answers SSH."""
        return self.simulator.machines[SLOT].ssh_port

    def disk(self) -> Path:
        """The machine's root file system, on this host."""
        return self.simulator.machines[SLOT].root_fs


async def started(state_dir: Path, boot_seconds: float, meter: MetricMeter = MetricMeter.noop) -> Fleet:
    """A simulator on state_dir, its machines booting in boot_seconds, and its client."""
    config = SimulatorConfig(machines=2, state_dir=state_dir, api_port=0, boot_seconds=boot_seconds)
    simulator = Simulator(config, meter)
    await simulator.start()
    return Fleet(simulator, SimProvider(simulator.api_url), state_dir)


async def stopped(fleet: Fleet) -> None:
    """The client closed and the simulator stopped, its machines shut down."""
    await fleet.provider.close()
    await fleet.simulator.stop()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    fleet = await started(tmp_path / "sim", BOOT_SECONDS)
    try:
        yield fleet
    finally:
        await stopped(fleet)


@pytest.fixture
async def booting_for_ever(tmp_path: Path) -> AsyncIterator[tuple[Fleet, int]]:
    """A simulator whose reimaged or rebooted machines stay down while the test runs, and the port of its /metrics."""
    metrics_port = free_port()
    # Held while the test runs: the runtime serves /metrics until it is collected.
    runtime = metrics_runtime(f"127.0.0.1:{metrics_port}", "simulator")
    fleet = await started(tmp_path / "sim", NEVER_UP, meter_of(runtime))
    try:
        yield fleet, metrics_port
    finally:
        await stopped(fleet)


def client_key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


def openssh(key: asyncssh.SSHKey) -> str:
    """The public half of key as an OpenSSH line, as Shepherd hands it to a provider."""
    return key.export_public_key("openssh").decode()


async def host_key_at(port: int) -> bytes:
    """The public host key the SSH server at port presents, as SSH clients see it."""
    key = await asyncssh.get_server_host_key("127.0.0.1", port)
    assert key is not None
    return key.export_public_key("openssh").split()[1]


def recorded_host_key(fleet: Fleet) -> bytes:
    """The public half of the host key the simulator's state holds for the machine."""
    private = asyncssh.import_private_key(fleet.simulator.state.machines[SLOT].host_key)
    return private.export_public_key("openssh").split()[1]


async def login(port: int, key: asyncssh.SSHKey) -> asyncssh.SSHClientConnection:
    """root's SSH connection to the machine at port, logged in with key."""
    return await asyncssh.connect(
        "127.0.0.1", port, username="root", client_keys=[key], known_hosts=None, agent_path=None
    )


async def start_detached(port: int, key: asyncssh.SSHKey, path: str) -> int:
    """The pid of the machine's executable at path, started to outlive its SSH session as a detached agent does."""
    script = '"$1" </dev/null >/dev/null 2>&1 & echo $!'
    async with await login(port, key) as conn:
        result = await conn.run(shlex.join(["sh", "-c", script, "sh", path]), check=True)
    return int(str(result.stdout).strip())


def running(pid: int) -> bool:
    """Whether pid is a process that runs still: not gone, and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


async def booted(fleet: Fleet) -> None:
    """Return once the machine is active again and its SSH answers."""

    async def up() -> bool:
        machine = await fleet.provider.get_machine(SLOT)
        return machine.status == "active" and await ssh_answers("127.0.0.1", machine.ssh_port, 1.0)

    await wait_for(up, what=f"{SLOT} booted")


async def test_a_reimage_gives_a_fresh_disk_a_new_host_key_and_the_key_given(fleet):
    old_key, new_key = client_key(), client_key()
    await fleet.provider.create_machine(SLOT, "key-1", openssh(old_key))
    old_host_key = await host_key_at(fleet.machine_port)
    async with await login(fleet.machine_port, old_key) as conn, conn.start_sftp_client() as sftp:
        async with sftp.open("/root/agent", "wb") as agent:
            await agent.write(b"#!/bin/sh\nexec sleep 600\n")
        await sftp.chmod("/root/agent", 0o755)
    agent_pid = await start_detached(fleet.machine_port, old_key, "/root/agent")
    assert running(agent_pid) and (fleet.disk() / "root" / "agent").exists()

    assert isinstance(fleet.provider, Reimager)
    reimaged = await fleet.provider.reimage_machine(SLOT, openssh(new_key))
    assert isinstance(reimaged, Reimaged) and "new host key" in reimaged.detail

    async def agent_killed() -> bool:
        return not running(agent_pid)

    await wait_for(agent_killed, what=f"the agent, pid {agent_pid}, killed")
    await booted(fleet)
    new_host_key = await host_key_at(fleet.machine_port)
    assert new_host_key != old_host_key and new_host_key == recorded_host_key(fleet)
    with pytest.raises(asyncssh.PermissionDenied):
        await login(fleet.machine_port, old_key)
    async with await login(fleet.machine_port, new_key) as conn, conn.start_sftp_client() as sftp:
        assert not await sftp.exists("/root/agent"), "the uploaded agent went with the old disk"
    assert list(fleet.disk().iterdir()) == [fleet.disk() / "root"]
    assert list((fleet.disk() / "root").iterdir()) == []
    state = await sim_admin(fleet.simulator.api_url, "/admin/state")
    assert (state["creations"], state["reimages"]) == ({SLOT: 1}, {SLOT: 1})

    # Reimaged again with the same key: another host key, and the key still lets root in.
    await fleet.provider.reimage_machine(SLOT, openssh(new_key))
    await booted(fleet)
    third_host_key = await host_key_at(fleet.machine_port)
    assert third_host_key not in (old_host_key, new_host_key)
    async with await login(fleet.machine_port, new_key):
        pass
    assert fleet.simulator.state.reimages == {SLOT: 2}

    # Started again on its state: the machine keeps the keys of its last reimage.
    await stopped(fleet)
    again = await started(fleet.state_dir, BOOT_SECONDS)
    try:
        assert await host_key_at(again.machine_port) == third_host_key
        async with await login(again.machine_port, new_key):
            pass
        with pytest.raises(asyncssh.PermissionDenied):
            await login(again.machine_port, old_key)
        assert again.simulator.state.reimages == {SLOT: 2}
    finally:
        await stopped(again)


async def test_the_answer_comes_with_ssh_down_and_a_repeat_under_way_starts_no_second_reimage(booting_for_ever):
    fleet, metrics_port = booting_for_ever
    key = client_key()
    await fleet.provider.create_machine(SLOT, "key-1", openssh(key))
    await fleet.provider.reimage_machine(SLOT, openssh(key))
    port = fleet.machine_port
    assert (await fleet.provider.get_machine(SLOT)).status == "reimaging"
    assert not await ssh_answers("127.0.0.1", port, 1.0)
    host_key = recorded_host_key(fleet)
    (fleet.disk() / "root" / "written-while-booting").write_bytes(b"kept")

    await fleet.provider.reimage_machine(SLOT, openssh(key))
    assert recorded_host_key(fleet) == host_key and fleet.simulator.state.reimages == {SLOT: 1}
    assert (fleet.disk() / "root" / "written-while-booting").exists(), "no second wipe"
    series = await scrape(metrics_port)
    assert total(series, "shepherd_sim_reimages_total") == 1
    assert total(series, "shepherd_sim_machines", status="reimaging") == 1

    with pytest.raises(ProviderProtocolError) as caught:
        await fleet.provider.reimage_machine(SLOT, openssh(client_key()))
    assert f"answer 409: machine {SLOT} is being reimaged with another key" in str(caught.value)
    assert recorded_host_key(fleet) == host_key and fleet.simulator.state.reimages == {SLOT: 1}


async def test_refused_ssh_stays_refused_after_the_boot_and_comes_back_with_the_new_host_key(fleet):
    key = client_key()
    await fleet.provider.create_machine(SLOT, "key-1", openssh(key))
    old_host_key = await host_key_at(fleet.machine_port)
    await fleet.simulator.apply_faults({"ssh_refuse": [SLOT]})
    await fleet.provider.reimage_machine(SLOT, openssh(key))

    async def active() -> bool:
        return (await fleet.provider.get_machine(SLOT)).status == "active"

    await wait_for(active, what=f"{SLOT} booted")
    assert not await ssh_answers("127.0.0.1", fleet.machine_port, 1.0), "SSH refused, as the fault says"
    await fleet.simulator.apply_faults({"ssh_refuse": []})
    new_host_key = await host_key_at(fleet.machine_port)
    assert new_host_key != old_host_key and new_host_key == recorded_host_key(fleet)


async def test_unknown_machines_bad_keys_and_outages_are_refused_and_change_nothing(fleet):
    key = client_key()
    await fleet.provider.create_machine(SLOT, "key-1", openssh(key))
    host_key = await host_key_at(fleet.machine_port)
    (fleet.disk() / "root" / "agent").write_bytes(b"kept")
    private = client_key()

    for unknown in ("node-0002", "node-9999"):  # capacity, and no slot at all
        with pytest.raises(MachineNotFound):
            await fleet.provider.reimage_machine(unknown, openssh(key))

    bad_bodies: list[tuple[object, str]] = [
        (b"\xff\xfe{not utf-8", "the body is not JSON"),
        ([openssh(key)], "the body must be a JSON object"),
        ({}, "field ssh_public_key must be a non-empty string"),
        ({"ssh_public_key": ""}, "field ssh_public_key must be a non-empty string"),
        ({"ssh_public_key": 7}, "field ssh_public_key must be a non-empty string"),
        ({"ssh_public_key": "ssh-ed25519 !!!"}, "field ssh_public_key is not an OpenSSH public key"),
        ({"ssh_public_key": key.export_public_key("pkcs8-pem").decode()}, "must be one OpenSSH public key line"),
        ({"ssh_public_key": private.export_private_key("openssh").decode()}, "must be one OpenSSH public key line"),
        ({"ssh_public_key": openssh(key) + openssh(private)}, "must be one OpenSSH public key line"),
    ]
    async with aiohttp.ClientSession() as session:
        for body, problem in bad_bodies:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(f"{fleet.simulator.api_url}/v1/machines/{SLOT}/reimage", data=raw) as response:
                assert response.status == 400, body
                assert problem in (await response.json())["error"], body
        # The key check is the creation's too: a key that would lock root out makes no machine either.
        pem = {"capacity_id": "node-0002", "idempotency_key": "key-2"}
        pem["ssh_public_key"] = key.export_public_key("pkcs8-pem").decode()
        async with session.post(f"{fleet.simulator.api_url}/v1/machines", json=pem) as response:
            assert response.status == 400
            assert "must be one OpenSSH public key line" in (await response.json())["error"]
    with pytest.raises(ProviderProtocolError) as caught:
        await fleet.provider.reimage_machine(SLOT, "not a key")
    assert f"reimage machine {SLOT}" in str(caught.value) and "answer 400: field ssh_public_key" in str(caught.value)

    await fleet.simulator.apply_faults({"api_error_rate": 1.0})
    with pytest.raises(ProviderUnavailable) as outage:
        await fleet.provider.reimage_machine(SLOT, openssh(private))
    assert "simulated provider outage" in str(outage.value)
    await fleet.simulator.apply_faults({"api_error_rate": 0.0})

    assert (await fleet.provider.get_machine(SLOT)).status == "active"
    assert await host_key_at(fleet.machine_port) == host_key
    assert (fleet.disk() / "root" / "agent").read_bytes() == b"kept"
    async with await login(fleet.machine_port, key):
        pass
    state = await sim_admin(fleet.simulator.api_url, "/admin/state")
    assert (state["machines"], state["reimages"]) == ([SLOT], {})
