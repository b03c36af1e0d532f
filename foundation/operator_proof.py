"""The operator API's proof that it verified who asks: an ed25519 signature over one request to one workflow, and
the keys that check it.

The API signs every request it sends for an operator whose identity it verified (an OIDC token, a client
certificate). A machine's workflow checks the signature in the update's validator, against the public keys the
worker trusts (``SHEPHERD_API_TRUSTED_KEYS``), and records the request as verified. A request sent straight to
Temporal carries no proof and is recorded as unverified; a deployment may refuse the destructive ones.

The signature covers the workflow, the update's name, who asked, how the API verified it, when it signed and every
field of the request, so a proof taken from a workflow's history (payloads are visible there) cannot be put on
another request or sent to another machine, and is refused once it is older than the trust's max_age.

Nothing here is secret but the signing key, which only the API holds. The validators run in the workflow
sandbox and do no I/O, so the worker installs its trust here once at start (install_trust), for its task queue,
and they read it with current_trust(). Validators do not run again when a history is replayed, so what they read
is never part of it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

# How a public key is written in settings: the algorithm, then the 32 raw bytes in base64.
KEY_PREFIX = "ed25519:"
# A proof older than this is refused: long enough for a bulk action's last request, short enough that a proof
# copied from a history is of little use.
DEFAULT_MAX_AGE = 300.0
# A proof signed this far ahead of the worker's clock is still taken: the API's host clock may run ahead a little.
CLOCK_SKEW = 60.0


class ProofRefused(ValueError):
    """A request's proof does not check; str() says why, without the signature."""


def key_id(public_key: bytes) -> str:
    """A short name of a public key, which a proof carries so the worker knows which of its keys to check with."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def public_key_text(public_key: bytes) -> str:
    """The public key as SHEPHERD_API_TRUSTED_KEYS takes it."""
    return KEY_PREFIX + base64.b64encode(public_key).decode()


def statement(
    *, workflow_id: str, action: str, by: str, via: str, issued_at: str, request: Mapping[str, object]
) -> bytes:
    """The bytes a proof signs: one canonical JSON document, the same on the API's side and the worker's."""
    document = {
        "proof": 1,
        "workflow_id": workflow_id,
        "action": action,
        "by": by,
        "via": via,
        "issued_at": issued_at,
        "request": dict(request),
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


@dataclass(frozen=True)
class Signature:
    """What the API signed: with which key, how it verified the operator, when, and the signature in base64."""

    key_id: str
    via: str
    issued_at: str
    signature: str


class ProofSigner:
    """The operator API's side: signs requests with its ed25519 key."""

    def __init__(self, signing_key: SigningKey) -> None:
        self._key = signing_key
        self.public_key = bytes(signing_key.verify_key)
        self.key_id = key_id(self.public_key)

    @classmethod
    def generate(cls) -> ProofSigner:
        """A signer with a fresh key."""
        return cls(SigningKey.generate())

    def sign(
        self, *, workflow_id: str, action: str, by: str, via: str, issued_at: datetime, request: Mapping[str, object]
    ) -> Signature:
        """The proof of one request to one workflow, signed now."""
        at = issued_at.isoformat()
        signed = statement(workflow_id=workflow_id, action=action, by=by, via=via, issued_at=at, request=request)
        signature = base64.b64encode(self._key.sign(signed).signature).decode()
        return Signature(self.key_id, via, at, signature)


@dataclass(frozen=True)
class TrustedKeys:
    """The operator API's public keys a worker checks proofs with, by key id: two during a key rotation."""

    keys: Mapping[str, VerifyKey] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> TrustedKeys:
        """From SHEPHERD_API_TRUSTED_KEYS: ed25519:<base64> entries, comma-separated; ValueError naming a bad one."""
        keys: dict[str, VerifyKey] = {}
        for number, entry in enumerate((e.strip() for e in text.split(",")), start=1):
            if not entry:
                continue
            if not entry.startswith(KEY_PREFIX):
                raise ValueError(f"key {number} does not begin with {KEY_PREFIX!r}")
            try:
                raw = base64.b64decode(entry[len(KEY_PREFIX) :], validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"key {number} is not base64 after {KEY_PREFIX!r}") from None
            if len(raw) != 32:
                raise ValueError(f"key {number} is {len(raw)} bytes long; an ed25519 public key is 32")
            keys[key_id(raw)] = VerifyKey(raw)
        return cls(keys)

    def check(
        self,
        proof: Signature,
        *,
        workflow_id: str,
        action: str,
        by: str,
        request: Mapping[str, object],
        now: datetime,
        max_age: float = DEFAULT_MAX_AGE,
    ) -> None:
        """ProofRefused, saying why, unless one of these keys signed exactly this request lately."""
        verify_key = self.keys.get(proof.key_id)
        if verify_key is None:
            raise ProofRefused(f"the proof is signed with key {proof.key_id!r}, which this worker does not trust")
        try:
            issued = datetime.fromisoformat(proof.issued_at)
            raw = base64.b64decode(proof.signature, validate=True)
        except (binascii.Error, ValueError):
            raise ProofRefused("the proof is malformed") from None
        if issued.tzinfo is None:
            raise ProofRefused("the proof's time has no time zone")
        if issued < now - timedelta(seconds=max_age):
            raise ProofRefused(f"the proof was signed at {proof.issued_at}, more than {max_age:g}s ago")
        if issued > now + timedelta(seconds=CLOCK_SKEW):
            raise ProofRefused(f"the proof was signed at {proof.issued_at}, ahead of this worker's clock")
        signed = statement(
            workflow_id=workflow_id, action=action, by=by, via=proof.via, issued_at=proof.issued_at, request=request
        )
        try:
            verify_key.verify(signed, raw)
        except (BadSignatureError, ValueError):
            raise ProofRefused(
                "the proof's signature does not match this request (another request, workflow or operator)"
            ) from None


@dataclass(frozen=True)
class OperatorTrust:
    """What a worker trusts of operator requests: the API's keys, how old a proof may be, and the actions it
    refuses unless their proof checks."""

    keys: TrustedKeys = field(default_factory=TrustedKeys)
    refuse_unverified: frozenset[str] = frozenset()
    max_age: float = DEFAULT_MAX_AGE


# By task queue: the workers of one process (the embedded stack, a test) may run with settings of their own.
_trusts: dict[str, OperatorTrust] = {}


def install_trust(task_queue: str, trust: OperatorTrust) -> None:
    """Make trust what the validators of the workflows on that task queue read, in this worker process."""
    _trusts[task_queue] = trust


def current_trust(task_queue: str) -> OperatorTrust:
    """The trust of this worker process's workflows on that task queue: accept everything, verify nothing, until
    its worker installs its own."""
    return _trusts.get(task_queue, _ACCEPT_ALL)


_ACCEPT_ALL = OperatorTrust()
