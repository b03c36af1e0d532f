"""Recover, reimage, retry and reset-host-key through the operator API: each allowed by its own permission and
recorded with the verified operator; the recover update refuses a proof that does not check, while the
force_recover signal sent straight to Temporal still recovers, recorded unverified. On a real OIDC provider and a
real simulated fleet with its worker, Temporal and PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from temporalio.client import WorkflowUpdateFailedError

from foundation.operator_proof import ProofSigner
from foundation.ssh_sessions import host_key_fingerprint
from lifecycle.contracts import (
    FORCE_RECOVER_SIGNAL,
    RECOVER_UPDATE,
    RETRY_UPDATE,
    MachineStage,
    MachineStatus,
    OperatorRequest,
    RecoveryRequest,
)
from operations.machine_names import resolve_machine
from tests.fleet_stack import FleetStack, fleet_stack
from tests.oidc_fixtures import CI_CLIENT, OidcProvider, oidc_fixture  # noqa: F401
from tests.operator_api_fixtures import api_keys, start_api
from tests.test_machine_lifecycle import SEED_POLICY, FakeMachineActivities, machine_worker, start_machine
from tests.test_operator_api import call, viewer_token
from workflows.machine import MachineWorkflow

# The operator may recover, retry and reset host keys, but not reimage; a reimage needs a grant of its own.
POLICY = f"""
[roles]
operator = ["read", "recover", "retry", "reset-host-key"]
reimager = ["reimage"]

[[grants]]
role = "operator"
subjects = ["{CI_CLIENT}"]

[[grants]]
role = "reimager"
groups = ["shepherd-reimagers"]
"""
VERIFIED = f"{CI_CLIENT} (verified: oidc)"


async def events(stack: FleetStack, provider_id: str, kind: str) -> list[str]:
    """The details of the machine's events of kind in BMDB's log, oldest first."""
    machine_id = uuid.UUID((await stack.status(provider_id)).machine_id)
    return [e.detail for e in reversed(await stack.deps.bmdb.list_events(machine_id)) if e.kind == kind]


async def recovered(stack: FleetStack, provider_id: str, count: int, limit: float = 60.0) -> MachineStatus:
    """The machine's status once it is WATCHING again after its count-th recovery."""
    deadline = asyncio.get_running_loop().time() + limit
    while True:
        status = await stack.status(provider_id)
        if status.recovery_count >= count and status.stage is MachineStage.WATCHING:
            return status
        assert asyncio.get_running_loop().time() < deadline, f"{provider_id} not recovered {count} time(s): {status}"
        await asyncio.sleep(0.2)


def reimager_token(oidc: OidcProvider) -> str:
    return viewer_token(oidc, sub="rita", groups=["shepherd-reimagers"])


