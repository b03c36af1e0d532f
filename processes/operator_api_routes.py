"""The operator API's routes as one table: each route's method, path, the policy action it needs, the workflow
update it sends and the fields of its body. The server is built from it and the OpenAPI document written from it,
so the document lists exactly what is served; read_body checks a request's body against it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifecycle.contracts import (
    DECOMMISSION_UPDATE,
    RECOVER_UPDATE,
    RELEASE_UPDATE,
    RESTART_AGENT_UPDATE,
    RETRY_UPDATE,
    SET_MAINTENANCE_UPDATE,
)
from operations.machine_actions import MAX_REASON_LENGTH, check_fingerprint, check_reason
from operations.policy_file import (
    DECOMMISSION,
    EVENTS_STREAM,
    FLEET_PAUSE,
    FLEET_RESUME,
    FLEET_TRIGGER,
    MAINTENANCE,
    READ,
    RECOVER,
    REIMAGE,
    RELEASE,
    RELEASE_RECOVERIES,
    RESET_HOST_KEY,
    RESTART_AGENT,
    RETRY,
)

API_VERSION = "1"
# The most events a listing answers at once.
MAX_EVENTS = 1000


class BodyError(ValueError):
    """A request body the API cannot take; str() names the field and what is wrong with it."""


@dataclass(frozen=True)
class Field:
    """A field of a request body: its name, JSON type (boolean or string: a reason), whether it must be there."""

    name: str
    kind: type
    required: bool
    doc: str


@dataclass(frozen=True)
class Route:
    """One endpoint: what it serves, who may call it (the policy action; None: any verified operator) and, for a
    request to a machine, the update it sends and its body's fields."""

    method: str
    path: str
    operation: str  # the OpenAPI operationId, and the aiohttp route's name
    handler: str  # which of OperatorApi's handlers serves it
    action: str | None
    summary: str
    update: str | None = None
    body: tuple[Field, ...] = ()
    query: tuple[Field, ...] = ()  # the query string's parameters (and headers, named as such), all optional


_REASON = Field("reason", str, True, f"why, 1 to {MAX_REASON_LENGTH} characters; kept in the event log and history")
_CONFIRM = Field("confirm", str, False, "the machine's provider id, where the policy asks for it to be typed")


def _machine_request(operation: str, action: str, update: str, summary: str, *body: Field) -> Route:
    path = f"/v1/machines/{{name}}/{action}"
    return Route("POST", path, operation, "update", action, summary, update, (*(body or (_REASON,)), _CONFIRM))


def _machine_action(operation: str, action: str, update: str, summary: str, *options: Field) -> Route:
    # Served by processes.operator_api_actions: the update is sent by the operator client, as the command does.
    path = f"/v1/machines/{{name}}/{action}"
    return Route("POST", path, operation, "action", action, summary, update, (_REASON, *options, _CONFIRM))


_NOTE = Field("note", str, False, f"why, up to {MAX_REASON_LENGTH} characters; kept with the schedule's state")
_LIMIT = Field("limit", int, False, f"at most this many events, newest first (default 50, at most {MAX_EVENTS})")
_ACTIONS = Field("actions", bool, False, "true: only what operators asked and the reboots, as `--actions`")
BULK_ACTIONS = (RESTART_AGENT, MAINTENANCE, DECOMMISSION, RECOVER, REIMAGE)


_PASSES = Field("passes", int, False, "how many recent passes to show (default 5, at most 100)")


def _fleet_action(operation: str, action: str, verb: str, summary: str, *body: Field) -> Route:
    return Route(
        "POST", f"/v1/fleet/{{provider}}/{verb}", operation, "fleetAction", action, summary, body=body, query=(_PASSES,)
    )


