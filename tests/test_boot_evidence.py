"""Whether a machine was reset since a reboot was asked, from its own uptime over SSH: against OpenSSH's sshd, one
started in a time namespace of its own that booted seconds ago, as a machine just power-cycled."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncssh
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.deps import ActivityDeps
from activities.recovery import RecoveryActivities
from foundation.settings import Settings
from foundation.ssh_identity import public_key_openssh
from lifecycle.boot_evidence import (
    CLOCK_ALLOWANCE,
    ResetSeen,
    booted_at_over_ssh,
    judge_reset,
    parse_uptime,
    reset_over_ssh,
)
from lifecycle.contracts import RebootInput
from lifecycle.takeover_failures import TakeoverTarget
from providers.bmc_secrets import BmcSecretRules
from providers.static import StaticProvider
from tests.ports import free_port
from tests.sshd_fixtures import Sshd, running_sshd

# The uptime the machine just rebooted shows.
FRESH_UPTIME = 30


def host_uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


@pytest.fixture(scope="module")
def rebooted_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """sshd whose sessions see a boot FRESH_UPTIME seconds before it started: a time namespace (Linux 5.6) moves
    their CLOCK_BOOTTIME and /proc/uptime, as nothing else on the host sees. Without --fork, sshd itself stays in
    the host's and takes its signals; the processes it starts are in the new one."""
    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is part of every Debian system"
    offset = int(host_uptime()) - FRESH_UPTIME
    launcher = [unshare, "--time", "--boottime", str(-offset)]
    with running_sshd(tmp_path_factory.mktemp("rebooted-sshd"), launcher=launcher) as sshd:
        yield sshd


def target_of(sshd: Sshd, port: int | None = None) -> TakeoverTarget:
    return TakeoverTarget("machine-1", "127.0.0.1", port or sshd.port, sshd.username, sshd.host_key)


async def test_the_machine_says_when_it_booted_by_its_uptime(rebooted_sshd):
    before = datetime.now(UTC)
    booted = await booted_at_over_ssh(target_of(rebooted_sshd), rebooted_sshd.client_key, 5.0, 5.0)
    # Its uptime counts from a boot FRESH_UPTIME seconds before its sshd started, which was moments ago.
    assert before - timedelta(seconds=FRESH_UPTIME + 120) < booted < before - timedelta(seconds=FRESH_UPTIME - 1)


async def test_a_reboot_asked_before_the_boot_was_done_and_one_asked_after_was_not(rebooted_sshd):
    key = rebooted_sshd.client_key
    target = target_of(rebooted_sshd)
    asked_before_boot = datetime.now(UTC) - timedelta(seconds=FRESH_UPTIME + 600)
    done = await reset_over_ssh(target, asked_before_boot, key, 5.0, 5.0)
    assert done.seen is ResetSeen.RESET, done
    assert done.detail.startswith("its uptime over SSH at 127.0.0.1:") and "reset at" in done.detail
    not_done = await reset_over_ssh(target, datetime.now(UTC), key, 5.0, 5.0)
    assert not_done.seen is ResetSeen.NOT_RESET, not_done
    assert "before the ask" in not_done.detail


async def test_a_machine_that_does_not_answer_says_nothing(rebooted_sshd):
    target = target_of(rebooted_sshd, port=free_port())
    evidence = await reset_over_ssh(target, datetime.now(UTC), rebooted_sshd.client_key, 2.0, 2.0)
    assert evidence.seen is ResetSeen.UNKNOWN
    assert "CONNECT_REFUSED" in evidence.detail or "refused" in evidence.detail


async def test_another_host_key_says_nothing_and_nothing_is_run(rebooted_sshd):
    # The machine's pin is another server's key: an impostor's uptime must not stop a reboot.
    pinned = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    impostor = TakeoverTarget("machine-1", "127.0.0.1", rebooted_sshd.port, rebooted_sshd.username, pinned)
    evidence = await reset_over_ssh(impostor, datetime.now(UTC), rebooted_sshd.client_key, 5.0, 5.0)
    assert evidence.seen is ResetSeen.UNKNOWN and "host key" in evidence.detail


