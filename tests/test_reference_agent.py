"""The reference agent as machines run it: a process reading stdin and answering on stdout."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from PyInstaller.archive.readers import CArchiveReader, ZlibArchiveReader

from agent import build, reference
from agent import heartbeat as heartbeat_module
from agent.build import build_agent_executable
from agent.keys import AgentKey
from agent.reference import HEARTBEATS_VARIABLE, KEY_FILE, LOG_FILE, NO_CA_WARNING, STATE_DIR_VARIABLE
from foundation.executables import executable_target
from proto import takeover_pb2

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def executable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_executable(tmp_path_factory.mktemp("build") / "agent")


def run(
    command: list[str], stdin: bytes, env: dict[str, str], cwd: Path | None = None
) -> takeover_pb2.TakeoverResponse:
    # Heartbeats off: these tests check the takeover answer alone.
    env = {**env, HEARTBEATS_VARIABLE: "off"}
    completed = subprocess.run(command, input=stdin, capture_output=True, timeout=60, env=env, cwd=cwd)
    assert completed.returncode == 0, completed.stderr.decode()
    return takeover_pb2.TakeoverResponse.FromString(completed.stdout)


def bare_env(**extra: str) -> dict[str, str]:
    # Nothing of Shepherd's on the path: the agent must bring what it needs.
    return {"PATH": "/usr/bin:/bin", **extra}


def assert_key_kept(key_file: Path, public_key: bytes) -> None:
    assert key_file.stat().st_mode & 0o777 == 0o600
    private = Ed25519PrivateKey.from_private_bytes(key_file.read_bytes())
    assert private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) == public_key


def test_executable_answers_with_the_echoed_init_and_keeps_its_key(executable, tmp_path):
    init = takeover_pb2.TakeoverInit(machine_id="m-1", endpoint="h:443", ca_certificate=b"\x30\x01")
    response = run([str(executable)], init.SerializeToString(), bare_env(**{STATE_DIR_VARIABLE: str(tmp_path)}))
    assert response.WhichOneof("result") == "success"
    assert response.success.init_message == init
    assert len(response.success.key) == 32
    assert list(response.success.warnings) == []
    assert_key_kept(tmp_path / KEY_FILE, response.success.key)


def test_key_is_kept_beside_the_executable_by_default(executable, tmp_path):
    copy = tmp_path / "agent"
    copy.write_bytes(executable.read_bytes())
    copy.chmod(0o755)
    init = takeover_pb2.TakeoverInit(machine_id="m-2", endpoint="h:443")
    response = run([str(copy)], init.SerializeToString(), bare_env(), cwd=Path("/"))
    assert list(response.success.warnings) == [NO_CA_WARNING]
    assert_key_kept(tmp_path / KEY_FILE, response.success.key)


def test_module_runs_as_a_program(tmp_path):
    init = takeover_pb2.TakeoverInit(machine_id="m-3", endpoint="h:443")
    env = {**os.environ, STATE_DIR_VARIABLE: str(tmp_path / "state")}
    response = run([sys.executable, "-m", "agent.reference"], init.SerializeToString(), env, cwd=REPO)
    assert response.success.init_message == init
    assert_key_kept(tmp_path / "state" / KEY_FILE, response.success.key)


@pytest.mark.parametrize("stdin", [b"\xff\xff\xff", b""], ids=["garbage", "empty"])
def test_unusable_input_is_answered_with_the_agents_own_error(executable, tmp_path, stdin):
    response = run([str(executable)], stdin, bare_env(**{STATE_DIR_VARIABLE: str(tmp_path)}))
    assert response.WhichOneof("result") == "error"
    assert "malformed TakeoverInit" in response.error.message
    assert not (tmp_path / KEY_FILE).exists()


def test_unwritable_state_dir_is_answered_with_an_error(executable, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    init = takeover_pb2.TakeoverInit(machine_id="m-4", endpoint="h:443")
    response = run([str(executable)], init.SerializeToString(), bare_env(**{STATE_DIR_VARIABLE: str(blocker)}))
    assert response.WhichOneof("result") == "error"
    assert "cannot store the agent key" in response.error.message


def test_build_is_reproducible_and_needs_no_python_on_the_machine(executable, tmp_path, monkeypatch):
    # A cache of its own: the bytes come from a build of their own, not from the fixture's.
    monkeypatch.setenv(build.CACHE_VARIABLE, str(tmp_path / "cache"))
    again = build_agent_executable(tmp_path / "again")
    assert again.read_bytes() == executable.read_bytes(), "the same inputs give the same executable"
    assert again.stat().st_mode & 0o777 == 0o755
    target = executable_target(again.read_bytes())
    assert (target.arch, target.libc) == (platform.machine(), "glibc")
    assert target.glibc is not None and target.glibc >= (2, 17)
    # Nothing of this host's Python on the path or in the environment, and a root without python3 anywhere.
    init = takeover_pb2.TakeoverInit(machine_id="m-6", endpoint="h:443")
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    response = run([str(again)], init.SerializeToString(), {"PATH": str(empty_path), STATE_DIR_VARIABLE: str(tmp_path)})
    assert response.success.init_message == init


def test_the_executable_packs_what_the_agent_imports_and_nothing_else_installed_beside_it(executable, tmp_path):
    # Whatever else shares Shepherd's environment (Ironic's test server brings numpy, yaml, psutil) stays out,
    # even where a packed library would import it if it were there (protobuf does numpy).
    archive = CArchiveReader(str(executable))
    native = {name.split("/")[0] for name in archive.toc if "/" in name}
    assert native <= {"google", "nacl", "python3.11"}, native
    modules = tmp_path / "PYZ.pyz"
    modules.write_bytes(archive.extract("PYZ.pyz"))
    packed = {name.split(".")[0] for name in ZlibArchiveReader(str(modules)).toc} - set(sys.stdlib_module_names)
    assert packed == {"agent", "proto", "google", "nacl", "h2", "hpack", "hyperframe", "typing_extensions"}, packed


def test_zipapp_escape_hatch_builds_a_script_for_the_named_interpreter(tmp_path):
    out = tmp_path / "out" / "agent"
    completed = subprocess.run(
        [sys.executable, "-m", "agent.build", str(out), "--zipapp-python", "/usr/bin/python3"],
        capture_output=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    assert completed.stdout.decode().strip() == str(out)
    assert out.read_bytes().startswith(b"#!/usr/bin/python3\n")
    with zipfile.ZipFile(out) as archive:
        names = set(archive.namelist())
    # The sources, and the pure-Python HTTP/2 libraries the interpreter then need not have.
    assert set(build.SOURCES) | {"__main__.py", "h2/connection.py", "hpack/hpack.py", "hyperframe/frame.py"} <= names
    assert {name.split("/")[0] for name in names} == {"agent", "proto", "h2", "hpack", "hyperframe", "__main__.py"}
    assert executable_target(out.read_bytes()).arch is None


def test_build_without_binutils_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.BuildError, match="needs objcopy"):
        build_agent_executable(tmp_path / "agent")
    assert not (tmp_path / "agent").exists()


def processes_with(variable: str, value: str) -> list[int]:
    """Pids of the processes whose environment sets variable to value."""
    marker = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_agent_built_without_heartbeats_answers_and_leaves_nothing_running(tmp_path):
    executable = tmp_path / "build" / "agent"
    subprocess.run(
        [sys.executable, "-m", "agent.build", str(executable), "--no-heartbeats"],
        capture_output=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    state = tmp_path / "state"
    init = takeover_pb2.TakeoverInit(machine_id="m-5", endpoint="127.0.0.1:1")
    # No HEARTBEATS_VARIABLE here: the build alone must switch the heartbeats off.
    completed = subprocess.run(
        [str(executable)],
        input=init.SerializeToString(),
        capture_output=True,
        timeout=60,
        env=bare_env(**{STATE_DIR_VARIABLE: str(state)}),
    )
    assert completed.returncode == 0, completed.stderr.decode()
    assert takeover_pb2.TakeoverResponse.FromString(completed.stdout).success.init_message == init
    # A detaching agent forks before it exits, so its daemon would exist by now.
    assert processes_with(STATE_DIR_VARIABLE, str(state)) == []
    assert not (state / LOG_FILE).exists()


def test_the_agent_heartbeats_with_the_key_it_answered_though_an_overlapping_takeover_replaced_it(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(STATE_DIR_VARIABLE, str(tmp_path))
    init = takeover_pb2.TakeoverInit(machine_id="7a6c1e9e-0000-4000-8000-000000000001", endpoint="127.0.0.1:1")
    response, key = reference.answer(init.SerializeToString())
    assert key is not None
    # A second takeover writes its own key before this agent's heartbeats begin.
    reference.write_private_key(tmp_path / KEY_FILE, AgentKey.generate())
    used: dict = {}

    class Recorded:
        def __init__(self, machine_id, key, endpoint, ca, *, stop_reason, **_):
            used.update(key=key, stop_reason=stop_reason)

        def run(self):
            return "recorded"

    monkeypatch.setattr(heartbeat_module, "HeartbeatLoop", Recorded)
    monkeypatch.setattr(reference.os, "_exit", lambda code: None)
    reference.heartbeat(response.success.init_message, key)
    assert used["key"].public == response.success.key, "heartbeats are signed with the key Shepherd was told"
    assert used["stop_reason"]() == "a newer agent has taken over this machine"


def test_the_agent_does_not_write_its_log_through_a_link_put_in_its_place(tmp_path, monkeypatch):
    monkeypatch.setenv(STATE_DIR_VARIABLE, str(tmp_path / "state"))
    init = takeover_pb2.TakeoverInit(machine_id="7a6c1e9e-0000-4000-8000-000000000002", endpoint="127.0.0.1:1")
    response, key = reference.answer(init.SerializeToString())
    assert key is not None
    # Someone who may write to the agent's directory points agent.log at a file only root should change.
    victim = tmp_path / "shadow"
    victim.write_text("root:*:19000:0:99999:7:::\n")
    (tmp_path / "state" / LOG_FILE).symlink_to(victim)

    class Stopped:
        def __init__(self, *_, log, **__):
            self.log = log

        def run(self):
            self.log("a line while heartbeating")
            return "stopped for the test"

    monkeypatch.setattr(heartbeat_module, "HeartbeatLoop", Stopped)
    monkeypatch.setattr(reference.os, "_exit", lambda code: None)
    reference.heartbeat(response.success.init_message, key)
    assert victim.read_text() == "root:*:19000:0:99999:7:::\n"
    assert (tmp_path / "state" / LOG_FILE).is_symlink()

    # A log file of its own is written as before.
    (tmp_path / "state" / LOG_FILE).unlink()
    reference.heartbeat(response.success.init_message, key)
    assert "a line while heartbeating" in (tmp_path / "state" / LOG_FILE).read_text()