# The fleet, the event log and bulk requests: what `shepherd fleet`, `shepherd events` and `--where` do.
FLEET_ROUTES = (
    Route(
        "GET",
        "/v1/fleet",
        "getFleet",
        "fleet",
        READ,
        "each provider instance's fleet schedule and last passes, as `shepherd fleet --json`",
        query=(
            Field("provider", str, False, "only this provider instance"),
            _PASSES,
        ),
    ),
    _fleet_action("pauseFleet", FLEET_PAUSE, "pause", "stop scheduling passes, as `shepherd fleet --pause`", _NOTE),
    _fleet_action("resumeFleet", FLEET_RESUME, "resume", "schedule passes again, as `shepherd fleet --resume`", _NOTE),
    _fleet_action("triggerFleet", FLEET_TRIGGER, "trigger", "run a pass now, as `shepherd fleet --trigger`"),
    _fleet_action(
        "releaseRecoveries",
        RELEASE_RECOVERIES,
        "release-recoveries",
        "let the recoveries the watchdog holds go ahead, as `shepherd fleet --release-recoveries`",
        _REASON,
        Field("confirm", str, False, "the provider instance's name, where the policy asks for it to be typed"),
    ),
    Route(
        "GET",
        "/v1/events",
        "listEvents",
        "events",
        READ,
        "every machine's events and the fleet's own, newest first, shaped as `shepherd events --json`",
        query=(
            Field("provider", str, False, "only this provider instance's machines"),
            Field("since", str, False, "only events at or after this ISO 8601 time"),
            _LIMIT,
            _ACTIONS,
            Field("fleet", bool, False, "true: the fleet's own events alone, as `shepherd events --json`"),
        ),
    ),
    Route(
        "GET",
        "/v1/machines/{name}/events",
        "machineEvents",
        "machineEvents",
        READ,
        "one machine's event log, as `shepherd events MACHINE --json`",
        query=(_LIMIT, _ACTIONS),
    ),
    Route(
        "GET",
        "/v1/events/stream",
        "streamEvents",
        "eventStream",
        EVENTS_STREAM,
        "every new event as a server-sent event (event: kind, id: BMDB's id, data: JSON), within the caller's scope",
        query=(Field("Last-Event-ID", int, False, "the id of the last event received: the stream goes on after it"),),
    ),
    Route(
        "POST",
        "/v1/bulk/{action}",
        "bulk",
        "bulk",
        None,
        "one machine action on every machine a visibility query selects, within the caller's grants, as `--where`",
        body=(
            Field("where", str, True, "a Temporal visibility query, e.g. MachineStage = 'WATCHING'"),
            Field("reason", str, False, "why; required but for maintenance off"),
            Field("dry_run", bool, False, "true: answer the machines it would act on, and do nothing"),
            Field("confirm", int, False, "the count of machines, where the policy asks for it to be typed"),
            Field("on", bool, False, "maintenance: true into it, false back to automation"),
            Field("recover", bool, False, "maintenance with on false: reboot it and take it over again"),
            Field("force", bool, False, "decommission: also machines in maintenance, which refuse it otherwise"),
        ),
    ),
)

ROUTES = (
    Route("GET", "/v1/openapi.json", "openapi", "openapi", None, "this document"),
    Route("GET", "/v1/machines", "listMachines", "machines", READ, "every machine, as `shepherd machines --json`"),
    Route(
        "GET", "/v1/machines/{name}", "getMachine", "machine", READ, "one machine whole, as `shepherd status --json`"
    ),
    _machine_request(
        "setMaintenance",
        MAINTENANCE,
        SET_MAINTENANCE_UPDATE,
        "take a machine out of automation (on) or back (off), as `shepherd maintenance`",
        Field("on", bool, True, "true: into maintenance; false: back to automation"),
        Field("reason", str, False, "why; required with on"),
        Field("recover", bool, False, "with on false: reboot it and take it over again"),
    ),
    _machine_request(
        "restartAgent",
        RESTART_AGENT,
        RESTART_AGENT_UPDATE,
        "a new takeover without a reboot, as `shepherd restart-agent`",
    ),
    _machine_request(
        "decommission",
        DECOMMISSION,
        DECOMMISSION_UPDATE,
        "retire a machine for good",
        _REASON,
        Field("force", bool, False, "true: also a machine in maintenance, which is refused naming it otherwise"),
    ),
    _machine_request("release", RELEASE, RELEASE_UPDATE, "release a quarantined machine, as `shepherd release`"),
    _machine_action(
        "recover", RECOVER, RECOVER_UPDATE, "reboot a machine and take it over again, as `shepherd recover`"
    ),
    _machine_action(
        "reimage", REIMAGE, RECOVER_UPDATE, "a fresh OS through the provider, then a takeover, as `shepherd reimage`"
    ),
    _machine_action("retry", RETRY, RETRY_UPDATE, "end a failing step's back-off and try it again now"),
    _machine_action(
        "resetHostKey",
        RESET_HOST_KEY,
        RETRY_UPDATE,
        "forget a reinstalled machine's pinned SSH host key and retry its takeover, as `shepherd reset-host-key`",
        Field(
            "expect_fingerprint",
            str,
            False,
            "the SHA256 fingerprint (as `ssh-keygen -lf` prints it) the next host key must have to be pinned; "
            "without it, the first key to answer is pinned",
        ),
    ),
    *FLEET_ROUTES,
    Route("GET", "/v1/approvals", "listApprovals", "approvals", READ, "the requests waiting for a second operator"),
    Route(
        "POST",
        "/v1/approvals/{approval}/approve",
        "approve",
        "decideApproval",
        None,
        "do a waiting request as it was asked, as a second operator allowed the same action; its answer",
    ),
    Route(
        "POST",
        "/v1/approvals/{approval}/refuse",
        "refuse",
        "decideApproval",
        None,
        "drop a waiting request, as a second operator allowed the same action",
    ),
)

