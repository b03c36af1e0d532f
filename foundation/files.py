"""Writing a file whole, with its mode from the start: never half written, never readable by whom it must not be."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def replace_file(path: Path, data: bytes, mode: int) -> None:
    """Write data to a new file beside path, created with mode (exclusively: no link or file is followed or
    reused), flush it to disk, and rename it over path. A reader sees the old file or the new one; an old file's
    mode is not kept."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        # The umask may have taken bits off mode: set it as asked.
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
