"""The agent's ed25519 key. PyNaCl (libsodium) rather than cryptography: on the machine it costs a tenth of the
memory (cryptography's bindings and OpenSSL hold about 10 MiB of a heartbeating agent's resident memory)."""

from __future__ import annotations

from typing import Protocol

from nacl.signing import SigningKey

PRIVATE_KEY_SIZE = 32


class Signer(Protocol):
    """What signs a heartbeat: an ed25519 key's sign, which returns the 64-byte signature."""

    def sign(self, data: bytes) -> bytes:
        """The 64-byte ed25519 signature of data."""


class AgentKey:
    """An ed25519 key pair: the private half kept as its 32 raw bytes, as in agent.key."""

    def __init__(self, signing_key: SigningKey) -> None:
        self._signing_key = signing_key

    @classmethod
    def generate(cls) -> AgentKey:
        """A new random key pair."""
        return cls(SigningKey.generate())

    @classmethod
    def from_raw(cls, raw: bytes) -> AgentKey:
        """The key whose 32 raw private bytes are raw; ValueError for any other length."""
        if len(raw) != PRIVATE_KEY_SIZE:
            raise ValueError(f"an ed25519 private key is {PRIVATE_KEY_SIZE} bytes, not {len(raw)}")
        return cls(SigningKey(raw))

    @property
    def raw(self) -> bytes:
        """The 32 raw private bytes."""
        return bytes(self._signing_key)

    @property
    def public(self) -> bytes:
        """The 32 raw public bytes, which Shepherd records at the takeover."""
        return bytes(self._signing_key.verify_key)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte ed25519 signature of data with the private key."""
        return bytes(self._signing_key.sign(data).signature)