async def test_recover_reimage_retry_and_reset_host_key_through_the_api_are_verified_and_forgeries_refused(
    tmp_path, temporal_client, bmdb_url, oidc
):
    signer, policy_path, keys = api_keys(tmp_path, POLICY)
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=2, api_trusted_keys=keys) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.WATCHING)

        # Straight to Temporal: an update whose proof does not check recovers nothing.
        handle = stack.machine("node-0001")
        asked = RecoveryRequest("disk errors", CI_CLIENT)

        def proof(signing: ProofSigner, workflow_id: str) -> RecoveryRequest:
            signature = signing.sign(
                workflow_id=workflow_id,
                action=RECOVER_UPDATE,
                by=asked.by,
                via="oidc",
                issued_at=datetime.now(UTC),
                request=asked.signed(),
            )
            return dataclasses.replace(asked, proof=signature)

        for forged, refusal in (
            (proof(ProofSigner.generate(), handle.id), "does not trust"),
            (proof(signer, stack.machine("node-0002").id), "does not match"),
            (dataclasses.replace(proof(signer, handle.id), reimage=True), "does not match"),
            (RecoveryRequest("", "mallory"), "say why the machine is recovered"),
        ):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update(RECOVER_UPDATE, forged, result_type=str)
            assert refusal in str(refused.value.cause), forged
        status = await stack.status("node-0001")
        assert (status.stage, status.recovery_requested, status.actions) == (MachineStage.WATCHING, None, [])

        api, server, base = await start_api(stack, oidc, signer, policy_path, bmdb_url)
        operator = await oidc.access_token(CI_CLIENT)
        try:
            async with aiohttp.ClientSession() as http:

                async def post(token: str, path: str, reason: str) -> tuple[int, dict[str, str]]:
                    code, body, _ = await call(http, base, "POST", f"/v1/machines/{path}", token, {"reason": reason})
                    return code, body

                # Nothing fails: a retry is refused with the workflow's reason.
                assert await post(operator, "node-0001/retry", "cable fixed") == (
                    409,
                    {"error": "machine-sim-node-0001: no step is failing: it is WATCHING"},
                )

                # A host-key reset is credited to the verified operator; with no step failing, none is retried.
                record = await resolve_machine(stack.deps.bmdb, "node-0001")
                assert record.ssh_host_key is not None
                fingerprint = host_key_fingerprint(record.ssh_host_key)
                code, body = await post(operator, "node-0001/reset-host-key", "new disk")
                assert code == 200, body
                assert body["answer"] == (
                    f"node-0001: host key pin {fingerprint} reset (new disk); machine-sim-node-0001 did not retry "
                    "(no step is failing: it is WATCHING), at its next takeover the first host key to answer will be "
                    "pinned, and a host_key_pinned event will name it"
                )
                assert await events(stack, "node-0001", "host_key_reset") == [
                    f"by {VERIFIED}: new disk; was {fingerprint}"
                ]

                # It may name the fingerprint the next key must have, checked for its shape; the recovery below
                # takes the machine over again, showing that key.
                reset = "/v1/machines/node-0001/reset-host-key"
                for bad, error in (
                    ("MD5:00:11", "'MD5:00:11' is no SHA256 host key fingerprint"),
                    (f"{fingerprint}=", "is no SHA256 host key fingerprint"),
                    (7, "must be a string"),
                ):
                    code, body, _ = await call(
                        http, base, "POST", reset, operator, {"reason": "new disk", "expect_fingerprint": bad}
                    )
                    assert code == 400 and body["error"].startswith("field 'expect_fingerprint'"), body
                    assert error in body["error"], body
                expecting = {"reason": "on the console", "expect_fingerprint": fingerprint}
                code, body, _ = await call(http, base, "POST", reset, operator, expecting)
                assert code == 200, body
                assert body["answer"] == (
                    "node-0001: no host key pinned; the expectation reset (on the console); machine-sim-node-0001 did "
                    "not retry (no step is failing: it is WATCHING), at its next takeover only a host key with "
                    f"fingerprint {fingerprint} will be pinned"
                )
                assert (await resolve_machine(stack.deps.bmdb, "node-0001")).expected_host_key_fingerprint == (
                    fingerprint
                )
                assert (await events(stack, "node-0001", "host_key_reset"))[-1] == (
                    f"by {VERIFIED}: on the console; was none pinned; expecting {fingerprint}"
                )

                # A recovery answers as `shepherd recover` prints it, and is recorded verified everywhere.
                code, body = await post(operator, "node-0001/recover", "disk errors")
                assert (code, body) == (
                    200,
                    {"answer": "machine-sim-node-0001: recovery requested (disk errors); it was WATCHING"},
                )
                assert await events(stack, "node-0001", "recovery_forced") == [f"by {VERIFIED}: disk errors"]

                # A reimage needs the reimage permission, which recover does not give.
                code, body = await post(operator, "node-0002/reimage", "fresh disk")
                assert code == 403 and body["error"].startswith(f"{CI_CLIENT} may not reimage"), body
                assert await post(reimager_token(oidc), "node-0002/reimage", "fresh disk") == (
                    200,
                    {
                        "answer": "machine-sim-node-0002: reimage requested (fresh disk); it was WATCHING; a provider "
                        "that cannot reimage reboots it instead"
                    },
                )
                assert await events(stack, "node-0002", "reimage_forced") == ["by rita (verified: oidc): fresh disk"]
        finally:
            await server.close()
            await api.close()

        status = await recovered(stack, "node-0001", 1)
        assert status.last_recovery_reason == f"forced: disk errors (by {VERIFIED})"
        assert [(a.action, a.by) for a in status.actions] == [(RECOVER_UPDATE, VERIFIED)]
        # The takeover after it pinned the key with the fingerprint the reset named, and said so.
        assert (await events(stack, "node-0001", "host_key_pinned"))[-1] == (
            f"host key {fingerprint} pinned at first contact"
        )
        assert (await resolve_machine(stack.deps.bmdb, "node-0001")).expected_host_key_fingerprint is None
        assert (await recovered(stack, "node-0002", 1)).last_recovery_reason == (
            "forced reimage: fresh disk (by rita (verified: oidc))"
        )

        # The signal the Temporal UI sends still recovers, recorded unverified whatever it carries.
        signalled = dataclasses.asdict(proof(signer, stack.machine("node-0002").id))
        await stack.machine("node-0002").signal(FORCE_RECOVER_SIGNAL, {**signalled, "reason": "by hand"})
        status = await recovered(stack, "node-0002", 2)
        assert status.last_recovery_reason == f"forced: by hand (by {CI_CLIENT})"
        assert [(a.action, a.by) for a in status.actions][-1] == (FORCE_RECOVER_SIGNAL, f"{CI_CLIENT} (unverified)")
        assert (await events(stack, "node-0002", "recovery_forced"))[-1] == f"by {CI_CLIENT} (unverified): by hand"


async def test_the_retry_update_ends_a_back_off_answering_which_step_and_refuses_when_none_fails(time_skipping_env):
    env = time_skipping_env
    fakes = FakeMachineActivities(agent_failures=1)
    async with machine_worker(env, fakes, "retry-update") as queue:
        handle = await start_machine(env, queue, SEED_POLICY)
        await env.sleep(timedelta(seconds=1))
        # The seed's back-off is 5 minutes, which no time skipped here reaches: only the retry brings the second
        # attempt.
        with env.auto_time_skipping_disabled():
            request = OperatorRequest("cable fixed", "alice")
            answer = await handle.execute_update(RETRY_UPDATE, request, result_type=str)
            assert answer == "retrying now (cable fixed): it is AGENT_STARTING, failed 1 time(s)"
            status = await handle.query(MachineWorkflow.status)
            for _ in range(50):
                if status.stage is MachineStage.WATCHING:
                    break
                await asyncio.sleep(0.1)
                status = await handle.query(MachineWorkflow.status)
        assert status.stage is MachineStage.WATCHING and len(fakes.agent_attempt_times) == 2
        assert [(a.action, a.by, a.reason) for a in status.actions] == [
            (RETRY_UPDATE, "alice (unverified)", "cable fixed")
        ]
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(RETRY_UPDATE, OperatorRequest("again", "alice"), result_type=str)
        assert str(refused.value.cause).endswith(": no step is failing: it is WATCHING")
        await handle.terminate()
