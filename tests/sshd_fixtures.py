"""OpenSSH's sshd as a real takeover peer: the interop check for asyncssh."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

SSHD = Path("/usr/sbin/sshd")


@dataclass(frozen=True)
class Sshd:
    port: int
    host_key: str  # OpenSSH public key
    home: Path  # a directory the agent is uploaded into


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_private(path: Path, key: asyncssh.SSHKey) -> None:
    path.write_bytes(key.export_private_key("openssh"))
    path.chmod(0o600)


def start_sshd(directory: Path, client_key: asyncssh.SSHKey) -> Iterator[Sshd]:
    """Run sshd on a free loopback port, accepting only client_key, until the generator closes."""
    if not SSHD.exists():
        pytest.skip("OpenSSH sshd is not installed (Debian package openssh-server)")
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    write_private(directory / "host_key", host_key)
    (directory / "authorized_keys").write_bytes(client_key.export_public_key("openssh"))
    home = directory / "home"
    home.mkdir()
    port = free_port()
    config = directory / "sshd_config"
    config.write_text(
        f"""ListenAddress 127.0.0.1
Port {port}
HostKey {directory / "host_key"}
AuthorizedKeysFile {directory / "authorized_keys"}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
StrictModes no
UsePAM no
PidFile {directory / "sshd.pid"}
Subsystem sftp internal-sftp
"""
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    log = (directory / "sshd.log").open("wb")
    process = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start: {(directory / 'sshd.log').read_text()}") from None
                time.sleep(0.05)
        yield Sshd(port=port, host_key=host_key.export_public_key("openssh").decode().strip(), home=home)
    finally:
        process.terminate()
        process.wait(10)
        log.close()
