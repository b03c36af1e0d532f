"""What machines, BMCs and providers say is cut and escaped where it enters: one bounded line everywhere it goes.

A hostile SSH server's disconnect reason and a BMC's error body (200 KB with line breaks and terminal escapes)
reach the BMDB event, the activity's failure and the machine's status only as one printable line of bounded
length; and the helper that cuts them gives such a line for any input.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncssh
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from bmdb.events import DETAIL_LIMIT
from bmdb.store import BMDB
from foundation.foreign_text import MIN_LIMIT, foreign_text
from lifecycle.contracts import MachineStage
from lifecycle.machine_text import MAX_FAILURE
from providers import MESSAGE_LIMIT, ProviderError
from providers.power import PowerTimeouts
from providers.redfish import RedfishEndpoint, RedfishPowerControl
from tests.sshd_fixtures import sshd_fixture  # noqa: F401 (a pytest fixture, used as `sshd`)
from tests.test_fuzz import FUZZ
from tests.test_static_machines import LAB, inventory_entry, lab_stack
from workflows.failures import describe_failure

# Line breaks, a colour, a title-setting OSC and a cursor move: what would forge log lines or rewrite a terminal.
HOSTILE = ("line\r\nforged: \x1b[31mred\x1b[0m \x1b]0;owned\x07\x1b[2J\u2028\x00" * 5000)[:200_000]


def one_bounded_line(text: str | None, limit: int) -> bool:
    return text is not None and len(text) <= limit and text.isprintable() and "\x1b" not in text


@FUZZ
@given(value=st.one_of(st.text(max_size=3000), st.binary(max_size=3000)), limit=st.integers(MIN_LIMIT, 1500))
def test_any_foreign_text_is_one_printable_line_within_its_limit(value, limit):
    line = foreign_text(value, limit)
    assert len(line) <= limit and line.isprintable()
    assert foreign_text(line, limit) == line, "quoting twice changes nothing"
    if isinstance(value, str) and value.isprintable() and len(value) <= limit:
        assert line == value, "printable text that fits comes back as it was"


def test_a_cut_says_how_much_was_cut_and_escapes_stay_visible():
    assert foreign_text("a\nb\x1b[31mc\td\x7f\u2028", 100) == "a\\nb\\x1b[31mc\\td\\x7f\\u2028"
    assert foreign_text("x" * 1000, 100) == "x" * 75 + "... [925 more chars cut]"
    assert foreign_text(b"\xffok\x1b", 100) == "\\xffok\\x1b"
    with pytest.raises(ValueError, match="at least 40"):
        foreign_text("x", 10)


class HostileSshServer(asyncssh.SSHServer):
    """A scripted SSH server (asyncssh) standing in for a hostile sshd: it completes the key exchange, then
    disconnects with HOSTILE as its reason, which OpenSSH's sshd cannot be made to send."""

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn

    def begin_auth(self, username: str) -> bool:
        self._conn.disconnect(asyncssh.DISC_BY_APPLICATION, HOSTILE)
        return True


@pytest.fixture
async def hostile_sshd() -> AsyncIterator[int]:
    key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.create_server(HostileSshServer, "127.0.0.1", 0, server_host_keys=[key])
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_a_hostile_disconnect_reason_reaches_event_failure_and_status_as_one_bounded_line(
    tmp_path, temporal_client, bmdb_url, bmdb: BMDB, sshd, hostile_sshd
):
    inventory = inventory_entry("hostile-01", sshd, []).replace(f":{sshd.port}", f":{hostile_sshd}")
    async with lab_stack(tmp_path, temporal_client, bmdb_url, sshd, {LAB: inventory}) as stack:
        await stack.run_pass(LAB)
        status = await stack.wait_for(
            LAB, "hostile-01", lambda s: s.last_error is not None and "SSH_ERROR" in s.last_error, "failing over SSH"
        )
        assert status.stage is MachineStage.AGENT_STARTING
        assert one_bounded_line(status.last_error, MAX_FAILURE) and "more chars cut]" in (status.last_error or "")
        assert "\\x1b[31mred" in (status.last_error or ""), "the escapes are shown, not dropped"
        [record] = await bmdb.machines_with_provider_id("hostile-01")
        failed = [e for e in await bmdb.list_events(record.machine_id, limit=20) if e.kind == "agent_start_failed"]
        assert failed and all(one_bounded_line(e.detail, DETAIL_LIMIT) for e in failed)
        assert "forged: " in (failed[0].detail or "") and "more chars cut]" in (failed[0].detail or "")
        # The activity's failure as Temporal keeps it in the history.
        history = await stack.machine(LAB, "hostile-01").fetch_history()
        failures = [
            event.activity_task_failed_event_attributes.failure.message
            for event in history.events
            if event.HasField("activity_task_failed_event_attributes")
        ]
        assert failures and all(one_bounded_line(message, 2 * DETAIL_LIMIT) for message in failures)


async def test_a_bmc_error_body_reaches_the_providers_error_as_one_bounded_line():
    """A fake Redfish BMC (an HTTP server answering every request with a Redfish error of HOSTILE), as no real
    BMC or sushy-emulator can be made to answer."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "Base.1.0.GeneralError", "message": HOSTILE}}, status=400)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        endpoint = RedfishEndpoint("hostile-01", f"http://127.0.0.1:{port}", "admin", "secret", verify=False)
        timeouts = PowerTimeouts(connect=5.0, read=5.0, graceful=1.0, power_back=1.0, poll=0.05)
        with pytest.raises(ProviderError) as caught:
            await asyncio.wait_for(RedfishPowerControl("lab", endpoint, timeouts).probe(), 30)
    finally:
        await runner.cleanup()
    message = str(caught.value)
    assert one_bounded_line(message, MESSAGE_LIMIT) and "more chars cut]" in message, message[:300]
    assert "\\x1b[31mred" in message and "hostile-01" in message


async def test_an_event_detail_is_kept_as_one_bounded_line(bmdb: BMDB):
    machine_id, _ = await bmdb.admit_machine("sim", f"node-{uuid.uuid4().hex[:8]}")
    await bmdb.add_event(machine_id, "agent_start_failed", HOSTILE)
    [event] = await bmdb.list_events(machine_id, limit=1)
    assert one_bounded_line(event.detail, DETAIL_LIMIT) and (event.detail or "").startswith("line\\r\\nforged: ")


def test_a_workflow_keeps_an_activity_failure_it_was_handed_uncut_as_one_bounded_line():
    # An activity that let a machine's words through whole: the status, which every continue-as-new carries on,
    # still keeps one bounded line of them.
    error = ActivityError(
        "activity task failed",
        scheduled_event_id=1,
        started_event_id=2,
        identity="worker",
        activity_type="start_agent",
        activity_id="1",
        retry_state=RetryState.NON_RETRYABLE_FAILURE,
    )
    error.__cause__ = ApplicationError(HOSTILE, type="SSH_ERROR")
    kept = describe_failure(error)
    assert one_bounded_line(kept, MAX_FAILURE) and kept.startswith("SSH_ERROR: line\\r\\nforged: ")
