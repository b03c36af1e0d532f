"""The operator API's signing key on disk: one line, the base64 of the key's 32-byte ed25519 seed, in a file its
owner alone may read; made by ``shepherd api-key create``, read by ``shepherd api``."""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from nacl.signing import SigningKey

from foundation.operator_proof import ProofSigner
from foundation.secret_files import SecretFileError, read_secret_file
from foundation.setting_values import SettingsError

SEED_BYTES = 32


def load_signing_key(path: Path) -> ProofSigner:
    """The signer of the key in the file; SettingsError naming api_signing_key_path when it cannot serve."""
    try:
        text = read_secret_file(path)
    except SecretFileError as error:
        raise SettingsError("api_signing_key_path", f"{path} {error}") from None
    try:
        seed = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SettingsError(
            "api_signing_key_path", f"{path} is not base64 (shepherd api-key create makes one)"
        ) from None
    if len(seed) != SEED_BYTES:
        raise SettingsError("api_signing_key_path", f"{path} holds {len(seed)} bytes; an ed25519 seed is {SEED_BYTES}")
    return ProofSigner(SigningKey(seed))


def create_signing_key(path: Path) -> ProofSigner:
    """A new key written to path (mode 0600, created, never replaced); FileExistsError when path exists."""
    key = SigningKey.generate()
    # O_EXCL: an existing key is what workers trust now; replacing it is a rotation, done on purpose.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(base64.b64encode(bytes(key)).decode() + "\n")
    return ProofSigner(key)
