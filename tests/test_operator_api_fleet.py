"""The operator API's fleet schedules, event log, event stream and bulk requests, as the policy allows; on a real
OIDC provider, a real simulated fleet of three machines with its worker, Temporal and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from lifecycle.contracts import MachineStage
from processes.worker import ensure_fleet_schedules
from tests.fleet_stack import fleet_stack
from tests.oidc_fixtures import CI_CLIENT, OidcProvider, oidc_fixture  # noqa: F401
from tests.operator_api_fixtures import api_keys, start_api
from tests.test_operator_api import call, viewer_token

MACHINES = ["node-0001", "node-0002", "node-0003"]

POLICY = f"""
[roles]
viewer = ["read", "events-stream"]
operator = ["read", "events-stream", "maintenance", "restart-agent", "fleet-pause", "fleet-resume"]

[[grants]]
role = "operator"
subjects = ["{CI_CLIENT}"]
providers = ["sim"]

[[grants]]
role = "viewer"
subjects = ["vera"]

[[grants]]
role = "operator"
subjects = ["rita"]
providers = ["rack2"]

[[grants]]
role = "operator"
subjects = ["wanda"]
where = "ProviderId = 'node-0002'"

[confirmations]
bulk_confirm_over = 2
"""


async def next_record(lines: aiohttp.StreamReader) -> dict[str, str]:
    """The next server-sent event's fields, comments skipped."""
    fields: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(lines.readline(), 30)).decode().rstrip("\n")
        if not line:
            if fields:
                return fields
            continue
        if not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


