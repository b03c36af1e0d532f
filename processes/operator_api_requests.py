"""A request to the operator API as its handlers read it: the route, the verified operator, the path's and query's
parameters and the body. Kept as JSON, a request the policy gives to two people waits in BMDB for a second
operator and is done later as it was asked, with the approver beside the operator who asked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from foundation.operator_tokens import OperatorIdentity
from operations.policy import OneMachine, Requester, Selection, Target, WholeFleet, WholeProvider
from processes.operator_api_errors import ApiError
from processes.operator_api_routes import ROUTES, BodyError, Route, read_body


@dataclass(frozen=True)
class Asked:
    """One request: which route, by whom, with what; approved_by: the second operator, once one approved it."""

    route: Route
    identity: OperatorIdentity
    params: dict[str, str]
    query: dict[str, str]
    body: bytes
    approved_by: OperatorIdentity | None = None

    def to_json(self) -> dict[str, Any]:
        """The request as BMDB keeps it while it waits."""
        return {
            "operation": self.route.operation,
            "identity": _identity_json(self.identity),
            "params": self.params,
            "query": self.query,
            "body": self.body.decode("utf-8", errors="replace"),
        }

    @classmethod
    def from_json(cls, kept: dict[str, Any], approved_by: OperatorIdentity) -> Asked:
        """The request to_json kept, approved now by approved_by; ValueError when it is not one."""
        try:
            route = next(route for route in ROUTES if route.operation == kept["operation"])
            return cls(
                route,
                _identity_from_json(kept["identity"]),
                {str(k): str(v) for k, v in kept["params"].items()},
                {str(k): str(v) for k, v in kept["query"].items()},
                str(kept["body"]).encode(),
                approved_by,
            )
        except (KeyError, StopIteration, TypeError, AttributeError, ValueError) as error:
            raise ValueError(f"a kept request that does not read: {error!r}") from None


@dataclass(frozen=True)
class NeedsApproval(Exception):
    """The policy gives this request to two people: it waits for a second operator allowed the same action."""

    action: str
    target: Target
    what: str  # the request in words: "decommission of machine-sim-node-0001"
    machine_id: str | None = None  # the machine's BMDB id, for the event log


def target_json(target: Target) -> dict[str, Any]:
    """A policy target as an approval keeps it, so the approver is asked about the same one."""
    kind = {OneMachine: "machine", Selection: "selection", WholeProvider: "provider", WholeFleet: "fleet"}[type(target)]
    return {"kind": kind} | {name: getattr(target, name) for name in target.__dataclass_fields__}


def target_from_json(kept: dict[str, Any]) -> Target:
    """target_json read back; ValueError when it is not one."""
    kinds: dict[str, type] = {"machine": OneMachine, "selection": Selection, "provider": WholeProvider}
    kinds["fleet"] = WholeFleet
    try:
        fields = {name: value for name, value in kept.items() if name != "kind"}
        target: Target = kinds[kept["kind"]](**fields)
        return target
    except (KeyError, TypeError) as error:
        raise ValueError(f"a kept policy target that does not read: {error!r}") from None


def _identity_json(identity: OperatorIdentity) -> dict[str, Any]:
    return {
        "subject": identity.subject,
        "groups": list(identity.groups),
        "issuer": identity.issuer,
        "verified_by": identity.verified_by,
        "expires_at": identity.expires_at.isoformat(),
        "client_id": identity.client_id,
        "certificate": identity.certificate,
    }


def _identity_from_json(kept: dict[str, Any]) -> OperatorIdentity:
    return OperatorIdentity(
        subject=str(kept["subject"]),
        groups=tuple(str(group) for group in kept["groups"]),
        issuer=str(kept["issuer"]),
        verified_by=str(kept["verified_by"]),
        expires_at=datetime.fromisoformat(kept["expires_at"]),
        client_id=kept.get("client_id"),
        certificate=kept.get("certificate"),
    )


def body_json(asked: Asked) -> dict[str, Any]:
    """The request's body as JSON, for what the approval shows of it; {} when it is none."""
    try:
        body = json.loads(asked.body or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def requester(identity: OperatorIdentity) -> Requester:
    """The operator as the policy asks about them."""
    return Requester(
        identity.subject, identity.groups, certificate=identity.certificate, verified_by=identity.verified_by
    )


def approved_reason(asked: Asked, reason: str) -> str:
    """The reason as the record keeps it: with the second operator who approved the request, when one did."""
    if asked.approved_by is None:
        return reason
    approver = asked.approved_by
    return f"{reason}; approved by {approver.subject} (verified: {approver.verified_by})"


def checked_body(asked: Asked) -> dict[str, Any]:
    """The request's body, checked against its route's fields; ApiError 400 naming the field that is wrong."""
    try:
        return read_body(asked.route, asked.body)
    except BodyError as error:
        raise ApiError(400, str(error)) from None
