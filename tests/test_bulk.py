"""--where: one action on every machine a visibility query selects, through the CLI on the embedded stack."""

from __future__ import annotations

import io
import sys

import pytest

from lifecycle.contracts import MachineStage, OperatorRequest
from processes.operator_api_bulk import bulk_request
from processes.operator_api_errors import ApiError
from tests.fleet_stack import fleet_stack
from tests.test_decommission import decommissioned
from tests.test_recovery import WATCH, wait_for

ALL = ["node-0001", "node-0002", "node-0003", "node-0004"]


async def test_an_action_on_every_machine_a_query_selects(
    tmp_path, temporal_client, bmdb_url, bmdb, shepherd_cli, monkeypatch, capsys
):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=4, heartbeats=True, **WATCH) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(ALL, MachineStage.WATCHING)

        async def shepherd(*args: str, answer: str | None = None) -> tuple[int, str, str]:
            if answer is not None:
                monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
            # Three at most on --yes alone, so the four machines are a selection larger than meant.
            return await shepherd_cli(stack.environment(bmdb_url) | {"SHEPHERD_BULK_MAX_MACHINES": "3"}, *args)

        async def listed(where: str) -> bool:
            # Visibility follows the workflows' search attributes a moment later.
            code, out, _ = await shepherd("maintenance", "--where", where, "--on", "--reason", "x", "--dry-run")
            return code == 0 and out.startswith("4 machine(s)")

        await wait_for(lambda: listed('MachineStage = "WATCHING"'), what="four WATCHING in visibility")
        code, out, err = await shepherd(
            "maintenance", "--where", 'MachineStage = "WATCHING"', "--on", "--reason", "rack move", "--dry-run"
        )
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == "4 machine(s) match --where 'MachineStage = \"WATCHING\"':"
        assert [line.split()[0] for line in lines[1:5]] == ALL and lines[-1] == "dry run: nothing done"

        # More than bulk_max_machines: neither --yes nor an answer is enough, and --max must cover the count.
        watching = ["maintenance", "--where", 'MachineStage = "WATCHING"', "--on", "--reason", "rack move"]
        code, out, err = await shepherd(*watching, "--yes")
        assert code == 1, err
        assert out.splitlines()[-1] == (
            "4 machines are more than bulk_max_machines (3), which --yes or an answer alone may touch: "
            "nothing done; give --max 4 to act on all of them"
        )
        code, out, err = await shepherd(*watching, "--yes", "--max", "3")
        assert code == 1 and out.splitlines()[-1] == "4 machines are more than --max 3: nothing done", err
        code, out, err = await shepherd(*watching, "--max", "4", answer="n\n")
        assert code == 1 and "maintenance on on these 4 machine(s)? [y/N]" in out, err
        for provider_id in ALL:
            assert (await stack.status(provider_id)).stage is MachineStage.WATCHING

        # Not confirmed: nothing is done.
        code, out, err = await shepherd(
            "maintenance", "--where", 'ProviderId = "node-0001"', "--on", "--reason", "rack move", answer="n\n"
        )
        assert code == 1 and out.splitlines()[-1] == "nothing done"
        assert (await stack.status("node-0001")).stage is MachineStage.WATCHING

        code, out, err = await shepherd(
            "maintenance",
            "--where",
            'Provider = "sim" AND ProviderId IN ("node-0001", "node-0002")',
            "--on",
            "--reason",
            "rack move",
            "--by",
            "alice",
            answer="y\n",
        )
        assert code == 0, err
        lines = out.splitlines()
        assert "maintenance on on these 2 machine(s)? [y/N]" in lines[3]
        assert sorted(line.split()[1] for line in lines[4:6]) == ["machine-sim-node-0001:", "machine-sim-node-0002:"]
        assert lines[-1] == "done: 2 of 2 succeeded"
        await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.MAINTENANCE)

        # Each machine answers for itself: the one already in maintenance refuses, the other goes.
        await wait_for(lambda: _stages_listed(shepherd, "MAINTENANCE", 2), what="maintenance in visibility")
        code, out, err = await shepherd(
            "maintenance",
            "--where",
            'ProviderId IN ("node-0002", "node-0003")',
            "--on",
            "--reason",
            "again",
            "--yes",
            "--rate",
            "50",
        )
        assert code == 1
        assert "done: 1 of 2 succeeded, 1 did not:" in out
        assert "  machine-sim-node-0002: already in maintenance, asked by alice" in out

        code, out, err = await shepherd("recover", "--where", 'ProviderId = "node-0004"', "--reason", "bulk", "--yes")
        assert code == 0, err
        assert "machine-sim-node-0004: recovery requested (bulk); it was WATCHING" in out

        # node-0001 is in maintenance: a decommission overrides it only with --force.
        decommission = ["decommission", "--where", 'ProviderId = "node-0001"', "--reason", "end of lease", "--yes"]
        code, out, err = await shepherd(*decommission)
        assert code == 1 and "machine-sim-node-0001: it is in maintenance, asked by alice (unverified)" in out
        code, out, err = await shepherd(*decommission, "--force")
        assert code == 0, err
        assert (await decommissioned(stack, "node-0001")).reason == "end of lease"

        # A query that closes the parenthesis around it would reach past the running machines (here the
        # completed workflow of node-0001): refused before Temporal is asked, naming where.
        escape = 'ProviderId = "node-0001") OR (ProviderId = "node-0001"'
        for where in (escape, "x) OR (y"):
            with pytest.raises(SystemExit) as usage:
                await shepherd("restart-agent", "--where", where, "--reason", "x", "--dry-run")
            assert usage.value.code == 2
            assert "closes a parenthesis it did not open, at character" in capsys.readouterr().err

        # Bad input: nothing selected, a malformed query, a query beside a machine, the bulk flags alone.
        code, out, err = await shepherd("recover", "--where", 'MachineStage = "NOPE"', "--reason", "x", "--yes")
        assert (code, out) == (1, "") and "no running machine workflow matches --where" in err
        for args in (
            ["recover", "--where", "Provider = ", "--reason", "x"],
            ["recover", "node-0003", "--where", 'Provider = "sim"', "--reason", "x"],
            ["recover", "--reason", "x"],
            ["recover", "node-0003", "--reason", "x", "--yes"],
            ["recover", "--where", 'Provider = "sim"', "--reason", "x", "--rate", "0"],
        ):
            with pytest.raises(SystemExit) as usage:
                await shepherd(*args)
            assert usage.value.code == 2, args
        recovered = await wait_for(lambda: _recovered(stack, "node-0004"), what="the recovery of node-0004", limit=60)
        assert recovered.last_recovery_reason.startswith("forced: bulk (by ")
        assert (await stack.status("node-0003")).stage is MachineStage.MAINTENANCE


async def _stages_listed(shepherd, stage: str, count: int) -> bool:
    code, out, _ = await shepherd("recover", "--where", f'MachineStage = "{stage}"', "--reason", "x", "--dry-run")
    return code == 0 and out.startswith(f"{count} machine(s)")


async def _recovered(stack, provider_id: str):
    status = await stack.status(provider_id)
    return status if status.recovery_count == 1 and status.stage is MachineStage.WATCHING else None


def test_force_goes_to_a_bulk_decommission_alone():
    asked = bulk_request("decommission", {"where": "A = 'b'", "reason": "end", "force": True}, "alice").asked
    assert asked == OperatorRequest("end", "alice", force=True)
    assert bulk_request("decommission", {"where": "A = 'b'", "reason": "end"}, "alice").asked == OperatorRequest(
        "end", "alice"
    )
    with pytest.raises(ApiError) as refused:
        bulk_request("restart-agent", {"where": "A = 'b'", "reason": "x", "force": True}, "alice")
    assert refused.value.status == 400
    assert refused.value.text == "field 'force' goes with decommission, not restart-agent"