_PATH_PARAMETERS = {
    "name": "BMDB machine id (or a unique prefix), provider id or workflow id",
    "provider": "a provider instance's name, as in [[providers]]",
    "action": "the machine action to take on each machine selected: " + ", ".join(BULK_ACTIONS),
    "approval": "the approval's id, as the request's 202 answer and GET /v1/approvals name it",
}


# Fields whose values are checked beyond their type, by the check the command line uses for the same argument.
_VALUE_CHECKS: dict[str, Callable[[str], str]] = {"reason": check_reason, "expect_fingerprint": check_fingerprint}


def read_body(route: Route, data: bytes) -> dict[str, Any]:
    """The body of a request to route, checked field by field; BodyError naming the field."""
    try:
        body = json.loads(data or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise BodyError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BodyError("the body is not a JSON object")
    known = {field.name: field for field in route.body}
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise BodyError(f"unknown field {unknown[0]!r}; {route.operation} takes {', '.join(known)}")
    for field in route.body:
        if field.name not in body:
            if field.required:
                raise BodyError(f"field {field.name!r} is missing: {field.doc}")
            continue
        if not isinstance(body[field.name], field.kind):
            raise BodyError(f"field {field.name!r} must be a {_TYPES[field.kind]}")
        check = _VALUE_CHECKS.get(field.name)
        if check is not None:
            try:
                body[field.name] = check(body[field.name])
            except ValueError as error:
                raise BodyError(f"field {field.name!r}: {error}") from None
    if route.action == MAINTENANCE:
        if body["on"] and "reason" not in body:
            raise BodyError("field 'reason' is missing: on needs a reason")
        if body.get("recover") and body["on"]:
            raise BodyError("field 'recover' goes with on false")
    return body


_TYPES = {bool: "boolean", str: "string", int: "integer"}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of ROUTES."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        operation: dict[str, Any] = {
            "operationId": route.operation,
            "summary": route.summary,
            "security": [{"bearer": []}],
            "responses": _responses(route),
        }
        parameters = [
            {"name": name, "in": "path", "required": True, "description": doc, "schema": {"type": "string"}}
            for name, doc in _PATH_PARAMETERS.items()
            if f"{{{name}}}" in route.path
        ]
        parameters += [
            {
                "name": f.name,
                "in": "header" if f.name[0].isupper() else "query",
                "required": False,
                "description": f.doc,
                "schema": {"type": _TYPES[f.kind]},
            }
            for f in route.query
        ]
        if parameters:
            operation["parameters"] = parameters
        if route.action is not None:
            operation["x-shepherd-action"] = route.action
        if route.body:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _schema(route)}}}
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Shepherd operator API", "version": API_VERSION},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                },
                "Answer": {
                    "type": "object",
                    "properties": {"answer": {"type": "string"}},
                    "required": ["answer"],
                },
            },
        },
    }


def _schema(route: Route) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {f.name: {"type": _TYPES[f.kind], "description": f.doc} for f in route.body},
        "required": [f.name for f in route.body if f.required],
    }


def _responses(route: Route) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    answer = {"type": "array", "items": {"type": "object"}} if route.handler == "machines" else {"type": "object"}
    if route.update is not None:
        answer = {"$ref": "#/components/schemas/Answer"}
    responses: dict[str, Any] = {
        "200": {"description": "done", "content": {"application/json": {"schema": answer}}},
        "401": {"description": "no token, or one that does not verify", **error},
        "503": {"description": "the token issuer cannot be asked now; try again after Retry-After", **error},
    }
    if route.action is not None or route.handler == "bulk":
        responses["403"] = {"description": "the policy refuses it, or it needs a confirmation", **error}
    if "{name}" in route.path:
        responses["404"] = {"description": "no such machine", **error}
    if "{provider}" in route.path:
        responses["404"] = {"description": "no such provider instance", **error}
    if route.handler == "eventStream":
        responses["200"] = {"description": "every new event, as it comes", "content": {"text/event-stream": {}}}
        responses["503"]["description"] += "; or api_max_streams streams are open already"
    if route.handler == "bulk" or route.action == RELEASE_RECOVERIES:
        responses["428"] = {"description": "a typed confirmation is needed; the error says what to send", **error}
    if route.body or route.query:
        responses["400"] = {"description": "a malformed body or parameter; the error names it", **error}
    if route.update is not None:
        responses["409"] = {"description": "the machine's workflow refused, or does not run", **error}
    return responses
