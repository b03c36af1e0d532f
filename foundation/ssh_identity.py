"""Shepherd's SSH identity: one ed25519 key, created owner-only when absent.

Shepherd logs in to every machine it takes over with this key, so the file is
treated like any SSH private key: it must not be readable by anyone but its
owner, and it is never left half-written.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import asyncssh

KEY_ALGORITHM = b"ssh-ed25519"
KEY_COMMENT = "shepherd"


class SSHIdentityError(Exception):
    """The SSH key file cannot be used; the message names the file, the problem and the fix."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"SSH key {path}: {problem}")
        self.path = path


def load_or_create_ssh_key(path: Path) -> asyncssh.SSHKey:
    """The ed25519 private key at path; generated and written with mode 0600 if the file is absent.

    Two processes starting at once with no key both generate one, but only
    the first to finish installs it; the other loads and returns that one, so
    every process ends up with the key that is on disk.
    """
    try:
        return load_ssh_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = asyncssh.generate_private_key(KEY_ALGORITHM.decode(), comment=KEY_COMMENT)
    if _install_new(path, key.export_private_key("openssh")):
        return key
    return load_ssh_key(path)


def public_key_openssh(key: asyncssh.SSHKey) -> str:
    """The public half in authorized_keys format: ``ssh-ed25519 AAAA... shepherd``."""
    return key.export_public_key("openssh").decode().strip()


def load_ssh_key(path: Path) -> asyncssh.SSHKey:
    """The key in an existing file, refused (SSHIdentityError) unless private and ed25519; FileNotFoundError if
    there is none. Nothing is created: for checking a key without making one."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise SSHIdentityError(path, "is not a regular file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SSHIdentityError(
            path,
            f"is accessible by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"a private key must be private: run `chmod 600 {path}`",
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SSHIdentityError(path, f"cannot be read: {error.strerror}") from None
    try:
        key = asyncssh.import_private_key(data)
    except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as error:
        raise SSHIdentityError(path, _why_not_a_private_key(data, error)) from None
    if key.algorithm != KEY_ALGORITHM:
        raise SSHIdentityError(
            path,
            f"is a {key.algorithm.decode()} key; Shepherd uses ed25519 "
            "(move the file away and Shepherd creates a new key on its next start)",
        )
    return key


def _why_not_a_private_key(data: bytes, error: Exception) -> str:
    try:
        asyncssh.import_public_key(data)
    except (asyncssh.KeyImportError, ValueError):
        pass
    else:
        return "holds a public key; Shepherd needs the private key (OpenSSH format, unencrypted)"
    if "passphrase" in str(error).lower():
        # Shepherd runs unattended: nobody could type the passphrase.
        return "is encrypted with a passphrase; Shepherd needs an unencrypted private key"
    return f"is not an unencrypted OpenSSH private key ({error})"


def _install_new(path: Path, private_key: bytes) -> bool:
    """Atomically create path holding private_key, unless it exists; whether this call created it."""
    # A random name: a stale temporary file from a crashed run never blocks this one.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # O_EXCL with mode 0600: the key is never readable by others, not even for a moment.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(private_key)
            file.flush()
            os.fsync(file.fileno())
        try:
            # link() fails if path exists, where rename() would replace a key another process just installed.
            os.link(temporary, path)
        except FileExistsError:
            return False
        except OSError:
            # Some file systems have no hard links; a rename is still atomic.
            os.replace(temporary, path)
        _fsync_directory(path.parent)
        return True
    finally:
        temporary.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    # The new directory entry must survive a crash too, or the next start makes another key.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
