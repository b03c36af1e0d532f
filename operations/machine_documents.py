"""A machine as JSON, and back: the documents `shepherd machines --json` and `shepherd status --json` print and the
operator API answers with. Each holds all a command shows, so a command through the API reads the document back
into the view it prints, and prints what it prints when it reads Temporal and BMDB itself."""

from __future__ import annotations

import base64
import uuid
from dataclasses import asdict
from datetime import datetime
from typing import Any

from bmdb.store import MachineRecord
from foundation.temporal_payloads import decode_json
from lifecycle.contracts import MachineStatus, machine_workflow_id
from operations.machine_reads import NO_WORKFLOW, MachineDetail, MachineView


class DocumentError(ValueError):
    """A machine document missing a field or holding one of the wrong type; str() names the field."""


def record_json(record: MachineRecord, recoveries: int) -> dict[str, Any]:
    """What BMDB knows of a machine, as the --json of the commands shows it."""

    def when(at: datetime | None) -> str | None:
        return at.isoformat() if at else None

    return {
        "provider": record.provider,
        "provider_id": record.provider_id,
        "machine_id": str(record.machine_id),
        "workflow_id": machine_workflow_id(record.provider, record.provider_id),
        "address": record.address,
        "ssh_port": record.ssh_port,
        "location": record.location,
        "ssh_host_key": record.ssh_host_key,
        "agent_public_key": base64.b64encode(record.agent_public_key).decode() if record.agent_public_key else None,
        "bmdb_status": record.status,
        "agent_started_at": when(record.agent_started_at),
        "last_heartbeat_at": when(record.agent_heartbeat_at),
        "missing_at_provider_since": when(record.missing_since),
        "stuck_since": when(record.stuck_since),
        "decommissioned_at": when(record.retired_at),
        "decommission_reason": record.retired_reason,
        "recoveries": recoveries,
    }


def machine_json(view: MachineView) -> dict[str, Any]:
    """One machine of `shepherd machines` as --json shows it."""
    return record_json(view.record, view.recoveries) | {"stage": None if view.stage == NO_WORKFLOW else view.stage}


def detail_json(detail: MachineDetail) -> dict[str, Any]:
    """The machine whole as `shepherd status --json` shows it: BMDB's record, the workflow's state and its status
    uncut."""
    return record_json(detail.record, detail.recoveries) | {
        "workflow_state": detail.workflow_state,
        "status": None if detail.status is None else asdict(detail.status),
        "status_missing": detail.status_missing,
    }


def view_from_json(document: object) -> MachineView:
    """machine_json read back; DocumentError naming what is wrong."""
    fields = read_object(document, "machine")
    stage = read_field(fields, "stage", str, optional=True)
    return MachineView(record_from_json(fields), NO_WORKFLOW if stage is None else stage, _recoveries(fields))


def detail_from_json(document: object) -> MachineDetail:
    """detail_json read back; DocumentError naming what is wrong."""
    fields = read_object(document, "machine")
    status = fields.get("status")
    try:
        decoded = None if status is None else decode_json(MachineStatus, status)
    except (TypeError, ValueError, KeyError) as error:
        raise DocumentError(f"field 'status' is not a machine's status: {error}") from None
    return MachineDetail(
        record_from_json(fields),
        _recoveries(fields),
        read_field(fields, "workflow_id", str),
        read_field(fields, "workflow_state", str),
        decoded,
        read_field(fields, "status_missing", str, optional=True),
    )


def record_from_json(fields: dict[str, Any]) -> MachineRecord:
    """The BMDB record record_json wrote."""
    machine_id_text = read_field(fields, "machine_id", str)
    public_key = read_field(fields, "agent_public_key", str, optional=True)
    try:
        machine_id = uuid.UUID(machine_id_text)
        agent_public_key = None if public_key is None else base64.b64decode(public_key, validate=True)
    except ValueError as error:
        raise DocumentError(f"a machine id or agent key that does not read: {error}") from None
    return MachineRecord(
        machine_id=machine_id,
        provider=read_field(fields, "provider", str),
        provider_id=read_field(fields, "provider_id", str),
        status=read_field(fields, "bmdb_status", str),
        address=read_field(fields, "address", str, optional=True),
        ssh_port=read_field(fields, "ssh_port", int, optional=True),
        location=read_field(fields, "location", str, optional=True),
        ssh_host_key=read_field(fields, "ssh_host_key", str, optional=True),
        agent_started_at=read_moment(fields, "agent_started_at"),
        agent_public_key=agent_public_key,
        agent_heartbeat_at=read_moment(fields, "last_heartbeat_at"),
        missing_since=read_moment(fields, "missing_at_provider_since"),
        stuck_since=read_moment(fields, "stuck_since"),
        retired_at=read_moment(fields, "decommissioned_at"),
        retired_reason=read_field(fields, "decommission_reason", str, optional=True),
    )


def read_object(document: object, what: str) -> dict[str, Any]:
    """A document that must be a JSON object; DocumentError naming what it should have been."""
    if not isinstance(document, dict):
        raise DocumentError(f"a {what} is a JSON object, got {type(document).__name__}")
    return document


def _recoveries(fields: dict[str, Any]) -> int:
    count = read_field(fields, "recoveries", int)
    if count < 0:
        raise DocumentError(f"field 'recoveries' is a count, got {count}")
    return count


def read_field(fields: dict[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """A document's field of that type (or null, when optional); DocumentError naming the field."""
    if name not in fields:
        raise DocumentError(f"field {name!r} is missing")
    value = fields[name]
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int to Python, never a count or a port to JSON.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        named = " or ".join(k.__name__ for k in kinds)
        raise DocumentError(f"field {name!r} must be {'null or ' if optional else ''}a {named}, got {value!r}")
    return value


def read_moment(fields: dict[str, Any], name: str) -> datetime | None:
    """A document's field holding an ISO 8601 time, or null; DocumentError naming the field."""
    text = read_field(fields, name, str, optional=True)
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise DocumentError(f"field {name!r} is no ISO 8601 time: {text!r}") from None
