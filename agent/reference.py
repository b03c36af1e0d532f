"""The reference takeover agent, run on a machine as the uploaded executable.

It reads one TakeoverInit on standard input (until end of file), answers one
TakeoverResponse on standard output and exits with status 0, also when the
input is unusable: the answer then carries the agent's own error message, so
Shepherd reports what the agent saw rather than a bare exit status.

It makes an ed25519 key for itself and keeps the private half, as the 32 raw
private-key bytes with mode 0600, in ``agent.key`` in the directory of the
executable, or in ``$SHEPHERD_AGENT_STATE_DIR`` if that is set. After a
successful answer it starts itself again as a daemon, in a session of its own
and holding none of the SSH session's descriptors, which sends heartbeats
signed with that key to the endpoint it was given (agent.heartbeat). A new
process rather than a fork: the one-file executable removes the files it
unpacked once its first process exits, and the daemon needs its own.

Run with ``--stop`` instead, it removes the key, and the running agent stops
before its next heartbeat: Shepherd's decommission does this over SSH.

Only protobuf, PyNaCl, h2 and the ``proto`` package are needed: the
agent modules are packed alone into the executable, with the interpreter and
those libraries (see agent.build).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from google.protobuf.message import DecodeError

from agent.keys import PRIVATE_KEY_SIZE, AgentKey
from proto import AGENT_STOP_ARGUMENT, AGENT_STOPPED, takeover_pb2

KEY_FILE = "agent.key"
LOG_FILE = "agent.log"
# "off" answers the takeover and exits, without heartbeats: for checking the protocol alone.
HEARTBEATS_VARIABLE = "SHEPHERD_AGENT_HEARTBEATS"
STATE_DIR_VARIABLE = "SHEPHERD_AGENT_STATE_DIR"
NO_CA_WARNING = "no CA certificate given; the system trust store will be used"
# The daemon's argument: it reads its private key (32 bytes) and then its TakeoverInit on standard input.
DAEMON_ARGUMENT = "--send-heartbeats"
# Tells a PyInstaller one-file executable started by another that it is a program of its own, which unpacks its
# own files, rather than the other's child (PyInstaller 6.9 and newer).
ONEFILE_RESET_VARIABLE = "PYINSTALLER_RESET_ENVIRONMENT"


def state_dir() -> Path:
    """Where the agent keeps its key: $SHEPHERD_AGENT_STATE_DIR, else beside the executable."""
    configured = os.environ.get(STATE_DIR_VARIABLE)
    return Path(configured) if configured else Path(sys.argv[0]).resolve().parent


def write_private_key(path: Path, key: AgentKey) -> None:
    """Write key's 32 raw private bytes to path, mode 0600, replacing any older key atomically."""
    raw = key.raw
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # Created 0600 from the start: the private key is never readable by others.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(raw)
            file.flush()
            # The public half is reported to Shepherd; the private half must outlive a crash.
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def error_response(message: str) -> takeover_pb2.TakeoverResponse:
    """A TakeoverResponse carrying the agent's error message."""
    return takeover_pb2.TakeoverResponse(error=takeover_pb2.TakeoverError(message=message))


def trusted_cas(init: takeover_pb2.TakeoverInit) -> list[bytes]:
    """The CA certificates (DER) a TakeoverInit says to trust: all of ca_certificates when it has any, else its
    ca_certificate, which is all a Shepherd that knew only that field sends; none for the system's trust store."""
    if init.ca_certificates:
        return list(init.ca_certificates)
    return [init.ca_certificate] if init.ca_certificate else []


def answer(init_bytes: bytes) -> tuple[takeover_pb2.TakeoverResponse, AgentKey | None]:
    """The response to the bytes read on standard input, and the key it made and stored (None on an error)."""
    init = takeover_pb2.TakeoverInit()
    try:
        init.ParseFromString(init_bytes)
    except DecodeError as error:
        return error_response(f"malformed TakeoverInit on stdin ({len(init_bytes)} bytes): {error}"), None
    if not init.machine_id:
        # Also what empty input parses to: Shepherd always sends a machine id.
        return error_response(f"malformed TakeoverInit on stdin ({len(init_bytes)} bytes): no machine_id"), None
    key = AgentKey.generate()
    key_path = state_dir() / KEY_FILE
    try:
        write_private_key(key_path, key)
    except OSError as error:
        return error_response(f"cannot store the agent key in {key_path}: {error.strerror or error}"), None
    warnings = []
    if not trusted_cas(init):
        warnings.append(NO_CA_WARNING)
    success = takeover_pb2.TakeoverSuccess(init_message=init, key=key.public, warnings=warnings)
    return takeover_pb2.TakeoverResponse(success=success), key


