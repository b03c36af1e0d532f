"""take_over against OpenSSH's sshd (the reference agent, bad agents, SSH failures) and the simulator's machines.

Bad agents are small shell scripts uploaded as the agent executable; sshd
really runs them, and their replies are protobuf bytes made here and embedded
in base64.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import platform
import shlex
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncssh
import pytest
from temporalio.testing import ActivityEnvironment

from activities.deps import heartbeating
from activities.takeover import bmdb_pin, takeover_failed
from agent.build import build_agent_executable
from agent.reference import KEY_FILE, LOG_FILE, NO_CA_WARNING
from foundation.executables import executable_target
from foundation.settings import Settings
from foundation.ssh_sessions import host_key_fingerprint, ssh_answers
from lifecycle.takeover import TakeoverSettings, stop_agent, take_over, wait_until_booted
from lifecycle.takeover_failures import MAX_REPLY_SIZE, TakeoverError, TakeoverFailure, TakeoverTarget
from proto import takeover_pb2
from providers.sim import SimProvider
from simulator import Faults, Simulator, SimulatorConfig
from tests.sshd_fixtures import Sshd, bare_machine_fixture, sshd_fixture  # noqa: F401 (pytest fixtures)

MACHINE_ID = "7a6c1e9e-0000-4000-8000-000000000001"
ENDPOINT = "127.0.0.1:8900"


@pytest.fixture(scope="module")
def reference_agent(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_agent_executable(tmp_path_factory.mktemp("agent") / "agent").read_bytes()


def target_of(sshd: Sshd, **overrides: object) -> TakeoverTarget:
    values: dict[str, object] = {
        "machine_id": MACHINE_ID,
        "address": "127.0.0.1",
        "port": sshd.port,
        "username": sshd.username,
    }
    values.update(overrides)
    return TakeoverTarget(**values)  # type: ignore[arg-type]


def settings(agent: bytes, target_path: Path, **overrides: object) -> TakeoverSettings:
    shepherd = Settings(agent_endpoint=ENDPOINT, agent_target_path=str(target_path), ssh_exec_timeout=20.0)
    return replace(TakeoverSettings.of(shepherd, agent), **overrides)  # type: ignore[arg-type]


def script_agent(body: str) -> bytes:
    return f"#!/bin/sh\n{body}\n".encode()


def agent_printing(reply: bytes, exit_status: int = 0, stderr: str = "") -> bytes:
    """A shell-script agent that reads all of its stdin and answers with fixed bytes."""
    encoded = base64.b64encode(reply).decode()
    return script_agent(
        f"cat > /dev/null\nprintf '%s' '{encoded}' | base64 -d\nprintf '%s\\n' {shlex.quote(stderr)} >&2\n"
        f"exit {exit_status}"
    )


def init_message() -> takeover_pb2.TakeoverInit:
    """The TakeoverInit settings() sends: an agent that answers must echo it whole."""
    return takeover_pb2.TakeoverInit(
        machine_id=MACHINE_ID,
        endpoint=ENDPOINT,
        refused_for_seconds_before_stopping=round(Settings().heartbeat_timeout),
    )


def success_reply(init: takeover_pb2.TakeoverInit, key: bytes = b"k" * 32) -> bytes:
    response = takeover_pb2.TakeoverResponse(success=takeover_pb2.TakeoverSuccess(init_message=init, key=key))
    return response.SerializeToString()


async def expect_failure(target: TakeoverTarget, takeover: TakeoverSettings, key: asyncssh.SSHKey) -> TakeoverError:
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, takeover, key)
    error = caught.value
    assert error.machine_id == MACHINE_ID and error.address == target.address
    assert f"machine {MACHINE_ID} at {target.address}:{target.port}" in str(error)
    return error


# --- the reference agent ------------------------------------------------------------


async def test_reference_agent_is_taken_over(sshd, reference_agent, tmp_path):
    agent_path = tmp_path / "agent"
    result = await take_over(target_of(sshd), settings(reference_agent, agent_path), sshd.client_key)
    assert len(result.agent_public_key) == 32
    assert result.host_key == sshd.host_key
    assert result.warnings == [NO_CA_WARNING]
    assert agent_path.read_bytes() == reference_agent
    assert agent_path.stat().st_mode & 0o777 == 0o755
    key_file = tmp_path / KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    # The stored private key belongs to the public key the agent reported.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    private = Ed25519PrivateKey.from_private_bytes(key_file.read_bytes())
    assert private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) == result.agent_public_key
    # Only the agent is left behind: the temporary upload was renamed over it.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOG_FILE) == sorted(["agent", KEY_FILE])


async def test_a_second_takeover_replaces_the_agent_and_gets_a_new_key(sshd, reference_agent, tmp_path):
    agent_path = tmp_path / "agent"
    agent_path.write_bytes(b"#!/bin/sh\nexit 9\n")
    agent_path.chmod(0o755)
    first = await take_over(target_of(sshd), settings(reference_agent, agent_path), sshd.client_key)
    again = await take_over(target_of(sshd), settings(reference_agent, agent_path), sshd.client_key)
    assert again.agent_public_key != first.agent_public_key
    assert again.host_key == first.host_key


async def test_the_agent_is_stopped_over_ssh_and_a_second_stop_finds_none(sshd, reference_agent, tmp_path):
    agent_path = tmp_path / "agent"
    takeover = settings(reference_agent, agent_path)
    await take_over(target_of(sshd), takeover, sshd.client_key)
    answer = await stop_agent(target_of(sshd, pinned_host_key=sshd.host_key), takeover, sshd.client_key)
    assert answer.startswith(f"stopped: removed the agent key {tmp_path / KEY_FILE}")
    assert not (tmp_path / KEY_FILE).exists()
    again = await stop_agent(target_of(sshd), takeover, sshd.client_key)
    assert again.startswith("stopped: no agent key") and again.endswith("no agent runs here")


async def test_a_stop_that_is_not_confirmed_or_not_allowed_is_an_error_that_says_so(sshd, reference_agent, tmp_path):
    agent_path = tmp_path / "agent"
    # An agent that knows no --stop reads its empty stdin and answers a takeover error.
    agent_path.write_bytes(agent_printing(b"\x12\x02\x0a\x00"))
    agent_path.chmod(0o755)
    with pytest.raises(TakeoverError) as caught:
        await stop_agent(target_of(sshd), settings(reference_agent, agent_path), sshd.client_key)
    assert caught.value.failure is TakeoverFailure.EXEC_FAILED
    assert "--stop did not confirm the stop (exit status 0" in str(caught.value)
    with pytest.raises(TakeoverError) as caught:
        await stop_agent(target_of(sshd), settings(reference_agent, tmp_path / "none"), sshd.client_key)
    assert "exit status 127" in str(caught.value)
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    with pytest.raises(TakeoverError) as caught:
        await stop_agent(target_of(sshd, pinned_host_key=other), settings(reference_agent, agent_path), sshd.client_key)
    assert caught.value.failure is TakeoverFailure.HOST_KEY_CHANGED


async def test_ca_certificate_reaches_the_agent(sshd, reference_agent, tmp_path):
    takeover = settings(reference_agent, tmp_path / "agent", ca_certificates=(b"\x30\x03\x02\x01\x00",))
    result = await take_over(target_of(sshd), takeover, sshd.client_key)
    assert result.warnings == []


# --- bad agents ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "failure", "words"),
    [
        pytest.param(
            agent_printing(b"not a protobuf at all \xff\xff"),
            TakeoverFailure.BAD_REPLY,
            "no TakeoverResponse",
            id="garbage",
        ),
        pytest.param(agent_printing(b""), TakeoverFailure.BAD_REPLY, "wrote nothing", id="silence"),
        pytest.param(
            # Field 3 is unknown to TakeoverResponse: it parses, with no result set.
            agent_printing(b"\x18\x01"),
            TakeoverFailure.BAD_REPLY,
            "has no result",
            id="no result",
        ),
        pytest.param(
            script_agent(f"cat > /dev/null\nhead -c {MAX_REPLY_SIZE + 1} /dev/zero"),
            TakeoverFailure.BAD_REPLY,
            f"more than {MAX_REPLY_SIZE} bytes",
            id="endless reply",
        ),
        pytest.param(
            agent_printing(
                takeover_pb2.TakeoverResponse(
                    error=takeover_pb2.TakeoverError(message="disk on fire")
                ).SerializeToString()
            ),
            TakeoverFailure.AGENT_ERROR,
            "the agent reported: disk on fire",
            id="agent error",
        ),
        pytest.param(
            agent_printing(success_reply(takeover_pb2.TakeoverInit(machine_id="someone-else", endpoint=ENDPOINT))),
            TakeoverFailure.INIT_NOT_ECHOED,
            "'someone-else'",
            id="init not echoed",
        ),
        pytest.param(
            agent_printing(success_reply(init_message(), b"k" * 31)),
            TakeoverFailure.BAD_KEY,
            "31 bytes",
            id="short key",
        ),
        pytest.param(
            agent_printing(b"", exit_status=3, stderr="cannot mount /proc"),
            TakeoverFailure.EXEC_FAILED,
            "exited with status 3; stderr: cannot mount /proc",
            id="exit 3",
        ),
        pytest.param(
            # A good reply does not save an agent that fails.
            agent_printing(success_reply(init_message()), exit_status=1, stderr="late trouble"),
            TakeoverFailure.EXEC_FAILED,
            "exited with status 1; stderr: late trouble",
            id="reply then exit 1",
        ),
        pytest.param(
            script_agent("cat > /dev/null\necho 'out of memory' >&2\nkill -KILL $$"),
            TakeoverFailure.EXEC_FAILED,
            "killed by signal KILL; stderr: out of memory",
            id="killed",
        ),
    ],
)
async def test_bad_agents_are_named(sshd, tmp_path, agent, failure, words):
    error = await expect_failure(target_of(sshd), settings(agent, tmp_path / "agent"), sshd.client_key)
    assert error.failure is failure
    assert words in str(error)
    assert error.retryable


async def test_agent_that_never_answers_times_out(sshd, tmp_path):
    # It never finishes, but dies of SIGPIPE once nobody reads its output any
    # more: OpenSSH does not pass on our kill for root's sessions, and a plain
    # sleep would outlive the test.
    agent = script_agent("cat > /dev/null\nwhile printf ' '; do sleep 0.1; done")
    error = await expect_failure(
        target_of(sshd), settings(agent, tmp_path / "agent", exec_timeout=1.0), sshd.client_key
    )
    assert error.failure is TakeoverFailure.EXEC_TIMEOUT
    assert "while running the agent" in str(error)
    assert error.retryable


async def test_agent_stderr_is_reported_on_success(sshd, tmp_path):
    agent = agent_printing(success_reply(init_message()), stderr="using eth1")
    result = await take_over(target_of(sshd), settings(agent, tmp_path / "agent"), sshd.client_key)
    assert result.stderr == "using eth1"
    assert result.agent_public_key == b"k" * 32


async def test_upload_to_a_missing_directory_fails_clearly_before_anything_is_uploaded(sshd, reference_agent, tmp_path):
    agent_path = tmp_path / "no" / "such" / "dir" / "agent"
    error = await expect_failure(target_of(sshd), settings(reference_agent, agent_path), sshd.client_key)
    assert error.failure is TakeoverFailure.TARGET_UNUSABLE
    assert f"the directory {agent_path.parent} of the agent's target path does not exist" in str(error)


# --- SSH ------------------------------------------------------------------------------


async def test_closed_port_is_refused(sshd, reference_agent, tmp_path):
    target = target_of(sshd, port=closed_port())
    error = await expect_failure(target, settings(reference_agent, tmp_path / "agent"), sshd.client_key)
    assert error.failure is TakeoverFailure.CONNECT_REFUSED
    assert error.retryable


async def test_ssh_answers_tells_a_booted_machine_from_one_that_is_down(sshd):
    assert await ssh_answers("127.0.0.1", sshd.port, 2.0)
    assert not await ssh_answers("127.0.0.1", closed_port(), 2.0)

    async def not_ssh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    for handler in (not_ssh, silent):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            assert not await ssh_answers("127.0.0.1", port, 0.5), handler.__name__


async def ssh_banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-booted\r\n")
    await writer.drain()
    writer.close()


async def test_a_reboot_not_seen_by_the_provider_counts_once_ssh_went_away_and_answers_again():
    port = closed_port()
    server = await asyncio.start_server(ssh_banner, "127.0.0.1", port)
    seen: list[bool] = []

    async def reboot() -> None:
        await asyncio.sleep(0.3)
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.3)
        await asyncio.start_server(ssh_banner, "127.0.0.1", port)

    until = datetime.now(UTC) + timedelta(seconds=20)
    rebooting = asyncio.create_task(reboot())
    result = await wait_until_booted(
        "127.0.0.1", port, seen_down=False, until=until, probe_within=1.0, poll=0.05, progress=seen.append
    )
    await rebooting
    assert result == (True, True)
    assert seen[0] is False and seen[-1] is True, "the old boot answered first, then SSH went away"


async def test_the_boot_wait_ends_at_its_deadline():
    async def wait(port: int, seen_down: bool, seconds: float) -> tuple[bool, bool]:
        until = datetime.now(UTC) + timedelta(seconds=seconds)
        return await wait_until_booted("127.0.0.1", port, seen_down=seen_down, until=until, probe_within=0.2, poll=0.05)

    assert await wait(closed_port(), True, 0.3) == (False, True), "down and never back"
    server = await asyncio.start_server(ssh_banner, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        assert await wait(port, False, 0.3) == (False, False), "never seen down: that is the boot before the reboot"
        assert await wait(port, True, 5.0) == (True, True)


async def test_wrong_client_key_is_rejected(sshd, reference_agent, tmp_path):
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    error = await expect_failure(target_of(sshd), settings(reference_agent, tmp_path / "agent"), stranger)
    assert error.failure is TakeoverFailure.AUTH_REJECTED
    assert sshd.username in str(error)
    assert not (tmp_path / "agent").exists()


async def test_changed_host_key_is_refused_before_upload(sshd, reference_agent, tmp_path):
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    error = await expect_failure(
        target_of(sshd, pinned_host_key=other), settings(reference_agent, tmp_path / "agent"), sshd.client_key
    )
    assert error.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert "pinned" in str(error)
    assert not error.retryable
    assert list(tmp_path.iterdir()) == []


async def test_pin_of_a_key_type_the_server_no_longer_has_is_a_changed_host_key(sshd, reference_agent, tmp_path):
    other = asyncssh.generate_private_key("ecdsa-sha2-nistp256").export_public_key("openssh").decode().strip()
    error = await expect_failure(
        target_of(sshd, pinned_host_key=other), settings(reference_agent, tmp_path / "agent"), sshd.client_key
    )
    assert error.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert list(tmp_path.iterdir()) == []


async def test_unreadable_pin_is_refused_before_connecting(sshd, reference_agent, tmp_path):
    target = target_of(sshd, pinned_host_key="ssh-ed25519 not-base64")
    error = await expect_failure(target, settings(reference_agent, tmp_path / "agent"), sshd.client_key)
    assert error.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert list(tmp_path.iterdir()) == []


async def test_pinned_host_key_that_matches_is_accepted(sshd, reference_agent, tmp_path):
    target = target_of(sshd, pinned_host_key=sshd.host_key)
    result = await take_over(target, settings(reference_agent, tmp_path / "agent"), sshd.client_key)
    assert result.host_key == sshd.host_key
    assert len(result.agent_public_key) == 32


async def test_after_a_reset_naming_a_fingerprint_only_a_key_with_it_is_pinned(sshd, reference_agent, tmp_path, bmdb):
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    target, pin = target_of(sshd, machine_id=str(machine_id)), bmdb_pin(bmdb, machine_id)
    takeover = settings(reference_agent, tmp_path / "agent")
    shown = host_key_fingerprint(sshd.host_key)
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode()
    expected = host_key_fingerprint(other)
    assert await bmdb.reset_host_key(machine_id, None, "reinstalled", expected=expected)

    with pytest.raises(TakeoverError) as caught:
        await take_over(target, takeover, sshd.client_key, pin)
    assert caught.value.failure is TakeoverFailure.HOST_KEY_CHANGED and not caught.value.retryable
    assert caught.value.problem.startswith(
        f"the SSH host key is {shown}, the operator who reset its pin expects {expected}; nothing was pinned. "
    )
    assert "`shepherd reset-host-key --expect-fingerprint` again" in caught.value.problem
    assert list(tmp_path.iterdir()) == [], "nothing was uploaded"
    assert (await bmdb.get_machine(machine_id)).ssh_host_key is None

    assert await bmdb.reset_host_key(machine_id, None, "the fingerprint on the console", expected=shown)
    result = await take_over(target, takeover, sshd.client_key, pin)
    assert result.host_key == sshd.host_key
    record = await bmdb.get_machine(machine_id)
    assert (record.ssh_host_key, record.expected_host_key_fingerprint) == (sshd.host_key, None)


async def test_server_that_never_sends_its_banner_times_out(sshd, reference_agent, tmp_path):
    with socket.socket() as listener:
        # The kernel completes the TCP handshake; nobody ever speaks SSH.
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = target_of(sshd, port=listener.getsockname()[1])
        takeover = settings(reference_agent, tmp_path / "agent", connect_timeout=0.5)
        error = await expect_failure(target, takeover, sshd.client_key)
    assert error.failure is TakeoverFailure.CONNECT_TIMEOUT
    assert error.retryable


# --- the simulator's machines ---------------------------------------------------------


@pytest.fixture
async def simulated_machine(tmp_path: Path) -> AsyncIterator[tuple[TakeoverTarget, asyncssh.SSHKey, Path]]:
    """One simulated machine with its own SSH server: the target, the key it accepts, its root file system."""
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    simulator = Simulator(SimulatorConfig(machines=1, state_dir=tmp_path / "sim", api_port=0, faults=Faults()))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    try:
        created = await provider.create_machine("node-0001", "test", client_key.export_public_key("openssh").decode())
        assert created.address is not None
        target = TakeoverTarget(machine_id=MACHINE_ID, address=created.address, port=created.ssh_port, username="root")
        yield target, client_key, tmp_path / "sim" / "machines" / "node-0001" / "root-fs"
    finally:
        await provider.close()
        await simulator.stop()


async def test_simulated_machine_is_taken_over_at_the_default_path(simulated_machine, reference_agent):
    target, client_key, root_fs = simulated_machine
    takeover = TakeoverSettings.of(Settings(agent_endpoint=ENDPOINT), reference_agent)
    result = await take_over(target, takeover, client_key)
    assert len(result.agent_public_key) == 32
    assert (root_fs / "root" / "agent").stat().st_mode & 0o777 == 0o755
    assert (root_fs / "root" / KEY_FILE).stat().st_mode & 0o777 == 0o600
    pinned = await take_over(replace(target, pinned_host_key=result.host_key), takeover, client_key)
    assert pinned.agent_public_key != result.agent_public_key


async def test_simulated_machine_with_another_host_key_is_refused(simulated_machine, reference_agent):
    target, client_key, root_fs = simulated_machine
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    takeover = TakeoverSettings.of(Settings(agent_endpoint=ENDPOINT), reference_agent)
    error = await expect_failure(replace(target, pinned_host_key=other), takeover, client_key)
    assert error.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert not (root_fs / "root" / "agent").exists()


# --- errors ---------------------------------------------------------------------------


def test_errors_survive_pickling():
    import pickle

    target = TakeoverTarget(machine_id=MACHINE_ID, address="::1", port=2222, username="root")
    error = TakeoverError(TakeoverFailure.BAD_KEY, target, "the agent's key is 31 bytes long")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.failure is TakeoverFailure.BAD_KEY
    assert "at [::1]:2222" in str(error)


def test_only_host_key_changes_need_an_operator():
    assert [f for f in TakeoverFailure if not f.retryable] == [TakeoverFailure.HOST_KEY_CHANGED]


def test_the_agent_is_an_executable_of_this_architecture(reference_agent):
    target = executable_target(reference_agent)
    assert (target.arch, target.libc) == (platform.machine(), "glibc")
    assert target.unpacked_kib is not None and target.unpacked_kib * 1024 > len(reference_agent)


# --- a machine with SSH and nothing else -------------------------------------------


async def test_a_machine_without_python_is_taken_over_and_its_agent_stopped(bare_machine, reference_agent):
    sshd, root = bare_machine.sshd, bare_machine.root
    files = [path for top in ("bin", "lib", "lib64", "root", "tmp", "etc") for path in (root / top).rglob("*")]
    assert files and not [path for path in files if "python" in path.name], "the bare machine has no Python"
    takeover = TakeoverSettings.of(Settings(agent_endpoint=ENDPOINT, ssh_exec_timeout=30.0), reference_agent)
    result = await take_over(target_of(sshd), takeover, sshd.client_key)
    assert len(result.agent_public_key) == 32
    assert result.machine.startswith(f"{platform.machine()} with glibc ")
    assert result.agent_sha256 == hashlib.sha256(reference_agent).hexdigest()
    assert (root / "root" / "agent").read_bytes() == reference_agent
    assert (root / "root" / KEY_FILE).stat().st_mode & 0o777 == 0o600
    answer = await stop_agent(target_of(sshd), takeover, sshd.client_key)
    assert answer.startswith("stopped:") and not (root / "root" / KEY_FILE).exists()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_connect_timeout_is_tried_again_within_the_step_and_other_failures_wait_for_its_back_off(sshd):
    target = target_of(sshd)
    timed_out = takeover_failed(TakeoverError(TakeoverFailure.CONNECT_TIMEOUT, target, "no SSH session within 2s"))
    assert not timed_out.non_retryable and timed_out.type == "CONNECT_TIMEOUT"
    assert str(timed_out).endswith("failed: no SSH session within 2s")
    for failure in set(TakeoverFailure) - {TakeoverFailure.CONNECT_TIMEOUT}:
        assert takeover_failed(TakeoverError(failure, target, "it failed")).non_retryable, failure


async def test_the_ssh_work_heartbeats_while_it_runs_not_at_once_and_not_after():
    beats: list[tuple[object, ...]] = []
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *details: beats.append(details)
    seen: dict[str, int] = {}

    async def work() -> None:
        async with heartbeating(0.05):
            await asyncio.sleep(0.01)
            seen["at once"] = len(beats)
            await asyncio.sleep(0.4)
            seen["while"] = len(beats)

    await environment.run(work)
    seen["after"] = len(beats)
    await asyncio.sleep(0.1)
    assert seen["at once"] == 0 and seen["while"] > 2
    assert len(beats) == seen["after"], "no heartbeat once the work is over"
