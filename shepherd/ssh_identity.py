"""Shepherd's SSH identity: one ed25519 key, created owner-only when absent."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import asyncssh


class SSHIdentityError(Exception):
    """The SSH key file cannot be used; the message names the file and the fix."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"SSH key {path}: {problem}")
        self.path = path


def load_or_create_ssh_key(path: Path) -> asyncssh.SSHKey:
    """The ed25519 private key at path, generated and written 0600 if the file is absent."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return _create(path)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SSHIdentityError(
            path, f"is accessible by group or others (mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SSHIdentityError(path, f"cannot be read: {error.strerror}") from None
    try:
        key = asyncssh.import_private_key(data)
    except asyncssh.KeyImportError as error:
        raise SSHIdentityError(path, f"is not an unencrypted OpenSSH private key: {error}") from None
    if key.algorithm != b"ssh-ed25519":
        raise SSHIdentityError(path, f"is a {key.algorithm.decode()} key; Shepherd uses ed25519")
    return key


def _create(path: Path) -> asyncssh.SSHKey:
    key = asyncssh.generate_private_key("ssh-ed25519", comment="shepherd")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # O_EXCL with mode 0600: the key is never readable by others, not even briefly.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(key.export_private_key("openssh"))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return key


def public_key_openssh(key: asyncssh.SSHKey) -> str:
    """The public half in authorized_keys format: ``ssh-ed25519 AAAA... shepherd``."""
    return key.export_public_key("openssh").decode().strip()