async def test_fleet_events_stream_and_bulk_through_the_api(tmp_path, temporal_client, bmdb_url, oidc, shepherd_cli):
    signer, policy_path, keys = api_keys(tmp_path, POLICY)
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=3, api_trusted_keys=keys) as stack:
        await stack.run_pass()
        # The schedule the API pauses and resumes.
        await ensure_fleet_schedules(stack.client, stack.settings)
        await stack.wait_for_stage(MACHINES, MachineStage.WATCHING)
        api, server, base = await start_api(stack, oidc, signer, policy_path, bmdb_url)
        operator = await oidc.access_token(CI_CLIENT)
        viewer, rita, wanda = (viewer_token(oidc, sub=name, groups=[]) for name in ("vera", "rita", "wanda"))
        env = stack.environment(bmdb_url)
        try:
            async with aiohttp.ClientSession() as http:

                async def api_call(method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
                    status, answer, _ = await call(http, base, method, path, token, body)
                    return status, answer

                # Fleet: a grant of another provider may not pause this one; the operator's pause is credited to
                # the verified subject, in BMDB's log and the schedule's note.
                status, body = await api_call("POST", "/v1/fleet/sim/pause", rita, {"note": "x"})
                assert status == 403 and body["error"].startswith("rita may not pause the fleet of provider sim")
                status, body = await api_call("POST", "/v1/fleet/rack9/pause", operator, {})
                assert status == 404 and "no provider instance 'rack9'" in body["error"]
                status, body = await api_call("POST", "/v1/fleet/sim/pause", operator, {"note": "rack move"})
                assert status == 200, body
                assert body["providers"][0]["schedule"]["paused"] is True
                assert f"by {CI_CLIENT} (verified: oidc)" in body["providers"][0]["schedule"]["note"]
                # Compared while paused: no pass starts between the two reads.
                code, out, _ = await shepherd_cli(env, "fleet", "--json")
                status, body = await api_call("GET", "/v1/fleet", viewer)
                assert code == 0 and status == 200 and body == json.loads(out)
                status, body = await api_call("POST", "/v1/fleet/sim/resume", operator, {"note": "done"})
                assert status == 200 and body["providers"][0]["schedule"]["paused"] is False
                status, body = await api_call("GET", "/v1/events?actions=true", viewer)
                assert status == 200
                fleet_log = [(e["kind"], e["detail"]) for e in body["events"]]
                assert fleet_log[:2] == [
                    ("fleet_resumed", f"provider sim: by {CI_CLIENT} (verified: oidc): done"),
                    ("fleet_paused", f"provider sim: by {CI_CLIENT} (verified: oidc): rack move"),
                ]
                code, out, _ = await shepherd_cli(env, "events", "--actions", "--json")
                assert code == 0 and body == json.loads(out)

                # Events: a machine's as the command prints them; a scoped operator sees its machine's alone.
                status, body = await api_call("GET", "/v1/machines/node-0001/events", viewer)
                code, out, _ = await shepherd_cli(env, "events", "node-0001", "--json")
                assert code == 0 and status == 200 and body == json.loads(out) and body["events"]
                status, body = await api_call("GET", "/v1/events?limit=1000", wanda)
                assert status == 200 and {e["provider_id"] for e in body["events"]} == {"node-0002"}
                status, body = await api_call("GET", "/v1/events?limit=1000&provider=sim", viewer)
                assert {e["provider_id"] for e in body["events"]} == set(MACHINES)

                # Stream: a new event as it comes; a reconnect with Last-Event-ID gets only what came after it.
                headers = {"Authorization": f"Bearer {viewer}"}
                status, body, _ = await call(http, base, "GET", "/v1/events/stream", None)
                assert status == 401
                async with http.get(base + "/v1/events/stream", headers=headers | {"Last-Event-ID": "x1"}) as bad:
                    assert bad.status == 400 and "Last-Event-ID must be" in (await bad.json())["error"]
                async with http.get(base + "/v1/events/stream", headers=headers) as stream:
                    assert stream.status == 200 and stream.headers["Content-Type"] == "text/event-stream"
                    await stack.deps.bmdb.add_event(None, "fleet_triggered", "first")
                    first = await next_record(stream.content)
                    assert first["event"] == "fleet_triggered" and json.loads(first["data"])["detail"] == "first"
                await stack.deps.bmdb.add_event(None, "fleet_triggered", "second")
                await stack.deps.bmdb.add_event(None, "fleet_triggered", "third")
                async with http.get(
                    base + "/v1/events/stream", headers=headers | {"Last-Event-ID": first["id"]}
                ) as stream:
                    again = [await next_record(stream.content), await next_record(stream.content)]
                assert [json.loads(r["data"])["detail"] for r in again] == ["second", "third"]
                assert [int(r["id"]) for r in again] == [int(first["id"]) + 1, int(first["id"]) + 2]

                # Bulk: bad input; a dry run does nothing; past bulk_confirm_over the count is typed back.
                bulk = {"where": "MachineStage = 'WATCHING'", "on": True, "reason": "rack move"}
                status, body = await api_call("POST", "/v1/bulk/reboot-all", operator, bulk)
                assert status == 400 and "no bulk action 'reboot-all'" in body["error"]
                status, body = await api_call("POST", "/v1/bulk/maintenance", operator, bulk | {"where": "Nope = 1"})
                assert status == 400 and "is not a query Temporal accepts" in body["error"], body
                status, body = await api_call("POST", "/v1/bulk/maintenance", operator, bulk | {"dry_run": True})
                assert status == 200 and body["count"] == 3 and body["results"] == [] and body["confirm_needed"] == 3
                assert [(await stack.status(m)).maintenance for m in MACHINES] == [None] * 3
                status, body = await api_call("POST", "/v1/bulk/maintenance", operator, bulk)
                assert status == 428 and body["error"].endswith('send the same request with "confirm": 3')
                status, body = await api_call("POST", "/v1/bulk/maintenance", operator, bulk | {"confirm": 2})
                assert status == 428 and "2 was typed, which is not the count now" in body["error"]
                assert [(await stack.status(m)).maintenance for m in MACHINES] == [None] * 3
                # A scoped grant's where narrows the caller's: one machine, no confirmation needed.
                status, body = await api_call("POST", "/v1/bulk/maintenance", wanda, bulk | {"dry_run": True})
                assert status == 200 and [m["provider_id"] for m in body["machines"]] == ["node-0002"]
                assert body["confirm_needed"] is None
                status, body = await api_call("POST", "/v1/bulk/maintenance", operator, bulk | {"confirm": 3})
                assert status == 200 and body["summary"] == "done: 3 of 3 succeeded", body
                assert [r["outcome"] for r in body["results"]] == ["done"] * 3
                for machine in MACHINES:
                    maintenance = (await stack.status(machine)).maintenance
                    assert maintenance is not None and maintenance.by == f"{CI_CLIENT} (verified: oidc)"
        finally:
            await server.close()
            await api.close()
