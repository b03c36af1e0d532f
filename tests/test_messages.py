"""The machine workflow's typed messages (lifecycle.contracts) read whatever JSON reaches them, through the data
converter every client, worker and replayer uses (foundation.temporal_payloads)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload

from foundation.operator_proof import Signature
from foundation.settings import Settings
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import (
    HeartbeatLost,
    MachineInput,
    MachineStage,
    MachineStatus,
    MaintenanceRequest,
    OperatorAction,
    OperatorRequest,
    RecoveryKind,
    RecoveryRequest,
)
from lifecycle.inputs import lifecycle_policy


def decoded(value: Any, hint: type) -> Any:
    """value as JSON on the wire, decoded for hint as a workflow's handler gets it."""
    payload = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())
    [result] = DATA_CONVERTER.payload_converter.from_payloads([payload], [hint])
    return result


def encoded(value: Any) -> Any:
    [payload] = DATA_CONVERTER.payload_converter.to_payloads([value])
    return json.loads(payload.data)


@pytest.mark.parametrize(
    ("sent", "request_"),
    [
        ({"reason": "disk errors", "by": "alice"}, RecoveryRequest("disk errors", "alice")),
        ({"reason": "  disk errors  "}, RecoveryRequest("disk errors")),
        ("smells of smoke", RecoveryRequest("smells of smoke")),
        # No reason: the recover update's validator refuses it, force_recover reads it with from_signal.
        ({"why": 3}, RecoveryRequest("")),
        (42, RecoveryRequest("unreadable reason '42'")),
        ({"reason": "x", "by": 7, "kind": "nonsense"}, RecoveryRequest("x", "unknown", RecoveryKind.FORCED)),
        # What statuses and continue-as-new inputs held before recoveries had a kind.
        ("heartbeat lost: at 10:00", RecoveryRequest("at 10:00", kind=RecoveryKind.HEARTBEAT_LOST)),
        ("forced: fan noise (by alice)", RecoveryRequest("fan noise (by alice)")),
    ],
)  # fmt: skip
def test_a_recovery_request_reads_every_shape_an_operator_or_an_older_shepherd_sends(sent, request_):
    assert decoded(sent, RecoveryRequest) == request_


def test_null_is_no_request_where_none_is_allowed_and_force_recover_reads_it_as_no_reason():
    assert decoded(None, RecoveryRequest | None) is None  # type: ignore[arg-type]
    assert decoded(None, OperatorRequest | None) is None  # type: ignore[arg-type]
    # force_recover reads its argument itself: an empty one still means "recover".
    assert RecoveryRequest.from_signal(None) == RecoveryRequest("no reason given")
    assert RecoveryRequest.from_signal({"why": 3}) == RecoveryRequest("unreadable reason \"{'why': 3}\"")


@pytest.mark.parametrize(
    "line",
    [
        "heartbeat lost: last heartbeat at 10:00",
        "forced: fan noise (by alice)",
        "forced: maintenance over, reboot asked by bob: fans",
    ],
)
def test_a_recovery_kept_before_recoveries_had_a_kind_is_described_as_it_was(line):
    assert decoded(line, RecoveryRequest).describe() == line


def test_a_recovery_is_described_by_its_kind_and_only_an_operators_escapes_the_budget():
    forced = RecoveryRequest("disk errors", "alice")
    lost = RecoveryRequest("last heartbeat at 10:00", "the watchdog", RecoveryKind.HEARTBEAT_LOST)
    maintenance = RecoveryRequest("fans", "bob", RecoveryKind.MAINTENANCE_OVER)
    assert forced.describe() == "forced: disk errors (by alice)" and forced.by_an_operator
    assert RecoveryRequest("disk errors").describe() == "forced: disk errors"
    assert lost.describe() == "heartbeat lost: last heartbeat at 10:00" and not lost.by_an_operator
    assert (
        maintenance.describe() == "forced: maintenance over, reboot asked by bob: fans" and maintenance.by_an_operator
    )