def stop() -> str:
    """Remove the agent's key, which the running agent checks before every heartbeat: it stops within one interval.

    The answer for Shepherd's decommission, which looks for AGENT_STOPPED at its start.
    """
    key_path = state_dir() / KEY_FILE
    try:
        key_path.unlink()
    except FileNotFoundError:
        return f"{AGENT_STOPPED} no agent key at {key_path}: no agent runs here"
    except OSError as error:
        return f"cannot remove the agent key {key_path}: {error.strerror or error}"
    return f"{AGENT_STOPPED} removed the agent key {key_path}; the agent stops before its next heartbeat"


def main() -> int:
    """The agent's entry point: stop the running agent, run as the heartbeat daemon, or answer one takeover."""
    if sys.argv[1:] == [AGENT_STOP_ARGUMENT]:
        print(stop())
        return 0
    if sys.argv[1:] == [DAEMON_ARGUMENT]:
        return run_daemon()
    init_bytes = sys.stdin.buffer.read()
    response, key = answer(init_bytes)
    sys.stdout.buffer.write(response.SerializeToString())
    sys.stdout.buffer.flush()
    if response.WhichOneof("result") == "success" and os.environ.get(HEARTBEATS_VARIABLE) != "off":
        assert key is not None
        start_daemon(response.success.init_message, key)
    return 0


def start_daemon(init: takeover_pb2.TakeoverInit, key: AgentKey) -> None:
    """Start this executable again as the heartbeat daemon, handing it key and init through a pipe.

    The key answered is the key used: read back from agent.key, it could already be an overlapping takeover's.
    """
    frozen = getattr(sys, "frozen", False)
    command = [sys.executable] if frozen else [sys.executable, os.path.abspath(sys.argv[0])]
    with open(os.devnull, "wb") as null:
        daemon = subprocess.Popen(
            [*command, DAEMON_ARGUMENT],
            stdin=subprocess.PIPE,
            stdout=null,
            stderr=null,
            # A session of its own: the end of the SSH session signals nothing to it.
            start_new_session=True,
            env={**os.environ, ONEFILE_RESET_VARIABLE: "1"},
            cwd="/",
        )
    assert daemon.stdin is not None
    daemon.stdin.write(key.raw + init.SerializeToString())
    daemon.stdin.close()


def run_daemon() -> int:
    """The heartbeat daemon: read the key and the init start_daemon hands over, then send heartbeats until told to
    stop."""
    handed = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if len(handed) <= PRIVATE_KEY_SIZE:
        return 2
    key = AgentKey.from_raw(handed[:PRIVATE_KEY_SIZE])
    init = takeover_pb2.TakeoverInit.FromString(handed[PRIVATE_KEY_SIZE:])
    heartbeat(init, key)
    return 0


def heartbeat(init: takeover_pb2.TakeoverInit, key: AgentKey) -> None:
    """Send heartbeats signed with key until the agent is replaced or stopped, logging to agent.log."""
    from agent.heartbeat import REFUSED_FOR_BEFORE_STOPPING, HeartbeatLoop

    directory = state_dir()
    key_path = directory / KEY_FILE
    own_key = key.raw
    log_path = directory / LOG_FILE

    def log(line: str) -> None:
        # Never through a symbolic link: in a directory others may write to, agent.log could be made to point at
        # any file root may write, and the agent would append to it.
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError:
            return  # a link in its place (ELOOP), or the directory gone: the heartbeats go on without the line
        with os.fdopen(fd, "a") as file:
            file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    log(f"agent for machine {init.machine_id} sending heartbeats to {init.endpoint}")

    def stop_reason() -> str | None:
        # Every takeover writes its own key: another one there means a newer agent runs; none, a decommission.
        try:
            if key_path.read_bytes() != own_key:
                return "a newer agent has taken over this machine"
        except FileNotFoundError:
            return f"its key {key_path} was removed: the machine is being decommissioned"
        except OSError:
            pass
        return None

    loop = HeartbeatLoop(
        init.machine_id,
        key,
        init.endpoint,
        trusted_cas(init),
        log=log,
        stop_reason=stop_reason,
        refused_for_before_stopping=init.refused_for_seconds_before_stopping or REFUSED_FOR_BEFORE_STOPPING,
    )
    try:
        log(f"stopped: {loop.run()}")
    except Exception as error:  # the daemon has no one else to tell
        log(f"stopped by an error: {error!r}")
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