def test_judging_a_reset_time():
    asked = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    assert judge_reset(None, asked, "the BMC").seen is ResetSeen.NOT_RESET
    assert judge_reset(asked + timedelta(seconds=1), asked, "the BMC").seen is ResetSeen.RESET
    # Clocks differ a little: a reset just before the ask by another clock is the asked one.
    assert judge_reset(asked - CLOCK_ALLOWANCE, asked, "the BMC").seen is ResetSeen.RESET
    late = judge_reset(asked - CLOCK_ALLOWANCE - timedelta(seconds=1), asked, "the BMC")
    assert late.seen is ResetSeen.NOT_RESET and late.detail.startswith("the BMC: last reset at 2026-11-01T11:59:54")


@pytest.mark.parametrize(
    ("reply", "seconds"),
    [(b"31873.42 28212.84\n", 31873.42), (b"5 1\n", 5.0), (b"0.00 0.00", 0.0)],
)
def test_uptime_replies(reply, seconds):
    assert parse_uptime(reply) == seconds


@pytest.mark.parametrize(
    "reply", [b"", b"\n", b"nan 1", b"inf 1", b"-5 1", b"up 3 days", b"\x1b[31m12\x1b[0m", b"1e999 1"]
)
def test_replies_that_are_no_uptime_are_named(reply):
    with pytest.raises(ValueError, match="not seconds") as refused:
        parse_uptime(reply)
    assert "\x1b" not in str(refused.value)


async def test_a_retry_reads_the_uptime_of_a_machine_whose_provider_keeps_no_reset_record(
    rebooted_sshd, tmp_path, bmdb, temporal_client
):
    """A static machine without a BMC: a reboot asked of it fails (NoBMC), so only the uptime can answer."""
    inventory = tmp_path / "inventory.toml"
    inventory.write_text(
        f'[[machines]]\nid = "node-a"\nssh = "127.0.0.1:{rebooted_sshd.port}"\nssh_user = "{rebooted_sshd.username}"\n'
    )
    provider = StaticProvider("rack", inventory, secrets=BmcSecretRules.from_settings(Settings(state_dir=tmp_path)))
    machine_id, _ = await bmdb.admit_machine("rack", "node-a")
    await bmdb.pin_host_key(machine_id, rebooted_sshd.host_key)
    deps = ActivityDeps(
        settings=Settings(ssh_connect_timeout=5.0, ssh_exec_timeout=5.0),
        bmdb=bmdb,
        providers={"rack": provider},
        client=temporal_client,
        ssh_key=rebooted_sshd.client_key,
        ssh_public_key=public_key_openssh(rebooted_sshd.client_key),
    )
    environment = ActivityEnvironment()
    environment.info = dataclasses.replace(
        environment.info, started_time=datetime.now(UTC), start_to_close_timeout=timedelta(seconds=60)
    )
    request = RebootInput("rack", "node-a", str(machine_id), "agent silent", cycle="cycle-1")
    # The attempt before asked before the machine's boot, and died unanswered.
    await bmdb.ask_reboot(machine_id, "cycle-1", datetime.now(UTC) - timedelta(seconds=FRESH_UPTIME + 600))
    result = await environment.run(RecoveryActivities(deps).reboot_through_provider, request)
    assert result.went_down and "was done: its uptime over SSH at 127.0.0.1:" in result.detail
    # Asked again in another cycle, after the boot: the machine runs since before, so the reboot is asked (and the
    # inventory has no BMC to do it).
    await bmdb.ask_reboot(machine_id, "cycle-2", datetime.now(UTC))
    with pytest.raises(ApplicationError, match="has no BMC"):
        await environment.run(
            RecoveryActivities(deps).reboot_through_provider, dataclasses.replace(request, cycle="cycle-2")
        )
