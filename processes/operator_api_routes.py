"""The operator API's routes as one table: each route's method, path, the policy action it needs, the workflow
update it sends and the fields of its body. The server is built from it and the OpenAPI document written from it,
so the document lists exactly what is served; read_body checks a request's body against it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lifecycle.contracts import DECOMMISSION_UPDATE, RELEASE_UPDATE, RESTART_AGENT_UPDATE, SET_MAINTENANCE_UPDATE
from operations.machine_actions import MAX_REASON_LENGTH, check_reason
from operations.policy_file import DECOMMISSION, MAINTENANCE, READ, RELEASE, RESTART_AGENT

API_VERSION = "1"


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


_REASON = Field("reason", str, True, f"why, 1 to {MAX_REASON_LENGTH} characters; kept in the event log and history")


def _machine_request(operation: str, action: str, update: str, summary: str, *body: Field) -> Route:
    path = f"/v1/machines/{{name}}/{action}"
    return Route("POST", path, operation, "update", action, summary, update, body or (_REASON,))


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
    _machine_request("decommission", DECOMMISSION, DECOMMISSION_UPDATE, "retire a machine for good"),
    _machine_request("release", RELEASE, RELEASE_UPDATE, "release a quarantined machine, as `shepherd release`"),
)


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
        if field.name == "reason":
            try:
                body["reason"] = check_reason(body["reason"])
            except ValueError as error:
                raise BodyError(f"field 'reason': {error}") from None
    if route.action == MAINTENANCE:
        if body["on"] and "reason" not in body:
            raise BodyError("field 'reason' is missing: on needs a reason")
        if body.get("recover") and body["on"]:
            raise BodyError("field 'recover' goes with on false")
    return body


_TYPES = {bool: "boolean", str: "string"}


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
        if "{name}" in route.path:
            operation["parameters"] = [
                {
                    "name": "name",
                    "in": "path",
                    "required": True,
                    "description": "BMDB machine id (or a unique prefix), provider id or workflow id",
                    "schema": {"type": "string"},
                }
            ]
        if route.action is not None:
            operation["x-shepherd-action"] = route.action
        if route.update is not None:
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
    if route.action is not None:
        responses["403"] = {"description": "the policy refuses it, or it needs a confirmation", **error}
    if "{name}" in route.path:
        responses["404"] = {"description": "no such machine", **error}
    if route.update is not None:
        responses["400"] = {"description": "a malformed body; the error names the field", **error}
        responses["409"] = {"description": "the machine's workflow refused, or does not run", **error}
    return responses
