"""A machine's documents read back: what `shepherd machines --json` and `status --json` print (and the operator API
answers) holds all the commands show, and a document that is not one is refused naming the field."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from bmdb.store import MachineRecord
from lifecycle.contracts import MachineStage, MachineStatus
from lifecycle.machine_state import AgentFacts
from lifecycle.messages import RecoveryKind, RecoveryRequest
from operations.machine_documents import (
    DocumentError,
    detail_from_json,
    detail_json,
    machine_json,
    view_from_json,
)
from operations.machine_reads import NO_WORKFLOW, MachineDetail, MachineView

AT = datetime(2026, 11, 28, 6, 30, tzinfo=UTC)


def record(**changes: object) -> MachineRecord:
    fields: dict[str, object] = {
        "machine_id": uuid.UUID("6f1c7a52-0c6e-4c57-9d4b-2f1b8e0f4a11"),
        "provider": "rack1",
        "provider_id": "node-0001",
        "status": "running",
        "address": "10.0.0.7",
        "ssh_port": 22,
        "location": "row 4",
        "ssh_host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKey",
        "agent_started_at": AT,
        "agent_public_key": bytes(range(32)),
        "agent_heartbeat_at": AT,
        "stuck_since": AT,
    }
    return MachineRecord(**(fields | changes))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "view",
    [
        MachineView(record(), "WATCHING", 3),
        MachineView(record(address=None, ssh_port=None, agent_public_key=None, stuck_since=None), NO_WORKFLOW, 0),
    ],
)
def test_a_machine_document_reads_back_as_the_view_it_was(view: MachineView):
    assert view_from_json(machine_json(view)) == view


def test_a_status_document_reads_back_with_the_workflow_status_whole():
    status = MachineStatus(
        machine_id="6f1c7a52-0c6e-4c57-9d4b-2f1b8e0f4a11",
        provider="rack1",
        provider_id="node-0001",
        stage=MachineStage.RECOVERING,
        stage_since=AT.isoformat(),
        attempts=2,
        agent=AgentFacts(AT.isoformat(), "SHA256:agent", ["clock skew 3s"]),
        recovery_requested=RecoveryRequest("disks", "alice", RecoveryKind.FORCED),
    )
    detail = MachineDetail(record(), 1, "machine-rack1-node-0001", "RUNNING", status, None)
    assert detail_from_json(detail_json(detail)) == detail
    missing = MachineDetail(record(), 0, "machine-rack1-node-0001", "NOT STARTED", None, "no workflow has run")
    assert detail_from_json(detail_json(missing)) == missing


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"provider_id": None}, "field 'provider_id' must be a str"),
        ({"recoveries": True}, "field 'recoveries' must be a int"),
        ({"recoveries": -1}, "field 'recoveries' is a count"),
        ({"machine_id": "node-0001"}, "a machine id or agent key that does not read"),
        ({"agent_public_key": "not base64!"}, "a machine id or agent key that does not read"),
        ({"last_heartbeat_at": "yesterday"}, "field 'last_heartbeat_at' is no ISO 8601 time"),
    ],
)
def test_a_document_that_is_not_a_machine_is_refused_naming_the_field(change: dict[str, object], problem: str):
    document = machine_json(MachineView(record(), "WATCHING", 0)) | change
    with pytest.raises(DocumentError, match=problem):
        view_from_json(document)
    with pytest.raises(DocumentError, match="field 'stage' is missing"):
        view_from_json({k: v for k, v in machine_json(MachineView(record(), "WATCHING", 0)).items() if k != "stage"})
    with pytest.raises(DocumentError, match="a machine is a JSON object, got list"):
        view_from_json([])
