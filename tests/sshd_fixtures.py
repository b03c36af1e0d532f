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
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

from tests.ports import free_port
from tests.processes import kill_processes_mentioning

SSHD = Path("/usr/sbin/sshd")
START_TIMEOUT = 10.0


@dataclass(frozen=True)
class Sshd:
    port: int
    host_key: str  # the server's host key, as an OpenSSH public key line
    client_key: asyncssh.SSHKey  # the only key it accepts
    username: str  # who the client logs in as: the user running the tests


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


@contextmanager
def running_sshd(
    directory: Path,
    extra_config: str = "",
    client_key: asyncssh.SSHKey | None = None,
    launcher: Sequence[str] = (),
) -> Iterator[Sshd]:
    """sshd as the current user on a free loopback port, configured in directory (plus extra_config), accepting
    only a client key of its own (or client_key, for machines that all let one Shepherd in); stopped, with every
    agent started through it, on leaving. launcher is the command sshd is started through (unshare, for one)."""
    if not SSHD.exists():
        pytest.skip(f"OpenSSH's sshd is not installed at {SSHD} (Debian package openssh-server)")
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = client_key or asyncssh.generate_private_key("ssh-ed25519")
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
{extra_config}"""
    )
    if os.geteuid() == 0:
        # Debian's sshd insists on its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log_path = directory / "sshd.log"
    with log_path.open("wb") as log:
        # -D: stay in the foreground, so terminate() stops it; -e: log to stderr, here the log file.
        process = subprocess.Popen([*launcher, str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
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


@pytest.fixture(scope="session", name="sshd")
def sshd_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    with running_sshd(tmp_path_factory.mktemp("sshd")) as sshd:
        yield sshd


# What every stock server has that the agent uses, as this host has them: the C library with its dynamic loader,
# and zlib, which PyInstaller's bootloader links before it can unpack anything (both are "required" in Debian and
# part of a minimal RHEL). The one-file agent brings every other library.
SYSTEM_LIBRARIES = (
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libutil.so.1", "libz.so.1",
)  # fmt: skip
BUSYBOX = Path("/bin/busybox")


@dataclass(frozen=True)
class BareMachine:
    """A machine with SSH and nothing else: sshd chrooted into a root of busybox, the C library and zlib."""

    sshd: Sshd
    # The machine's / on this host.
    root: Path


@pytest.fixture(scope="session", name="bare_machine")
def bare_machine_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BareMachine]:
    """sshd whose sessions are chrooted into a root that holds busybox (its shell and tools), glibc, zlib, /proc
    and the devices null, zero, random and urandom: no Python, no other library. Its logins land in /root; agents
    go to /root/agent."""
    with running_bare_machine(tmp_path_factory.mktemp("bare-sshd")) as machine:
        yield machine


@contextmanager
def running_bare_machine(directory: Path, client_key: asyncssh.SSHKey | None = None) -> Iterator[BareMachine]:
    """A bare machine, as the bare_machine fixture is, with its own root and its sshd configured in
    directory (its host key there, its pid in sshd.pid), on a port of its own; with client_key, several such
    machines let one Shepherd in. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("a chrooted sshd and its mounts need root")
    if not BUSYBOX.exists():
        pytest.skip(f"busybox is not installed at {BUSYBOX} (Debian package busybox-static)")
    # sshd chroots only into a directory whose every component is root's and writable by no one else: not /tmp.
    root = Path(tempfile.mkdtemp(prefix="shepherd-bare-machine-", dir="/run"))
    mounts: list[Path] = []
    try:
        _build_bare_root(root, mounts)
        with running_sshd(directory, f"ChrootDirectory {root}\n", client_key) as sshd:
            yield BareMachine(sshd=sshd, root=root)
    finally:
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _build_bare_root(root: Path, mounts: list[Path]) -> None:
    root.chmod(0o755)
    for directory in ("bin", "root", "tmp", "proc", "dev", "etc"):
        (root / directory).mkdir()
    (root / "tmp").chmod(0o1777)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if applet != "busybox" and "/" not in applet:
            (root / "bin" / applet).symlink_to("busybox")
    # sshd runs commands with the login shell /etc/passwd names (root's is /bin/bash): here it is busybox's sh.
    bash = root / "bin" / "bash"
    if not bash.exists():
        bash.write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
        bash.chmod(0o755)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    loader = Path(os.path.realpath("/lib64/ld-linux-x86-64.so.2")) if Path("/lib64").exists() else None
    libc = Path(os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6"))
    if loader is None or not libc.exists():
        pytest.skip("the bare machine copies this host's glibc from its x86_64 Debian paths")
    (root / "lib64").mkdir()
    shutil.copy2(loader, root / "lib64" / "ld-linux-x86-64.so.2")
    libs = root / "lib" / "x86_64-linux-gnu"
    libs.mkdir(parents=True)
    for name in SYSTEM_LIBRARIES:
        library = Path("/lib/x86_64-linux-gnu") / name
        if library.exists():
            shutil.copy2(os.path.realpath(library), libs / name)
    # The devices every Linux machine has that the agent opens: gRPC seeds its random numbers from /dev/urandom.
    devices = ("null", "zero", "random", "urandom")
    for device in devices:
        (root / "dev" / device).touch()
    mounts_wanted = [("proc", root / "proc", ["-t", "proc"])]
    mounts_wanted += [(f"/dev/{device}", root / "dev" / device, ["--bind"]) for device in devices]
    for source, target, options in mounts_wanted:
        subprocess.run(["mount", *options, source, str(target)], check=True, capture_output=True)
        mounts.append(target)
