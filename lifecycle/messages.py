"""The typed messages an operator or the fleet watchdog sends a machine's workflow, and how each reads its JSON.

A signal or update argument arrives as whatever JSON its sender typed; each class's from_wire builds it from any
value (foundation.temporal_payloads calls it), so a malformed message still reads as what it most likely meant.
lifecycle.contracts re-exports them with the signal and update names they go with.

No "from __future__ import annotations" here: a workflow's sandbox holds the modules its workflow imports
(lifecycle.contracts), not this one, so a field's annotation written as a string could not be read there when a
payload is decoded. Each field's type is the class itself, defined above its first use.
"""

import dataclasses
import enum
from dataclasses import dataclass

from foundation.operator_proof import Signature


@dataclass(frozen=True)
class HeartbeatLost:
    """What the fleet watchdog signals with heartbeat_lost: why, and which agent fell silent.

    A workflow whose agent has changed since the watchdog read BMDB (a recovery finished in between) ignores it.
    """

    cause: str = "no detail"
    # None from watchdogs older than this field, which sent the cause alone.
    agent_key_fingerprint: str | None = None

    @classmethod
    def from_wire(cls, value: object) -> "HeartbeatLost":
        """From the signal's JSON: this dataclass, or the cause alone as older watchdogs sent it."""
        if isinstance(value, dict):
            agent = value.get("agent_key_fingerprint")
            return cls(_text(value.get("cause"), 1000) or "no detail", agent if isinstance(agent, str) else None)
        return cls(_text(value, 1000) or "no detail")


def _text(value: object, limit: int) -> str:
    """A text field of a message as sent, stripped and cut to limit characters; "" when it is no string."""
    return value.strip()[:limit] if isinstance(value, str) else ""


def _operator(value: object) -> str:
    """Who asked, as a message says, on one line and without the parentheses the verified mark is written in;
    "unknown" when it does not say."""
    named = " ".join(_text(value, 100).replace("(", " ").replace(")", " ").split())
    return named or "unknown"


def _proof(value: object) -> Signature | None:
    """The operator API's proof a request carries, as sent; None when there is none or it is no proof at all (the
    request is then an unverified one)."""
    if not isinstance(value, dict):
        return None
    fields = [value.get(name) for name in ("key_id", "via", "issued_at", "signature")]
    if not all(isinstance(f, str) and 0 < len(f) <= 200 for f in fields):
        return None
    key, via, issued_at, signature = (str(f) for f in fields)
    if not via.replace("-", "").isalpha():
        return None
    return Signature(key, via, issued_at, signature)


def credited(by: str, verified_via: str | None) -> str:
    """Who asked, as the status and the event log record it: marked verified, and how (oidc, certificate), when the
    operator API vouches for it (an update's validator checked its proof); else marked unverified."""
    return f"{by} (verified: {verified_via})" if verified_via is not None else f"{by} (unverified)"


class RecoveryKind(enum.StrEnum):
    """Who asked for a recovery, which decides whether the recovery budget counts it."""

    # The fleet watchdog found the agent silent.
    HEARTBEAT_LOST = "heartbeat_lost"
    # An operator's force_recover: never counted against the budget, and it releases a quarantined machine.
    FORCED = "forced"
    # An operator ended a maintenance asking for a reboot: as forced.
    MAINTENANCE_OVER = "maintenance_over"


class _Asked:
    """What an operator's update says of who asked: a name, and the operator API's proof when the API vouches."""

    by: str
    proof: Signature | None

    def credited(self) -> str:
        """Who asked, marked verified when the API's proof came with it (the update's validator checked it)."""
        return credited(self.by, self.proof.via if self.proof is not None else None)


