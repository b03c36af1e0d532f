"""The reference agent as the machines run it: the built executable, as a process."""

import subprocess

from agent.build import build_agent_executable
from proto import takeover_pb2


def run_agent(executable, stdin: bytes, state_dir) -> takeover_pb2.TakeoverResponse:
    completed = subprocess.run(
        [str(executable)],
        input=stdin,
        capture_output=True,
        check=True,
        timeout=30,
        env={"SHEPHERD_AGENT_STATE_DIR": str(state_dir), "PATH": "/usr/bin:/bin"},
    )
    return takeover_pb2.TakeoverResponse.FromString(completed.stdout)


def test_answers_with_the_echoed_init_and_keeps_its_key(tmp_path):
    agent = build_agent_executable(tmp_path / "agent")
    init = takeover_pb2.TakeoverInit(machine_id="m-1", endpoint="h:443", ca_certificate=b"\x30\x01")
    response = run_agent(agent, init.SerializeToString(), tmp_path)
    assert response.WhichOneof("result") == "success"
    assert response.success.init_message == init
    assert len(response.success.key) == 32
    assert list(response.success.warnings) == []
    key_file = tmp_path / "agent.key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_bytes()) == 32


def test_answers_malformed_input_with_its_own_error(tmp_path):
    response = run_agent(build_agent_executable(tmp_path / "agent"), b"\xff\xff\xff", tmp_path)
    assert response.WhichOneof("result") == "error"
    assert "malformed TakeoverInit" in response.error.message
    assert not (tmp_path / "agent.key").exists()


def test_build_is_deterministic(tmp_path):
    first = build_agent_executable(tmp_path / "a").read_bytes()
    second = build_agent_executable(tmp_path / "b").read_bytes()
    assert first == second
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o755