def test_a_typed_request_goes_on_the_wire_as_the_json_an_operator_types():
    assert encoded(RecoveryRequest("disk errors", "alice")) == {
        "reason": "disk errors",
        "by": "alice",
        "kind": "forced",
        "reimage": False,
        "proof": None,
    }
    assert encoded(OperatorRequest("end of lease", "carol")) == {
        "reason": "end of lease",
        "by": "carol",
        "proof": None,
        "force": False,
    }
    assert decoded({"reason": "end of lease", "force": True}, OperatorRequest) == OperatorRequest(
        "end of lease", force=True
    )
    assert decoded({"reason": "end of lease", "force": "yes"}, OperatorRequest).force is False
    assert decoded(encoded(MaintenanceRequest(True, "fans", "bob")), MaintenanceRequest) == MaintenanceRequest(
        True, "fans", "bob"
    )


@pytest.mark.parametrize(
    ("sent", "request_"),
    [
        ({"reason": "end of lease", "by": "carol"}, OperatorRequest("end of lease", "carol")),
        ("SSH fixed", OperatorRequest("SSH fixed")),
        ({"by": "carol"}, OperatorRequest("", "carol")),
        ({"reason": ["a list"], "by": "  "}, OperatorRequest("", "unknown")),
        ({"reason": "x" * 600, "by": "y" * 200}, OperatorRequest("x" * 500, "y" * 100)),
    ],
)
def test_an_operator_request_reads_what_was_sent_and_cuts_what_is_too_long(sent, request_):
    assert decoded(sent, OperatorRequest) == request_


def test_an_operator_request_without_a_reason_is_refused_asking_why():
    OperatorRequest("end of lease").require_reason("the machine is decommissioned")
    asking = 'say why the machine is decommissioned: {"reason": "...", "by": "..."}'
    with pytest.raises(ValueError, match=re.escape(asking)):
        decoded({"by": "carol"}, OperatorRequest).require_reason("the machine is decommissioned")