@dataclass(frozen=True)
class RecoveryRequest(_Asked):
    """A recovery asked for: force_recover's and recover's argument (``{"reason": "disk errors", "by": "alice"}``,
    and the operator API's ``"proof"`` when it comes through the API), and the recovery a machine's status keeps
    until it begins."""

    reason: str = "no reason given"
    by: str = "unknown"
    kind: RecoveryKind = RecoveryKind.FORCED
    # A fresh OS through the provider instead of a reboot (``shepherd reimage``, ``{"reimage": true}``).
    reimage: bool = False
    proof: Signature | None = None

    @property
    def by_an_operator(self) -> bool:
        """Whether an operator asked for it, so the recovery budget does not count it."""
        return self.kind is not RecoveryKind.HEARTBEAT_LOST

    def signed(self) -> dict[str, object]:
        """What of the request the API's proof signs besides who asked (the kind is the update's to say)."""
        return {"reason": self.reason, "reimage": self.reimage}

    def require_reason(self) -> None:
        """ValueError, asking why, when the request gives no reason."""
        if not self.reason:
            raise ValueError('say why the machine is recovered: {"reason": "...", "by": "..."}')

    def describe(self) -> str:
        """The recovery in one line, as the status, the event log and the reboot's cause say it."""
        if self.kind is RecoveryKind.HEARTBEAT_LOST:
            return f"heartbeat lost: {self.reason}"
        if self.kind is RecoveryKind.MAINTENANCE_OVER:
            return f"forced: maintenance over, reboot asked by {self.by}: {self.reason}"
        what = "forced reimage" if self.reimage else "forced"
        # Marked only when the API vouches: an unverified request reads as it always did.
        by = self.credited() if self.proof is not None else self.by
        return f"{what}: {self.reason}" + ("" if self.by == "unknown" else f" (by {by})")

    def answer(self, workflow_id: str, stage: str) -> str:
        """What the operator is told of this forced recovery asked of a machine in stage, as one line naming its
        workflow: the recover update's answer, and what `shepherd recover` prints after the signal."""
        what, act = ("reimage", "reimages") if self.reimage else ("recovery", "reboots")
        if stage == "QUARANTINED":
            return f"{workflow_id}: was QUARANTINED; the forced {what} releases it ({self.reason}) and {act} it"
        if stage in ("RECOVERING", "REIMAGING"):
            return f"{workflow_id} is already {stage}; the request is recorded with the one under way"
        if stage in ("PROVISIONING", "AGENT_STARTING"):
            return f"{workflow_id}: {what} requested ({self.reason}); it is {stage}, the {what} follows the takeover"
        suffix = "; a provider that cannot reimage reboots it instead" if self.reimage else ""
        return f"{workflow_id}: {what} requested ({self.reason}); it was {stage}{suffix}"

    @classmethod
    def from_wire(cls, value: object) -> "RecoveryRequest":
        """From any JSON: a malformed request still means "recover", so nothing here refuses; a JSON object without
        a reason has none (the recover update's validator refuses it, force_recover reads it with from_signal).

        A string is an operator's bare reason, or the line a status kept before recoveries had a kind.
        """
        if value is None:
            return cls()
        if isinstance(value, dict):
            kind = value.get("kind")
            return cls(
                reason=_text(value.get("reason"), 1000),
                by=_operator(value.get("by")),
                kind=RecoveryKind(kind) if kind in tuple(RecoveryKind) else RecoveryKind.FORCED,
                reimage=value.get("reimage") is True,
                proof=_proof(value.get("proof")),
            )
        if isinstance(value, str):
            for kind, prefix in ((RecoveryKind.HEARTBEAT_LOST, "heartbeat lost: "), (RecoveryKind.FORCED, "forced: ")):
                if value.startswith(prefix):
                    return cls(reason=value[len(prefix) :], kind=kind)
            return cls(reason=_text(value, 1000) or "no reason given")
        return cls(reason=_unreadable(value))

    @classmethod
    def from_signal(cls, value: object) -> "RecoveryRequest":
        """force_recover's argument, from any JSON: as from_wire, a reason made of what came when it gives none
        (the signal recovers whatever it says), and no proof, since a signal has no validator to check one in."""
        request = cls.from_wire(value)
        reason = request.reason or _unreadable(value)
        return dataclasses.replace(request, reason=reason, kind=RecoveryKind.FORCED, proof=None)


def _unreadable(value: object) -> str:
    """The reason of a recovery asked with a value that is no reason, showing the start of what came."""
    return f"unreadable reason {str(value)[:100]!r}"


@dataclass(frozen=True)
class OperatorRequest(_Asked):
    """The argument of release, decommission, restart_agent and retry_now: ``{"reason": ..., "by": ...}``, and the
    operator API's ``"proof"`` when it comes through the API. ``"force": true`` lets a decommission override
    another operator's maintenance, which it otherwise refuses naming it."""

    reason: str = ""
    by: str = "unknown"
    proof: Signature | None = None
    force: bool = False

    def signed(self) -> dict[str, object]:
        """What of the request the API's proof signs besides who asked; force only when given, so a proof made
        before force existed still checks."""
        return {"reason": self.reason} | ({"force": True} if self.force else {})

    def require_reason(self, why: str) -> None:
        """ValueError, asking why, when the request gives no reason."""
        if not self.reason:
            raise ValueError(f'say why {why}: {{"reason": "...", "by": "..."}}')

    @classmethod
    def from_wire(cls, value: object) -> "OperatorRequest":
        """From the JSON an operator sent: this dataclass, or the reason alone."""
        if isinstance(value, dict):
            reason, by, proof = _text(value.get("reason"), 500), _operator(value.get("by")), _proof(value.get("proof"))
            return cls(reason, by, proof, force=value.get("force") is True)
        return cls(_text(value, 500))


@dataclass(frozen=True)
class MaintenanceRequest(_Asked):
    """set_maintenance's argument: ``{"on": true, "reason": ..., "by": ...}`` begins a maintenance,
    ``{"on": false, "recover": false}`` ends it, with a reboot when recover is true."""

    # None when the request did not say, which check refuses.
    on: bool | None = None
    reason: str = ""
    by: str = "unknown"
    recover: bool | None = False
    proof: Signature | None = None

    def signed(self) -> dict[str, object]:
        """What of the request the API's proof signs besides who asked."""
        return {"on": self.on, "reason": self.reason, "recover": self.recover}

    def check(self) -> "MaintenanceRequest":
        """The request as it is carried out (an end's reason filled in); ValueError naming what is wrong."""
        if self.on is None:
            raise ValueError('give {"on": true, "reason": "...", "by": "..."} or {"on": false, "recover": false}')
        if self.recover is None or (self.recover and self.on):
            raise ValueError('"recover" (a reboot once maintenance ends) goes with "on": false, as true or false')
        if not self.reason:
            if self.on:
                raise ValueError("say why the machine goes into maintenance: a reason")
            return dataclasses.replace(self, reason="maintenance done")
        return self

    @classmethod
    def from_wire(cls, value: object) -> "MaintenanceRequest":
        """From the JSON an operator sent: what it says of each field, a wrong type left for check to refuse."""
        if not isinstance(value, dict):
            return cls()
        on, recover = value.get("on"), value.get("recover", False)
        return cls(
            on=on if isinstance(on, bool) else None,
            reason=_text(value.get("reason"), 500),
            by=_operator(value.get("by")),
            recover=recover if isinstance(recover, bool) else None,
            proof=_proof(value.get("proof")),
        )
