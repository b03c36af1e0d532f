"""The commands through the operator API: with api_url set, `shepherd machines`, `status`, `maintenance` and the
others ask the API as the operator `shepherd login` logged in, print what they print straight to Temporal and BMDB,
and are recorded as that verified operator; --break-glass goes straight, recorded unverified."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from foundation.login_tokens import tokens_path
from foundation.ssh_sessions import host_key_fingerprint
from foundation.tls import CertificateAuthority
from lifecycle.contracts import MachineStage, fleet_schedule_id
from processes.worker import ensure_fleet_schedules
from tests.certificates import write_issued
from tests.fleet_stack import fleet_stack
from tests.oidc_fixtures import OidcProvider, oidc_fixture  # noqa: F401
from tests.operator_api_fixtures import api_keys, start_api
from tests.test_login import logged_in, login_env, login_settings

POLICY = """
[roles]
operator = [
    "read", "maintenance", "restart-agent", "recover", "fleet-pause", "fleet-resume", "release", "decommission",
    "reset-host-key",
]

[[grants]]
role = "operator"
groups = ["shepherd-admins", "rack1-operators"]

[confirmations]
second_person = ["decommission"]
typed = ["release"]
"""


async def test_commands_go_through_the_api_as_the_logged_in_operator(
    tmp_path, temporal_client, bmdb_url, oidc, shepherd_cli, capsys
):
    signer, policy_path, keys = api_keys(tmp_path, POLICY)
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=2, api_trusted_keys=keys) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.WATCHING)
        await ensure_fleet_schedules(stack.client, stack.settings)
        api, server, base = await start_api(stack, oidc, signer, policy_path, bmdb_url)
        config_home = tmp_path / "config"
        login = await logged_in(oidc, login_settings(oidc), tokens_path({"XDG_CONFIG_HOME": str(config_home)}), "alice")
        straight = stack.environment(bmdb_url)
        env = straight | login_env(oidc, config_home)
        env["SHEPHERD_API_URL"] = base
        try:
            # Reads: the same documents, whichever way.
            for command in (["machines", "--json"], ["status", "node-0001", "--json"]):
                code, through, err = await shepherd_cli(env, *command)
                assert code == 0, err
                code, direct, err = await shepherd_cli(env, *command, "--break-glass")
                assert code == 0, err
                assert "break glass: straight to Temporal and BMDB" in err
                assert json.loads(through) == json.loads(direct)
            code, out, _ = await shepherd_cli(env, "machines")
            assert code == 0 and out.splitlines()[1].startswith("node-0001      ") and "WATCHING" in out

            # An action: the same answer line, recorded as the operator the API verified.
            code, out, err = await shepherd_cli(env, "maintenance", "node-0001", "--on", "--reason", "fans")
            assert code == 0, err
            assert out == "machine-sim-node-0001: in maintenance (fans): never rebooted or taken over until it ends\n"
            machine = await stack.status("node-0001")
            assert machine.maintenance is not None and machine.maintenance.by == f"{login.subject} (verified: oidc)"
            code, out, err = await shepherd_cli(env, "status", "node-0001")
            assert code == 0 and f"set_maintenance by {login.subject} (verified: oidc)" in out

            # The workflow's refusal, the policy's, a flag the API does not take: each said, nothing done.
            code, _, err = await shepherd_cli(env, "maintenance", "node-0001", "--on", "--reason", "fans")
            assert code == 1 and "machine-sim-node-0001: already in maintenance" in err
            code, _, err = await shepherd_cli(env, "reimage", "node-0001", "--reason", "fresh disk")
            assert code == 1 and f"{login.subject} may not reimage" in err

            # An option of an action reaches the API: the fingerprint a host-key reset expects.
            [other] = await stack.deps.bmdb.machines_with_provider_id("node-0002")
            assert other.ssh_host_key is not None
            expect = host_key_fingerprint(other.ssh_host_key)
            reset = ["node-0002", "--reason", "new disk", "--expect-fingerprint", expect]
            code, out, err = await shepherd_cli(env, "reset-host-key", *reset)
            assert code == 0 and out.endswith(f"only a host key with fingerprint {expect} will be pinned\n"), err
            [other] = await stack.deps.bmdb.machines_with_provider_id("node-0002")
            assert (other.ssh_host_key, other.expected_host_key_fingerprint) == (None, expect)
            with pytest.raises(SystemExit) as usage:
                await shepherd_cli(env, "maintenance", "node-0001", "--off", "--by", "mallory")
            assert usage.value.code == 2 and "--by is not taken through the operator API" in capsys.readouterr().err
            code, _, err = await shepherd_cli(env, "status", "node-9999")
            assert code == 1 and "no machine 'node-9999'" in err

            # The event log, the fleet and a bulk action: the same output either way.
            for command in (["events", "node-0001"], ["events", "--actions"], ["events"], ["fleet", "--json"]):
                code, through, err = await shepherd_cli(env, *command)
                assert code == 0, (command, err)
                code, direct, _ = await shepherd_cli(env, *command, "--break-glass")
                assert through == direct, command
            code, out, err = await shepherd_cli(env, "fleet", "--pause", "--note", "cabling")
            assert code == 0, err
            assert out.startswith(f"paused the fleet schedule {fleet_schedule_id('sim')}: no passes until")
            assert f"PAUSED (cabling; by {login.subject} (verified: oidc))" in out
            code, out, err = await shepherd_cli(env, "fleet", "--resume")
            assert code == 0 and out.startswith(f"resumed the fleet schedule {fleet_schedule_id('sim')}"), err
            where = ["--where", "MachineStage = 'MAINTENANCE'", "--reason", "new agent"]
            code, out, err = await shepherd_cli(env, "restart-agent", *where, "--dry-run")
            assert code == 0 and out.endswith("machine-sim-node-0001\ndry run: nothing done\n"), err
            code, out, err = await shepherd_cli(env, "restart-agent", *where, "--yes")
            why = out.split("[1/1] machine-sim-node-0001: not done: ", 1)[1].split("\n", 1)[0]
            assert code == 1 and why.startswith(f"it is in maintenance, asked by {login.subject} (verified: oidc)"), out
            assert out.endswith(f"done: 0 of 1 succeeded, 1 did not:\n  machine-sim-node-0001: {why}\n")
            # The bound on a selection holds through the API too, and the API refuses a query that escapes.
            everyone = ["--where", "Provider = 'sim'", "--reason", "new agent", "--yes"]
            code, out, err = await shepherd_cli(env | {"SHEPHERD_BULK_MAX_MACHINES": "1"}, "restart-agent", *everyone)
            assert code == 1 and out.endswith("nothing done; give --max 2 to act on all of them\n"), err
            with pytest.raises(SystemExit) as usage:
                await shepherd_cli(env, "restart-agent", "--where", "x) OR (y", "--reason", "x", "--dry-run")
            assert usage.value.code == 2 and "closes a parenthesis it did not open" in capsys.readouterr().err

            # Break glass: straight to the workflow, recorded unverified under --by.
            code, out, err = await shepherd_cli(
                env, "maintenance", "node-0001", "--off", "--by", "oncall", "--break-glass"
            )
            assert code == 0, err
            assert (await stack.status("node-0001")).actions[-1].by == "oncall (unverified)"

            # What the policy asks typed back, and a second operator's approval, from the command line.
            code, _, err = await shepherd_cli(env, "release", "node-0001", "--reason", "mended")
            assert code == 1 and 'send "confirm": "node-0001" (the command takes it as --confirm)' in err
            code, _, err = await shepherd_cli(
                env, "release", "node-0001", "--reason", "mended", "--confirm", "node-0001"
            )
            assert code == 1 and "not quarantined" in err
            code, out, err = await shepherd_cli(env, "decommission", "node-0001", "--reason", "end of lease")
            assert code == 0 and "waits for a second operator allowed to decommission: approval " in out, err
            approval = out.split("approval ", 1)[1].split(",", 1)[0]
            code, out, _ = await shepherd_cli(env, "approvals")
            assert code == 0 and out.startswith(f"{approval}  decommission of node-0001, asked by {login.subject}")
            code, _, err = await shepherd_cli(env, "approvals", "--approve", approval)
            assert code == 1 and "a second operator decides it" in err
            bob_home = tmp_path / "bob"
            await logged_in(oidc, login_settings(oidc), tokens_path({"XDG_CONFIG_HOME": str(bob_home)}), "bob")
            code, out, err = await shepherd_cli(
                env | {"XDG_CONFIG_HOME": str(bob_home)}, "approvals", "--approve", approval
            )
            assert code == 0 and "decommission" in out, err
            # The decommission may be done already: its record is in the actions the status keeps.
            asked = (await stack.status("node-0001")).actions[-1]
            assert (asked.action, asked.by) == ("decommission", f"{login.subject} (verified: oidc)")
            assert asked.reason == "end of lease; approved by bob (verified: oidc)"

            # No login, or no API answering: said, with what to do.
            gone = env | {"XDG_CONFIG_HOME": str(tmp_path / "nobody")}
            code, _, err = await shepherd_cli(gone, "machines")
            assert code == 1 and "no token for the operator API" in err and "shepherd login" in err
            await server.close()
            code, _, err = await shepherd_cli(env, "machines")
            assert code == 1 and "cannot reach the operator API at" in err and "(api_url)" in err
        finally:
            await server.close()
            await api.close()


async def test_answers_that_are_no_api_answers_are_named(tmp_path: Path, shepherd_cli):
    """A server at api_url that is not a Shepherd API, or answers garbage: the command says what is wrong."""
    answers = {
        "/v1/machines": web.Response(text="<html>login page</html>", content_type="text/html"),
        "/v1/machines/node-0001": web.json_response({"provider": "sim"}),
        "/v1/machines/node-0002": web.json_response({"error": "the\nissuer\tis down"}, status=503),
        "/v1/machines/node-0003/restart-agent": web.json_response({"answered": "yes"}),
    }

    async def answer(request: web.Request) -> web.Response:
        return answers[request.path]

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    broken = tmp_path / "broken.pem"
    broken.write_text("not a certificate")
    api = {"SHEPHERD_API_URL": str(server.make_url(""))}
    env = api | {"SHEPHERD_API_CLIENT_CERTIFICATE_PATH": str(broken), "SHEPHERD_API_CLIENT_KEY_PATH": str(broken)}
    now = datetime.datetime.now(datetime.UTC)
    authority = CertificateAuthority("operators", now, now + datetime.timedelta(days=1))
    client = write_issued(tmp_path, "alice", authority.issue("alice", now, now + datetime.timedelta(days=1)))
    try:
        code, _, err = await shepherd_cli(env, "machines")
        assert code == 1 and "cannot be used" in err and "api_client_certificate_path" in err
        # A client certificate, which a plain-http server never asks for: the answers are all there is to see.
        env = api | {
            "SHEPHERD_API_CLIENT_CERTIFICATE_PATH": str(client.certificate),
            "SHEPHERD_API_CLIENT_KEY_PATH": str(client.key),
        }
        for command, problem in (
            (["machines"], "the operator API's answer to /v1/machines is not JSON (HTTP 200)"),
            (["status", "node-0001"], "answer to /v1/machines/node-0001 does not read: field 'machine_id' is missing"),
            (["status", "node-0002"], "the issuer is down"),
            (["restart-agent", "node-0003", "--reason", "r"], 'has no "answer" line'),
        ):
            code, _, err = await shepherd_cli(env, *command)
            assert code == 1 and problem in err, (command, err)
    finally:
        await server.close()
