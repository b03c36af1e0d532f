"""take_over over real SSH: the simulator's machines, and OpenSSH's sshd for interop.

Bad agents are small scripts uploaded as the agent executable; the SSH server
really runs them.
"""

from __future__ import annotations

import base64
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncssh
import pytest

from agent.build import build_agent_executable
from agent.takeover import TakeoverError, TakeoverFailure, TakeoverSettings, TakeoverTarget, take_over
from proto import takeover_pb2
from providers.sim import SimProvider
from simulator import Faults, Simulator, SimulatorConfig
from tests.sshd_fixtures import Sshd, start_sshd

MACHINE_ID = "7a6c1e9e-0000-4000-8000-000000000001"
ENDPOINT = "127.0.0.1:8900"


@pytest.fixture(scope="module")
def client_key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


@pytest.fixture(scope="module")
def reference_agent(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_agent_executable(tmp_path_factory.mktemp("agent") / "agent.pyz").read_bytes()


@pytest.fixture
async def machine(tmp_path: Path, client_key: asyncssh.SSHKey) -> AsyncIterator[tuple[Simulator, TakeoverTarget]]:
    """One simulated machine created with client_key, and the target to reach it."""
    simulator = Simulator(SimulatorConfig(machines=1, state_dir=tmp_path / "sim", api_port=0, faults=Faults()))
    await simulator.start()
    provider = SimProvider(simulator.api_url)
    try:
        created = await provider.create_machine("node-0001", "test", client_key.export_public_key("openssh").decode())
        assert created.address is not None
        yield simulator, TakeoverTarget(machine_id=MACHINE_ID, address=created.address, port=created.ssh_port)
    finally:
        await provider.close()
        await simulator.stop()


def settings(agent: bytes, **overrides: object) -> TakeoverSettings:
    values: dict[str, object] = {"agent_executable": agent, "endpoint": ENDPOINT, "exec_timeout": 10.0}
    values.update(overrides)
    return TakeoverSettings(**values)  # type: ignore[arg-type]


def agent_printing(reply: bytes, exit_status: int = 0, stderr: str = "") -> bytes:
    """A shell-script agent that reads its stdin and answers with fixed bytes."""
    encoded = base64.b64encode(reply).decode()
    return (
        f"#!/bin/sh\ncat > /dev/null\nprintf '%s' '{encoded}' | base64 -d\n"
        f"printf '%s' '{stderr}' >&2\nexit {exit_status}\n"
    ).encode()


def init_message() -> takeover_pb2.TakeoverInit:
    return takeover_pb2.TakeoverInit(machine_id=MACHINE_ID, endpoint=ENDPOINT)


def success(init: takeover_pb2.TakeoverInit, key: bytes = b"k" * 32) -> bytes:
    return takeover_pb2.TakeoverResponse(
        success=takeover_pb2.TakeoverSuccess(init_message=init, key=key)
    ).SerializeToString()


async def expect_failure(target: TakeoverTarget, takeover: TakeoverSettings, key: asyncssh.SSHKey) -> TakeoverError:
    with pytest.raises(TakeoverError) as caught:
        await take_over(target, takeover, key)
    assert MACHINE_ID in str(caught.value) and target.address in str(caught.value)
    return caught.value


async def test_reference_agent_is_taken_over(machine, client_key, reference_agent, tmp_path):
    _, target = machine
    result = await take_over(target, settings(reference_agent), client_key)
    assert len(result.agent_public_key) == 32
    assert result.host_key.startswith("ssh-ed25519 ")
    assert result.warnings == ["no CA certificate given; the system trust store will be used"]
    root = tmp_path / "sim" / "machines" / "node-0001" / "root-fs" / "root"
    assert (root / "agent").stat().st_mode & 0o777 == 0o755
    assert (root / "agent.key").stat().st_mode & 0o777 == 0o600
    # A second takeover replaces the agent and gets a new key.
    again = await take_over(target, settings(reference_agent), client_key)
    assert again.agent_public_key != result.agent_public_key
    assert again.host_key == result.host_key


@pytest.mark.parametrize(
    ("agent", "failure", "words"),
    [
        pytest.param(
            agent_printing(b"not a protobuf at all \xff\xff"),
            TakeoverFailure.BAD_REPLY,
            "no TakeoverResponse",
            id="garbage",
        ),
        pytest.param(agent_printing(b""), TakeoverFailure.BAD_REPLY, "nothing", id="silence"),
        pytest.param(
            # Field 3 is unknown to TakeoverResponse: it parses, with no result set.
            agent_printing(b"\x18\x01"),
            TakeoverFailure.BAD_REPLY,
            "has no result",
            id="response without result",
        ),
        pytest.param(
            agent_printing(
                takeover_pb2.TakeoverResponse(
                    error=takeover_pb2.TakeoverError(message="disk on fire")
                ).SerializeToString()
            ),
            TakeoverFailure.AGENT_ERROR,
            "disk on fire",
            id="agent error",
        ),
        pytest.param(
            agent_printing(success(takeover_pb2.TakeoverInit(machine_id="someone-else", endpoint=ENDPOINT))),
            TakeoverFailure.INIT_NOT_ECHOED,
            "init message",
            id="init not echoed",
        ),
        pytest.param(
            agent_printing(success(init_message(), b"k" * 31)), TakeoverFailure.BAD_KEY, "31 bytes", id="short key"
        ),
        pytest.param(
            agent_printing(b"", exit_status=3, stderr="cannot mount /proc"),
            TakeoverFailure.EXEC_FAILED,
            "status 3; stderr: cannot mount /proc",
            id="non-zero exit",
        ),
    ],
)
async def test_bad_agent_replies_are_named(machine, client_key, agent, failure, words):
    _, target = machine
    error = await expect_failure(target, settings(agent), client_key)
    assert error.failure is failure
    assert words in str(error)
    assert error.retryable


async def test_agent_that_never_answers_times_out(machine, client_key):
    _, target = machine
    error = await expect_failure(target, settings(b"#!/bin/sh\nexec sleep 60\n", exec_timeout=1.0), client_key)
    assert error.failure is TakeoverFailure.EXEC_TIMEOUT
    assert "running the agent" in str(error)


async def test_wrong_key_is_rejected(machine, reference_agent):
    _, target = machine
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    error = await expect_failure(target, settings(reference_agent), stranger)
    assert error.failure is TakeoverFailure.AUTH_REJECTED


async def test_refused_connection(client_key, reference_agent):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = TakeoverTarget(machine_id=MACHINE_ID, address="127.0.0.1", port=port)
    error = await expect_failure(target, settings(reference_agent), client_key)
    assert error.failure is TakeoverFailure.CONNECT_REFUSED


async def test_silent_server_times_out_connecting(client_key, reference_agent):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = TakeoverTarget(machine_id=MACHINE_ID, address="127.0.0.1", port=listener.getsockname()[1])
        error = await expect_failure(target, settings(reference_agent, connect_timeout=0.5), client_key)
    assert error.failure is TakeoverFailure.CONNECT_TIMEOUT


async def test_changed_host_key_is_refused_before_upload(machine, client_key, reference_agent, tmp_path):
    _, target = machine
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    pinned = TakeoverTarget(machine_id=MACHINE_ID, address=target.address, port=target.port, pinned_host_key=other)
    error = await expect_failure(pinned, settings(reference_agent), client_key)
    assert error.failure is TakeoverFailure.HOST_KEY_CHANGED
    assert not error.retryable
    assert not (tmp_path / "sim" / "machines" / "node-0001" / "root-fs" / "root" / "agent").exists()


async def test_pinned_host_key_that_matches_is_accepted(machine, client_key, reference_agent):
    _, target = machine
    first = await take_over(target, settings(reference_agent), client_key)
    pinned = TakeoverTarget(
        machine_id=MACHINE_ID, address=target.address, port=target.port, pinned_host_key=first.host_key
    )
    assert len((await take_over(pinned, settings(reference_agent), client_key)).agent_public_key) == 32


async def test_upload_to_a_missing_directory_fails_clearly(machine, client_key, reference_agent):
    _, target = machine
    error = await expect_failure(target, settings(reference_agent, target_path="/no/such/dir/agent"), client_key)
    assert error.failure is TakeoverFailure.UPLOAD_FAILED
    assert "/no/such/dir/agent" in str(error)


# --- OpenSSH interop --------------------------------------------------------------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory, client_key: asyncssh.SSHKey) -> Iterator[Sshd]:
    yield from start_sshd(tmp_path_factory.mktemp("sshd"), client_key)


async def test_openssh_server_runs_the_reference_agent(sshd, client_key, reference_agent):
    target = TakeoverTarget(machine_id=MACHINE_ID, address="127.0.0.1", port=sshd.port)
    agent_path = sshd.home / "agent"
    result = await take_over(target, settings(reference_agent, target_path=str(agent_path)), client_key)
    assert len(result.agent_public_key) == 32
    assert result.host_key == sshd.host_key
    assert agent_path.stat().st_mode & 0o777 == 0o755
    assert (sshd.home / "agent.key").stat().st_mode & 0o777 == 0o600


async def test_openssh_server_with_a_failing_agent(sshd, client_key):
    target = TakeoverTarget(machine_id=MACHINE_ID, address="127.0.0.1", port=sshd.port, pinned_host_key=sshd.host_key)
    agent = agent_printing(b"", exit_status=7, stderr="no network")
    error = await expect_failure(target, settings(agent, target_path=str(sshd.home / "bad-agent")), client_key)
    assert error.failure is TakeoverFailure.EXEC_FAILED
    assert "status 7" in str(error) and "no network" in str(error)


async def test_openssh_server_rejects_a_stranger(sshd, reference_agent):
    target = TakeoverTarget(machine_id=MACHINE_ID, address="127.0.0.1", port=sshd.port)
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    error = await expect_failure(target, settings(reference_agent, target_path=str(sshd.home / "a")), stranger)
    assert error.failure is TakeoverFailure.AUTH_REJECTED


def test_python_is_the_agents_interpreter(reference_agent):
    assert reference_agent.startswith(f"#!{sys.executable}\n".encode())
