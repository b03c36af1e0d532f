"""Certificates the tests issue, written where servers and clients read them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Issued:
    certificate: Path
    key: Path


def write_issued(directory: Path, name: str, issued: tuple[bytes, bytes]) -> Issued:
    """NAME.pem and NAME.key in directory, the key owner-only as libpq and nginx expect of a private key."""
    paths = Issued(directory / f"{name}.pem", directory / f"{name}.key")
    paths.certificate.write_bytes(issued[0])
    paths.certificate.chmod(0o644)
    paths.key.write_bytes(issued[1])
    paths.key.chmod(0o600)
    return paths
