"""Operator requests that carry the operator API's proof are recorded as verified; a forged or copied proof is
refused by the workflow; a deployment may refuse destructive requests sent straight to Temporal."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError

from foundation.operator_proof import (
    OperatorTrust,
    ProofRefused,
    ProofSigner,
    Signature,
    TrustedKeys,
    install_trust,
    public_key_text,
)
from foundation.setting_values import SettingsError
from foundation.settings import UNVERIFIED_OPERATOR_ACTIONS, Settings
from lifecycle.contracts import (
    DECOMMISSION_UPDATE,
    RELEASE_UPDATE,
    SET_MAINTENANCE_UPDATE,
    MachineStage,
    MaintenanceRequest,
    OperatorRequest,
    credited,
)
from operations.attestation import Attestation
from operations.client import OperatorClient
from operations.machine_actions import OperatorRefused
from tests.fleet_stack import fleet_stack
from tests.test_machine_lifecycle import FakeMachineActivities, machine_worker, watching_machine
from workflows.machine import MachineWorkflow

API = ProofSigner.generate()
NOW = datetime(2026, 11, 28, 3, 0, tzinfo=UTC)
REQUEST = {"reason": "end of lease"}


def signed(signer: ProofSigner = API, **changes: object) -> Signature:
    fields: dict[str, object] = {
        "workflow_id": "machine-sim-node-0001",
        "action": DECOMMISSION_UPDATE,
        "by": "dave@example.com",
        "via": "oidc",
        "issued_at": NOW,
        "request": REQUEST,
    }
    fields.update(changes)
    return signer.sign(**fields)  # type: ignore[arg-type]


def check(proof: Signature, **changes: object) -> None:
    fields: dict[str, object] = {
        "workflow_id": "machine-sim-node-0001",
        "action": DECOMMISSION_UPDATE,
        "by": "dave@example.com",
        "request": REQUEST,
        "now": NOW + timedelta(seconds=5),
    }
    fields.update(changes)
    TrustedKeys.parse(public_key_text(API.public_key)).check(proof, **fields)  # type: ignore[arg-type]


def test_a_proof_checks_for_the_request_it_was_signed_for_and_no_other():
    check(signed())
    for change, value in (
        ("workflow_id", "machine-sim-node-0002"),
        ("action", RELEASE_UPDATE),
        ("by", "mallory"),
        ("request", {"reason": "something else"}),
    ):
        with pytest.raises(ProofRefused, match="does not match this request"):
            check(signed(), **{change: value})
    # The way the API verified the operator is signed too.
    with pytest.raises(ProofRefused, match="does not match"):
        check(dataclasses.replace(signed(), via="certificate"))


@pytest.mark.parametrize(
    ("proof", "now", "refusal"),
    [
        (signed(ProofSigner.generate()), NOW, "which this worker does not trust"),
        (signed(), NOW + timedelta(minutes=6), "more than 300s ago"),
        (signed(), NOW - timedelta(minutes=2), "ahead of this worker's clock"),
        (dataclasses.replace(signed(), signature="not base64!"), NOW, "malformed"),
        (dataclasses.replace(signed(), issued_at="yesterday"), NOW, "malformed"),
        (dataclasses.replace(signed(), issued_at="2026-11-28T03:00:00"), NOW, "no time zone"),
        (dataclasses.replace(signed(), signature=signed(issued_at=NOW).signature[:-4] + "AAA="), NOW, "does not match"),
    ],
)
def test_a_proof_that_does_not_check_is_refused_saying_why(proof: Signature, now: datetime, refusal: str):
    with pytest.raises(ProofRefused, match=refusal) as refused:
        check(proof, now=now)
    assert proof.signature not in str(refused.value)


def test_trusted_keys_are_read_from_the_setting_and_a_bad_one_is_named():
    other = ProofSigner.generate()
    both = TrustedKeys.parse(f" {public_key_text(API.public_key)} , {public_key_text(other.public_key)},")
    assert set(both.keys) == {API.key_id, other.key_id}, "two keys during a rotation"
    assert TrustedKeys.parse("").keys == {}
    for text, problem in (
        ("rsa:AAAA", "key 1 does not begin with 'ed25519:'"),
        (f"{public_key_text(API.public_key)},ed25519:!!!", "key 2 is not base64"),
        ("ed25519:AAAA", "key 1 is 3 bytes long; an ed25519 public key is 32"),
    ):
        with pytest.raises(ValueError, match=problem):
            TrustedKeys.parse(text)


def test_the_settings_name_a_bad_trust_and_refuse_only_the_destructive_updates():
    assert UNVERIFIED_OPERATOR_ACTIONS["refuse_destructive"] == {DECOMMISSION_UPDATE, RELEASE_UPDATE}
    assert Settings().check().operator_trust() == OperatorTrust(), "by default every request is taken, unverified"
    keys = public_key_text(API.public_key)
    trust = Settings(api_trusted_keys=keys, unverified_operator_actions="refuse_destructive").check().operator_trust()
    assert set(trust.keys.keys) == {API.key_id} and trust.refuse_unverified == {"decommission", "release"}
    for changes, setting in (
        ({"api_trusted_keys": "ed25519:AAAA"}, "api_trusted_keys"),
        ({"unverified_operator_actions": "refuse_all"}, "unverified_operator_actions"),
        ({"unverified_operator_actions": "refuse_destructive"}, "unverified_operator_actions"),
    ):
        with pytest.raises(SettingsError) as refused:
            Settings(**changes).check()  # type: ignore[arg-type]
        assert refused.value.setting == setting


def test_who_asked_is_marked_verified_only_with_a_proof_and_cannot_be_typed_to_look_verified():
    assert credited("alice", None) == "alice (unverified)"
    assert credited("alice", "oidc") == "alice (verified: oidc)"
    forged = OperatorRequest.from_wire({"reason": "x", "by": "mallory (verified: oidc)\nmore"})
    assert forged.proof is None and credited(forged.by, None) == "mallory verified: oidc more (unverified)"
    # A proof that is no proof at all makes an unverified request, which the validator may refuse.
    for proof in ({"key_id": "k"}, "a string", {"key_id": "k", "via": "o i d c", "issued_at": "t", "signature": "s"}):
        assert OperatorRequest.from_wire({"reason": "x", "by": "alice", "proof": proof}).proof is None
    sent = dataclasses.asdict(OperatorRequest("x", "alice", signed()))
    assert OperatorRequest.from_wire(sent).proof == signed()


TRUST = OperatorTrust(
    TrustedKeys.parse(public_key_text(API.public_key)), frozenset({DECOMMISSION_UPDATE, RELEASE_UPDATE})
)


async def test_the_workflow_refuses_a_forged_or_unverified_decommission_and_records_a_verified_one(
    time_skipping_env,
):
    env = time_skipping_env
    fakes = FakeMachineActivities()
    async with machine_worker(env, fakes, "verified") as queue:
        install_trust(queue, TRUST)
        handle = await watching_machine(env, fakes, queue)
        now = await env.get_current_time()

        async def decommission(request: OperatorRequest) -> str:
            return await handle.execute_update(MachineWorkflow.decommission, request)

        def proof_for(request: OperatorRequest, signer: ProofSigner = API, workflow_id: str = handle.id) -> Signature:
            return signer.sign(
                workflow_id=workflow_id,
                action=DECOMMISSION_UPDATE,
                by=request.by,
                via="oidc",
                issued_at=now,
                request=request.signed(),
            )

        asked = OperatorRequest("end of lease", "dave@example.com")
        for request, refusal in (
            (asked, "decommission is refused unless it comes through the operator API"),
            (dataclasses.replace(asked, proof=proof_for(asked, ProofSigner.generate())), "does not trust"),
            (dataclasses.replace(asked, proof=proof_for(asked, workflow_id="machine-sim-other")), "does not match"),
            (dataclasses.replace(asked, by="mallory", proof=proof_for(asked)), "does not match"),
            (dataclasses.replace(asked, force=True, proof=proof_for(asked)), "does not match"),
        ):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await decommission(request)
            assert refusal in str(refused.value.cause)

        # Maintenance is no destructive request: taken unverified, and marked so.
        await handle.execute_update(MachineWorkflow.set_maintenance, MaintenanceRequest(True, "fans", "carol"))
        status = await handle.query(MachineWorkflow.status)
        assert status.maintenance is not None and status.maintenance.by == "carol (unverified)"

        # carol's maintenance stands: the decommission is refused naming it, and goes with force.
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await decommission(dataclasses.replace(asked, proof=proof_for(asked)))
        assert "it is in maintenance, asked by carol (unverified)" in str(refused.value.cause)
        forced = dataclasses.replace(asked, force=True)
        answer = await decommission(dataclasses.replace(forced, proof=proof_for(forced)))
        assert answer.startswith("decommissioning (end of lease)")
        result = await handle.result()
        assert result.by == "dave@example.com (verified: oidc)"


async def test_the_operator_client_of_a_verified_operator_signs_what_it_sends(tmp_path, temporal_client, bmdb_url):
    keys = public_key_text(API.public_key)
    settings: dict[str, Any] = {"api_trusted_keys": keys, "unverified_operator_actions": "refuse_destructive"}
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1, **settings) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        verified = Attestation("alice@example.com", "oidc", API)
        async with (
            OperatorClient(stack.settings, temporal=stack.client, database_url=bmdb_url, attestation=verified) as api,
            OperatorClient(stack.settings, temporal=stack.client, database_url=bmdb_url) as by_hand,
        ):
            # By hand, straight to Temporal: refused by the worker's own settings.
            with pytest.raises(OperatorRefused, match="refused unless it comes through the operator API"):
                await by_hand.ask(
                    "node-0001", DECOMMISSION_UPDATE, OperatorRequest("end of lease", "alice"), then="decommission it"
                )
            request = MaintenanceRequest(True, "  fans  ", "whoever the caller says")
            answer = await api.ask("node-0001", SET_MAINTENANCE_UPDATE, request, then="try again")
        assert answer.endswith("in maintenance (fans): never rebooted or taken over until it ends")
        status = await stack.status("node-0001")
        assert status.maintenance is not None and status.maintenance.by == "alice@example.com (verified: oidc)"
        assert [(a.action, a.by) for a in status.actions] == [
            (SET_MAINTENANCE_UPDATE, "alice@example.com (verified: oidc)")
        ]
