"""Who may do what through the operator API: a decision for every request and every item of a bulk one.

Deny by default: an action is allowed only when a grant of the policy file (operations/policy_file.py) gives the
one who asks a role that allows it over the target. An allowed action comes with the scope the API ANDs into its
selection (the visibility query of the grants that allowed it) and the confirmation it needs; a refused one with
a reason that names the missing permission and what the one who asks does hold.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from foundation.files import ReloadedFile
from operations.policy_file import (
    FLEET_ACTIONS,
    MACHINE_ACTIONS,
    READS,
    Grant,
    Policy,
    certificate_matches,
    load_policy,
    query_problem,
)

__all__ = [
    "Confirmation",
    "Decision",
    "OneMachine",
    "ReloadedPolicy",
    "Requester",
    "ScopeEscape",
    "Selection",
    "Target",
    "WholeFleet",
    "WholeProvider",
    "decide",
    "restrict",
]

# How an action reads in a refusal: "<subject> may not <verb> <target>".
_VERBS = {
    "read": "read",
    "events-stream": "follow the events of",
    "recover": "recover",
    "reimage": "reimage",
    "restart-agent": "restart the agents of",
    "maintenance": "set maintenance of",
    "retry": "retry the steps of",
    "release": "release",
    "decommission": "decommission",
    "reset-host-key": "reset the host keys of",
    "fleet-pause": "pause",
    "fleet-resume": "resume",
    "fleet-trigger": "trigger a reconcile pass of",
    "release-recoveries": "release the held recoveries of",
}


@dataclass(frozen=True)
class Requester:
    """Who asks, as the API verified them: the token's subject and groups, or a client certificate's subject DN
    (RFC 4514), and how ("oidc", "certificate")."""

    subject: str
    groups: tuple[str, ...] = ()
    certificate: str | None = None
    verified_by: str = "oidc"


@dataclass(frozen=True)
class OneMachine:
    """One machine, of this provider instance."""

    provider: str

    def text(self) -> str:
        return f"machines of provider {self.provider}"


@dataclass(frozen=True)
class Selection:
    """The machines a visibility query selects across the fleet: a read of the table, or a bulk action over
    size machines (None for a read, whose size does not matter)."""

    size: int | None = None

    def text(self) -> str:
        return "machines selected by a query" if self.size is None else f"{self.size} machines selected by a query"


@dataclass(frozen=True)
class WholeProvider:
    """A provider instance as a whole: its fleet schedule, its held recoveries."""

    provider: str

    def text(self) -> str:
        return f"the fleet of provider {self.provider}"


@dataclass(frozen=True)
class WholeFleet:
    """Every provider instance at once."""

    def text(self) -> str:
        return "the whole fleet"


Target = OneMachine | Selection | WholeProvider | WholeFleet


class Confirmation(enum.IntEnum):
    """What an allowed action needs before it is done, weakest first."""

    NONE = 0
    TYPED = 1  # the operator types the target's name (or the count of a selection) again
    SECOND_PERSON = 2  # another operator allowed the same action approves it


@dataclass(frozen=True)
class Decision:
    """Whether an action is allowed; if so, the scope the API ANDs into its selection (None: no restriction) and
    the confirmation it needs; if not, why, in an operator's words."""

    allowed: bool
    refusal: str | None = None
    scope: str | None = None
    confirmation: Confirmation = Confirmation.NONE


class ScopeEscape(ValueError):
    """An operator's query that could reach past the scope it is ANDed with; str() says how."""


def decide(policy: Policy | None, requester: Requester, action: str, target: Target) -> Decision:
    """Whether the requester may do action to target under policy (None: no policy, nothing is allowed)."""
    _check_fits(action, target)
    if policy is None:
        return Decision(False, refusal=_refusal(requester, action, target, [], no_policy=True))
    mine = [grant for grant in policy.grants if _holds(grant, requester)]
    allowing = [grant for grant in mine if action in policy.roles[grant.role] and _covers(grant, target)]
    if not allowing:
        return Decision(False, refusal=_refusal(requester, action, target, mine, no_policy=False))
    return Decision(True, scope=_scope(allowing, target), confirmation=_confirmation(policy, action, target))


