"""Files that hold a password: read only when their owner alone can read them, said plainly when not."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class SecretFileError(Exception):
    """A password file cannot serve; str() says why ("is readable by others ..."), for the caller to put after its
    own words for the file."""


def secret_file_problem(path: Path) -> str | None:
    """Why the file cannot serve, seen from its metadata alone (a check that reads nothing); None when it can."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        return f"cannot be read: {error.strerror or type(error).__name__}"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if mode & 0o077:
        return f"is readable by others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
    return None


def read_secret_file(path: Path) -> str:
    """The file's text without its trailing newline; SecretFileError when others may read it, or it is no text."""
    try:
        # fstat of the opened file, not stat of the path: the mode checked is the mode of what is read.
        with path.open("rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise SecretFileError("is not a regular file")
            if mode & 0o077:
                raise SecretFileError(f"is readable by others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}")
            data = file.read()
    except OSError as error:
        raise SecretFileError(f"cannot be read: {error.strerror or type(error).__name__}") from None
    try:
        text = data.decode().rstrip("\r\n")
    except UnicodeDecodeError:
        raise SecretFileError("is not UTF-8 text") from None
    if not text:
        raise SecretFileError("is empty")
    return text