@pytest.mark.parametrize(
    ("sent", "refusal"),
    [
        ("fans", 'give {"on": true'),
        ({"reason": "fans"}, 'give {"on": true'),
        ({"on": "yes", "reason": "fans"}, 'give {"on": true'),
        ({"on": True}, "say why the machine goes into maintenance"),
        ({"on": True, "reason": "fans", "recover": True}, '"recover" (a reboot once maintenance ends) goes with'),
        ({"on": False, "recover": "please"}, '"recover" (a reboot once maintenance ends) goes with'),
    ],
)
def test_a_maintenance_request_that_says_no_clear_thing_is_refused_naming_what_is_wrong(sent, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        decoded(sent, MaintenanceRequest).check()


def test_the_end_of_a_maintenance_needs_no_reason():
    assert decoded({"on": False}, MaintenanceRequest).check() == MaintenanceRequest(False, "maintenance done")
    ended = decoded({"on": False, "recover": True, "reason": "fans replaced", "by": "bob"}, MaintenanceRequest)
    assert ended.check() == MaintenanceRequest(False, "fans replaced", "bob", True)


def test_heartbeat_lost_reads_the_cause_alone_as_older_watchdogs_sent_it():
    assert decoded("last heartbeat at 10:00", HeartbeatLost) == HeartbeatLost("last heartbeat at 10:00")
    assert decoded({"cause": "silent", "agent_key_fingerprint": "ab:cd"}, HeartbeatLost) == HeartbeatLost(
        "silent", "ab:cd"
    )
    assert decoded({"cause": 3, "agent_key_fingerprint": 4}, HeartbeatLost) == HeartbeatLost("no detail")


def test_a_continue_as_new_input_of_an_older_shepherd_hands_on_its_status_whole():
    older = {
        "provider": "sim",
        "provider_id": "node-0001",
        "machine_id": "m-1",
        "policy": encoded(lifecycle_policy(Settings())),
        "resume_stage": "AGENT_STARTING",
        "address": "10.0.0.1",
        "agent": None,
        "recovery_count": 2,
        "last_recovery_reason": "heartbeat lost: at 10:00",
        "recent_recoveries": [{"at": "2026-11-25T10:00:00+00:00", "reason": "heartbeat lost: at 10:00"}],
        "recent_actions": [{"at": "2026-11-25T09:00:00+00:00", "action": "release", "by": "bob", "reason": "fixed"}],
        "step": {"attempts": 7, "stage_since": "2026-11-25T11:00:00+00:00", "last_error": "SSH refused"},
        "recovery_requested": "forced: disk errors (by alice)",
        "replace_agent": None,
        "maintenance": None,
        "decommission": None,
    }
    carried = decoded(older, MachineInput)
    status = carried.status
    assert (status.stage, status.address, status.recovery_count) == (MachineStage.AGENT_STARTING, "10.0.0.1", 2)
    assert (status.attempts, status.stage_since, status.last_error) == (7, "2026-11-25T11:00:00+00:00", "SSH refused")
    assert [record.reason for record in status.recent_recoveries] == ["heartbeat lost: at 10:00"]
    assert [action.by for action in status.actions] == ["bob"]
    assert status.recovery_requested == RecoveryRequest("disk errors (by alice)")
    assert status.recovery_requested.describe() == "forced: disk errors (by alice)"
    assert decoded(encoded(carried), MachineInput) == carried


def test_a_first_run_input_of_an_older_shepherd_has_no_status_to_hand_on():
    older = {
        "provider": "sim",
        "provider_id": "node-0001",
        "machine_id": "m-1",
        "policy": encoded(lifecycle_policy(Settings())),
        "resume_stage": None,
        "recovery_count": 0,
        "recent_recoveries": [],
        "recent_actions": [],
    }
    assert decoded(older, MachineInput) == MachineInput("sim", "node-0001", "m-1", lifecycle_policy(Settings()))


def test_a_status_handed_on_keeps_the_machine_and_leaves_the_run_behind():
    status = MachineStatus(
        "m-1",
        "sim",
        "node-0001",
        MachineStage.AGENT_STARTING,
        "2026-11-25T11:00:00+00:00",
        attempts=50,
        last_error="SSH refused",
        next_attempt_at="2026-11-25T12:00:00+00:00",
        address="10.0.0.1",
        recovery_requested=RecoveryRequest("disk errors"),
        recovery_requests_coalesced=3,
    )
    failing = status.handed_on(MachineStage.AGENT_STARTING, failing_step=True)
    assert (failing.attempts, failing.last_error, failing.recovery_requested) == (
        50,
        "SSH refused",
        RecoveryRequest("disk errors"),
    )
    assert (failing.next_attempt_at, failing.recovery_requests_coalesced) == (None, 0)
    afresh = status.handed_on(MachineStage.WATCHING)
    assert (afresh.stage, afresh.stage_since, afresh.attempts, afresh.recovery_requested) == (
        MachineStage.WATCHING,
        "",
        0,
        None,
    )
    assert afresh.address == "10.0.0.1"
    afresh.actions.append(OperatorAction("now", "release", "bob", "fixed"))
    assert status.actions == [], "the lists are the next run's own"


def test_a_reimage_is_asked_with_a_flag_and_anything_else_is_a_reboot():
    assert decoded({"reason": "disk errors", "reimage": True}, RecoveryRequest).reimage
    for sent in ({"reason": "disk errors"}, {"reason": "x", "reimage": "yes"}, {"reimage": 1}, "disk errors"):
        assert not decoded(sent, RecoveryRequest).reimage, sent
    assert RecoveryRequest("disk errors", "alice", reimage=True).describe() == "forced reimage: disk errors (by alice)"


def test_a_recovery_request_carries_the_api_proof_through_the_wire_and_a_signal_drops_it():
    proof = Signature("key-1", "oidc", "2026-11-28T03:00:00+00:00", "c2lnbmVk")
    sent = RecoveryRequest("disk errors", "dave@example.com", reimage=True, proof=proof)
    assert decoded(encoded(sent), RecoveryRequest) == sent
    assert sent.credited() == "dave@example.com (verified: oidc)"
    assert sent.describe() == "forced reimage: disk errors (by dave@example.com (verified: oidc))"
    assert sent.signed() == {"reason": "disk errors", "reimage": True}
    # What force_recover reads of the same JSON: a signal has no validator, so whatever it carries is unverified.
    signalled = RecoveryRequest.from_signal(encoded(sent))
    assert signalled.proof is None and signalled.credited() == "dave@example.com (unverified)"
    assert signalled.describe() == "forced reimage: disk errors (by dave@example.com)"
    for broken in ({"key_id": "key-1"}, "a string", {**encoded(proof), "via": "o i d c"}):
        assert decoded({"reason": "x", "proof": broken}, RecoveryRequest).proof is None, broken