def restrict(scope: str | None, where: str | None) -> str | None:
    """An operator's own query within a decision's scope: (scope) AND (where). ScopeEscape when where could close
    the parentheses around it or hide what follows it; the scope itself was checked when the file was loaded."""
    if where is not None:
        problem = query_problem(where)
        if problem:
            raise ScopeEscape(f"the query {problem}")
    if scope is None or where is None:
        return scope if where is None else where
    return f"({scope}) AND ({where.strip()})"


def _check_fits(action: str, target: Target) -> None:
    """A fleet action names a provider instance or the fleet; a machine action machines. Anything else is the
    caller's mistake, not the operator's."""
    if action not in _VERBS:
        raise ValueError(f"unknown action {action!r}")
    whole = isinstance(target, WholeProvider | WholeFleet)
    if action in FLEET_ACTIONS and not whole:
        raise ValueError(f"{action} acts on a provider instance or the whole fleet, not on {target.text()}")
    if action in MACHINE_ACTIONS and whole:
        raise ValueError(f"{action} acts on machines, not on {target.text()}")


def _holds(grant: Grant, requester: Requester) -> bool:
    if requester.certificate is not None:
        # A certificate's CN is no token's subject: an operator CA must not reach the grants of a token's sub.
        return any(certificate_matches(name, requester.certificate) for name in grant.certificates)
    return requester.subject in grant.subjects or bool(grant.groups.intersection(requester.groups))


def _covers(grant: Grant, target: Target) -> bool:
    if isinstance(target, OneMachine):
        return grant.providers is None or target.provider in grant.providers
    if isinstance(target, Selection):
        return True  # a provider or where scope narrows the selection instead (_scope)
    # A schedule or a hold is not a machine a where can select: only a grant over all of it reaches it.
    if grant.where is not None:
        return False
    return grant.providers is None or (isinstance(target, WholeProvider) and target.provider in grant.providers)


def _scope(grants: list[Grant], target: Target) -> str | None:
    """The machines the grants reach, as one visibility query: each grant's providers and where, ANDed, and the
    grants ORed; None when one of them reaches every machine the target can hold."""
    parts = []
    for grant in grants:
        terms = []
        if isinstance(target, Selection) and grant.providers is not None:
            quoted = ", ".join(f"'{name}'" for name in sorted(grant.providers))
            terms.append(f"Provider IN ({quoted})")
        if grant.where is not None and not isinstance(target, WholeProvider | WholeFleet):
            terms.append(grant.where)
        if not terms:
            return None
        parts.append(" AND ".join(f"({term})" for term in terms))
    unique = sorted(set(parts))
    return unique[0] if len(unique) == 1 else " OR ".join(f"({part})" for part in unique)


def _confirmation(policy: Policy, action: str, target: Target) -> Confirmation:
    rules = policy.confirmations
    if action in rules.second_person:
        return Confirmation.SECOND_PERSON
    if action in rules.typed:
        return Confirmation.TYPED
    if isinstance(target, Selection) and target.size is not None and action not in READS:
        if target.size > rules.bulk_confirm_over:
            return Confirmation.TYPED
    return Confirmation.NONE


def _refusal(requester: Requester, action: str, target: Target, mine: list[Grant], *, no_policy: bool) -> str:
    asked = f"{requester.subject} may not {_VERBS[action]} {target.text()}"
    if no_policy:
        return f"{asked}: the operator API has no policy file, so it grants nothing"
    held = ", ".join(f"{grant.role} ({grant.scope_text()})" for grant in mine) or "none"
    return f"{asked}: no grant gives {action!r} there; grants of {requester.subject}: {held}"


class ReloadedPolicy:
    """The policy file as last read whole: read again when it changed on disk (looked at most once every interval
    seconds, when asked); a changed file that does not load is logged, naming the problem, and the policy before it
    is used on. A file that does not load at start is a SettingsError naming api_policy_path."""

    def __init__(self, path: Path, *, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._file = ReloadedFile(
            path, load_policy, what="operator API policy", setting="api_policy_path", describe=Policy.describe
        )
        self._interval, self._clock = interval, clock
        self._policy = self._file.current()
        self._looked = clock()

    def current(self) -> Policy:
        """The policy in force now."""
        now = self._clock()
        if now - self._looked >= self._interval:
            self._looked = now
            self._policy = self._file.current()
        return self._policy

    def decide(self, requester: Requester, action: str, target: Target) -> Decision:
        """decide() under the policy in force now."""
        return decide(self.current(), requester, action, target)
