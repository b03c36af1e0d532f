"""OpenSSH's sshd as a real takeover peer, the way machines run it.

Import the fixture into a test module to use it:
``from tests.sshd_fixtures import sshd_fixture  # noqa: F401``; tests then take
an ``sshd`` argument. sshd is started once per session, as the current user,
on a free loopback port, with a host key of its own, accepting only the
session's client key.
"""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

from tests.processes import kill_processes_mentioning

SSHD = Path("/usr/sbin/sshd")
START_TIMEOUT = 10.0


@dataclass(frozen=True)
class Sshd:
    port: int
    host_key: str  # the server's host key, as an OpenSSH public key line
    client_key: asyncssh.SSHKey  # the only key it accepts
    username: str  # who the client logs in as: the user running the tests


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_private_key(path: Path, key: asyncssh.SSHKey) -> None:
    # sshd refuses host keys others can read; create the file 0600 from the start.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(key.export_private_key("openssh"))


def wait_until_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start listening on port {port}: {log.read_text()}") from None
            time.sleep(0.05)


@pytest.fixture(scope="session", name="sshd")
def sshd_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if not SSHD.exists():
        pytest.skip(f"OpenSSH's sshd is not installed at {SSHD} (Debian package openssh-server)")
    directory = tmp_path_factory.mktemp("sshd")
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    write_private_key(directory / "host_key", host_key)
    (directory / "authorized_keys").write_bytes(client_key.export_public_key("openssh"))
    port = free_port()
    config = directory / "sshd_config"
    config.write_text(
        f"""ListenAddress 127.0.0.1
Port {port}
HostKey {directory / "host_key"}
AuthorizedKeysFile {directory / "authorized_keys"}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PidFile {directory / "sshd.pid"}
Subsystem sftp internal-sftp
"""
    )
    if os.geteuid() == 0:
        # Debian's sshd insists on its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log_path = directory / "sshd.log"
    with log_path.open("wb") as log:
        # -D: stay in the foreground, so terminate() stops it; -e: log to stderr, here the log file.
        process = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
    try:
        wait_until_listening(process, port, log_path)
        yield Sshd(
            port=port,
            host_key=host_key.export_public_key("openssh").decode().strip(),
            client_key=client_key,
            username=getpass.getuser(),
        )
    finally:
        process.terminate()
        process.wait(10)
        # Agents detach and keep sending heartbeats; their SSH_CONNECTION names this server's port.
        kill_processes_mentioning(f" 127.0.0.1 {port}\0")
