"""Hostile input at the boundaries: what a provider, a machine or a peer sends never reaches further than it may."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator

import aiohttp
import pytest

from foundation import ssh_sessions
from foundation.files import replace_file
from foundation.settings import Settings
from lifecycle.machine_text import MAX_TEXT, MAX_WARNINGS
from lifecycle.takeover import PinRefused, TakeoverSettings, take_over
from lifecycle.takeover_failures import TakeoverError, TakeoverFailure, TakeoverTarget
from proto import takeover_pb2
from providers import MachineNotFound
from providers.sim import SimProvider
from simulator import Simulator, SimulatorConfig
from simulator.__main__ import main as simulator_main
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
        with pytest.raises(MachineNotFound):
            await provider.reimage_machine(provider_id, simulator_key())
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
    # The snapshot, and the journal of the changes made since it.
    files = sorted((tmp_path / "sim").glob("sim-state.*"))
    assert "PRIVATE KEY" in "".join(path.read_text() for path in files)
    assert {path.name: path.stat().st_mode & 0o777 for path in files} == dict.fromkeys(
        ["sim-state.journal", "sim-state.json"], 0o600
    )


async def test_the_upload_never_writes_through_a_link_planted_under_its_temporary_name(sshd, tmp_path, monkeypatch):
    monkeypatch.setattr(ssh_sessions.secrets, "token_hex", lambda n: "deadbeef")
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

    async def pin(host_key: str) -> PinRefused | None:
        seen.append(host_key)
        return PinRefused(other_key=other)

    target = TakeoverTarget(machine_id="m", address="127.0.0.1", port=sshd.port, username=sshd.username)
    settings = TakeoverSettings.of(
        Settings(agent_endpoint="127.0.0.1:1", agent_target_path=str(tmp_path / "agent")), b"#!/bin/sh\n"
    )
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, settings, sshd.client_key, pin)
    assert caught.value.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert "another takeover pinned host key" in str(caught.value)
    assert seen == [sshd.host_key] and list(tmp_path.iterdir()) == [], "nothing was uploaded"


def _reply_script(reply: bytes) -> bytes:
    encoded = base64.b64encode(reply).decode()
    return f"#!/bin/sh\ncat > /dev/null\nprintf '%s' '{encoded}' | base64 -d\n".encode()


async def test_what_a_machine_says_is_cut_before_it_travels(sshd, tmp_path):
    target = TakeoverTarget(machine_id="m", address="127.0.0.1", port=sshd.port, username=sshd.username)

    def settings_for(agent: bytes) -> TakeoverSettings:
        return TakeoverSettings.of(
            Settings(agent_endpoint="127.0.0.1:1", agent_target_path=str(tmp_path / "agent")), agent
        )

    init = takeover_pb2.TakeoverInit(
        machine_id="m", endpoint="127.0.0.1:1", refused_for_seconds_before_stopping=round(Settings().heartbeat_timeout)
    )
    chatty = takeover_pb2.TakeoverResponse(
        success=takeover_pb2.TakeoverSuccess(init_message=init, key=b"k" * 32, warnings=["\x1b[31m" + "w" * 1000] * 40)
    )
    result = await take_over(target, settings_for(_reply_script(chatty.SerializeToString())), sshd.client_key)
    assert len(result.warnings) == MAX_WARNINGS + 1 and result.warnings[-1] == "and 30 more warnings"
    assert all(len(w) <= MAX_TEXT and w.isprintable() for w in result.warnings)

    angry = takeover_pb2.TakeoverResponse(error=takeover_pb2.TakeoverError(message="no\n" * 20000))
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, settings_for(_reply_script(angry.SerializeToString())), sshd.client_key)
    assert caught.value.failure is TakeoverFailure.AGENT_ERROR
    assert len(str(caught.value)) < 700 and "\n" not in str(caught.value)

    echo = takeover_pb2.TakeoverInit(machine_id="x" * 30000, endpoint="e\n" * 100)
    liar = takeover_pb2.TakeoverResponse(success=takeover_pb2.TakeoverSuccess(init_message=echo, key=b"k" * 32))
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, settings_for(_reply_script(liar.SerializeToString())), sshd.client_key)
    assert caught.value.failure is TakeoverFailure.INIT_NOT_ECHOED and len(str(caught.value)) < 500


async def test_the_simulator_answers_bad_bodies_and_unbounded_faults_with_400_and_changes_nothing(tmp_path):
    simulator = Simulator(SimulatorConfig(machines=2, state_dir=tmp_path / "sim", api_port=0))
    await simulator.start()
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/machines", "/admin/faults"):
                async with session.post(simulator.api_url + path, data=b"\xff\xfe{not utf-8") as response:
                    assert response.status == 400 and (await response.json())["error"], path
            for knob in ("api_latency", "exec_delay", "api_error_rate"):
                for value in ("NaN", "Infinity"):
                    body = f'{{"{knob}": {value}}}'.encode()
                    async with session.post(simulator.api_url + "/admin/faults", data=body) as response:
                        assert response.status == 400, (knob, value)
                        assert "must be a finite number" in (await response.json())["error"]
        state = await sim_admin(simulator.api_url, "/admin/state")
        assert state["faults"]["api_latency"] == 0.0 and state["faults"]["exec_delay"] == 0.0
        assert [m["id"] for m in (await sim_admin(simulator.api_url, "/v1/machines"))["machines"]] == [
            "node-0001",
            "node-0002",
        ]
    finally:
        await simulator.stop()


@pytest.mark.usefixtures("logging_restored")
@pytest.mark.parametrize("flag", ["--api-latency", "--exec-delay", "--api-error-rate"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_simulator_command_refuses_unbounded_faults(tmp_path, flag, value, capsys):
    with pytest.raises(SystemExit) as usage:
        simulator_main(["--machines", "1", "--state-dir", str(tmp_path), flag, value])
    assert usage.value.code == 2 and "must be a finite number" in capsys.readouterr().err


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """The simulator's main sets up logging on this test's stderr; later tests must not write to it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("logging_restored")
@pytest.mark.parametrize(
    "saved",
    [b"{not json", b"\xff\xfe", b'{"machines": {"node-0001": {"machine_id": 1}}}', b'["a list"]'],
)
def test_a_corrupt_simulator_state_stops_it_with_one_line(tmp_path, capsys, saved):
    (tmp_path / "sim-state.json").write_bytes(saved)
    code = simulator_main(["--machines", "1", "--state-dir", str(tmp_path), "--api-port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"shepherd sim: cannot start: the simulator's state {tmp_path / 'sim-state.json'}")
    assert err.endswith("move it away to start afresh")
