"""Hostile input at the boundaries: what a provider, a machine or a peer sends never reaches further than it may."""

from __future__ import annotations

import pytest

from foundation.files import replace_file
from foundation.settings import Settings
from lifecycle import takeover
from lifecycle.takeover import TakeoverError, TakeoverFailure, TakeoverSettings, TakeoverTarget, take_over
from providers import MachineNotFound
from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig
from tests.sshd_fixtures import sshd_fixture  # noqa: F401 (a pytest fixture, used as `sshd`)
from tests.test_decommission import simulator_key
from tests.test_fleet import sim_admin

HOSTILE_IDS = ["../admin/faults?", "..", "node-0001/../../admin/faults", "node-0001?x=1", "node-0001#", ""]


@pytest.mark.parametrize("provider_id", HOSTILE_IDS)
async def test_the_simulator_client_sends_no_request_for_an_id_of_another_form(tmp_path, provider_id):
    simulator = Simulator(SimulatorConfig(machines=2, state_dir=tmp_path / "sim", api_port=0))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    try:
        before = await sim_admin(simulator.api_url, "/admin/state")
        for call in (provider.get_machine, provider.reboot_machine, provider.retire_machine):
            with pytest.raises(MachineNotFound):
                await call(provider_id)
        after = await sim_admin(simulator.api_url, "/admin/state")
        assert after == before, "no fault knob, machine or slot changed"
    finally:
        await provider.close()
        await simulator.stop()


def test_a_replaced_file_gets_its_new_mode_and_a_link_in_its_place_is_replaced_not_followed(tmp_path):
    old = tmp_path / "server-key.pem"
    old.write_bytes(b"old")
    old.chmod(0o644)
    replace_file(old, b"new key", 0o600)
    assert old.read_bytes() == b"new key" and old.stat().st_mode & 0o777 == 0o600
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    link = tmp_path / "linked.pem"
    link.symlink_to(victim)
    replace_file(link, b"secret", 0o600)
    assert victim.read_bytes() == b"untouched" and not link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked.pem", "server-key.pem", "victim"]


async def test_the_simulators_state_with_the_machines_private_host_keys_is_for_its_user_alone(tmp_path):
    simulator = Simulator(SimulatorConfig(machines=1, state_dir=tmp_path / "sim", api_port=0))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    try:
        await provider.create_machine("node-0001", "key-1", simulator_key())
    finally:
        await provider.close()
        await simulator.stop()
    state = tmp_path / "sim" / "sim-state.json"
    assert "PRIVATE KEY" in state.read_text() and state.stat().st_mode & 0o777 == 0o600


async def test_the_upload_never_writes_through_a_link_planted_under_its_temporary_name(sshd, tmp_path, monkeypatch):
    monkeypatch.setattr(takeover.secrets, "token_hex", lambda n: "deadbeef")
    victim = tmp_path / "victim"
    (tmp_path / ".agent.deadbeef.upload").symlink_to(victim)
    target = TakeoverTarget(machine_id="m", address="127.0.0.1", port=sshd.port, username=sshd.username)
    settings = TakeoverSettings.of(
        Settings(agent_endpoint="127.0.0.1:1", agent_target_path=str(tmp_path / "agent")), b"#!/bin/sh\n"
    )
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, settings, sshd.client_key)
    assert caught.value.failure is TakeoverFailure.UPLOAD_FAILED
    assert not victim.exists() and not (tmp_path / "agent").exists()


async def test_a_first_contact_that_lost_the_race_to_another_host_key_sends_nothing(sshd, tmp_path):
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOther0000000000000000000000000000000000000"
    seen: list[str] = []

    async def pin(host_key: str) -> str | None:
        seen.append(host_key)
        return other

    target = TakeoverTarget(machine_id="m", address="127.0.0.1", port=sshd.port, username=sshd.username)
    settings = TakeoverSettings.of(
        Settings(agent_endpoint="127.0.0.1:1", agent_target_path=str(tmp_path / "agent")), b"#!/bin/sh\n"
    )
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, settings, sshd.client_key, pin)
    assert caught.value.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert "another takeover pinned host key" in str(caught.value)
    assert seen == [sshd.host_key] and list(tmp_path.iterdir()) == [], "nothing was uploaded"
