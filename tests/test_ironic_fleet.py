"""A fleet of machines through a real Ironic, run by fleet passes: nodes deployed and taken over in one pass, an agent
that died found silent by the watchdog and its machine rebooted through Ironic, a machine past its recovery budget
rebuilt through Ironic, and Ironic down or answering 503 meanwhile, with nothing done twice.

Each node has a machine of its own behind it: sshd chrooted into a root of busybox and glibc (SSH and nothing else),
on a port of its own that the node's extra/ssh_address names; every machine lets Shepherd's one key in. The tests
play the hardware: they kill an agent as a crash would, and give a machine a fresh disk and a new host key when
Ironic rebuilds its node. fake-hardware nodes go through Ironic's real state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle

from bmdb.store import BMDB, MachineRecord
from foundation.procfs import processes_mentioning
from foundation.provider_instances import ProviderInstance
from lifecycle.contracts import FleetPassResult, MachineStage, MachineStatus, fleet_schedule_id
from lifecycle.inputs import fleet_input
from tests.fault_proxy import fault_injecting_proxy
from tests.ironic_fixtures import Ironic, running_ironic
from tests.sshd_fixtures import BareMachine, free_port, running_bare_machine, write_private_key
from tests.test_static_machines import LabStack, lab_stack
from workflows.fleet import FleetWorkflow

RACK = "rack"
# Short watchdog times: the lab stack's heartbeat server asks healthy agents for a heartbeat every 0.3 s.
WATCH: dict[str, Any] = {"first_heartbeat_timeout": 20.0, "heartbeat_timeout": 3.0}
# How Ironic's log tells a rebuild from a first deploy: the node leaves "active" for "deploying".
REBUILT = 'Node {node} moved to provision state "deploying" from state "active"'
# ... and that its conductor power-cycled a node.
REBOOTED = "Successfully set node {node} power state to power on by rebooting"


@dataclass(frozen=True)
class Machine:
    """A machine behind a node: its sshd, configured in config (host key, pid file), and its root on this host."""

    bare: BareMachine
    config: Path

    @property
    def address(self) -> str:
        """Where SSH reaches it, as the node's extra/ssh_address says."""
        return f"127.0.0.1:{self.bare.sshd.port}"


@pytest.fixture(scope="module", name="machines")
def machines_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Machine]]:
    """Three bare machines that let one key in, for the module's tests one after the other."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    with contextlib.ExitStack() as running:
        machines = []
        for _ in range(3):
            config = tmp_path_factory.mktemp("machine-sshd")
            machines.append(Machine(running.enter_context(running_bare_machine(config, key)), config))
        yield machines


@pytest.fixture(name="fleet")
def fleet_fixture(machines: list[Machine]) -> list[Machine]:
    """The machines with nothing of an earlier test on them: no agent running, nothing in root's home."""
    for machine in machines:
        crash_agent(machine)
        fresh_disk(machine)
    return machines


def crash_agent(machine: Machine) -> int:
    """Kill what Shepherd started on the machine, at once, as a crash would; how many processes.

    Its processes are known by the SSH session they were started from: their SSH_CONNECTION names the machine's port.
    """
    pids = processes_mentioning(f" 127.0.0.1 {machine.bare.sshd.port}\0")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def fresh_disk(machine: Machine) -> None:
    """Root's home as a new OS has it: empty."""
    for entry in (machine.bare.root / "root").iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def new_os_once_rebuilt(ironic: Ironic, node: str, machine: Machine, host_key: asyncssh.SSHKey) -> None:
    """The hardware's part once Ironic is asked to rebuild the node: the machine goes down, longer than the boot
    wait's 2 s between tries, and comes back with a fresh disk and a new host key."""
    asked = ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision")
    deadline = time.monotonic() + 90
    # Told by Ironic's log rather than the node's state: a rebuild of fake hardware may be over before a poll sees it.
    while ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision") == asked:
        if time.monotonic() > deadline:
            raise AssertionError(f"Ironic was never asked to rebuild node {node}")
        time.sleep(0.05)
    sshd_pid = int((machine.config / "sshd.pid").read_text())
    # A stopped sshd accepts connections and sends no SSH version line: no SSH answers.
    os.kill(sshd_pid, signal.SIGSTOP)
    (machine.config / "host_key").unlink()
    write_private_key(machine.config / "host_key", host_key)
    fresh_disk(machine)
    time.sleep(5)
    os.kill(sshd_pid, signal.SIGCONT)
    # sshd reads its host key again when told to.
    os.kill(sshd_pid, signal.SIGHUP)


def rack(endpoint: str, ssh_user: str) -> ProviderInstance:
    """The Ironic provider instance of the tests: its gold nodes, deployed with an image Ironic never fetches."""
    options = {
        "endpoint": endpoint,
        "resource_class": "gold",
        "image_source": "http://127.0.0.1:9/os.qcow2",
        "address_field": "extra/ssh_address",
        "ssh_user": ssh_user,
    }
    return ProviderInstance(RACK, "ironic", options)


def asked(ironic: Ironic, node: str) -> dict[str, int]:
    """What Ironic's log says it was asked of the node: changes (a claim), provision and power requests."""
    return {
        "changes": ironic.requests_logged(f"PATCH /v1/nodes/{node} "),
        "provision": ironic.requests_logged(f"PUT /v1/nodes/{node}/states/provision"),
        "power": ironic.requests_logged(f"PUT /v1/nodes/{node}/states/power"),
    }


def watching(status: MachineStatus) -> bool:
    """Whether the machine is WATCHING: taken over, its agent watched."""
    return status.stage is MachineStage.WATCHING


async def event_kinds(bmdb: BMDB, node: str) -> list[str]:
    """The machine's event log, oldest first, by kind."""
    [record] = await bmdb.machines_with_provider_id(node)
    return [event.kind for event in reversed(await bmdb.list_events(record.machine_id))]


async def still_fine(
    stack: LabStack, bmdb: BMDB, ironic: Ironic, node: str, before: MachineRecord, since: datetime
) -> None:
    """The machine was left alone: WATCHING, never recovered, nothing more asked of Ironic than its claim and deploy,
    and its agent, the one before, heard from after since."""
    status = await stack.status(RACK, node)
    assert status.stage is MachineStage.WATCHING and status.recovery_count == 0, status
    assert asked(ironic, node) == {"changes": 1, "provision": 3, "power": 0}, "the test's manage and provide, a deploy"
    [record] = await bmdb.machines_with_provider_id(node)
    assert record.agent_public_key is not None and record.agent_public_key == before.agent_public_key
    assert record.agent_heartbeat_at is not None and record.agent_heartbeat_at > since, "its agent heartbeats on"
    assert "heartbeat_lost" not in await event_kinds(bmdb, node)


async def test_the_watchdog_reboots_then_rebuilds_a_silent_machine_through_ironic_and_leaves_the_others_alone(
    tmp_path, temporal_client, bmdb_url, bmdb, fleet
):
    sick = fleet[0]
    with running_ironic(tmp_path / "ironic") as ironic:
        nodes = [
            ironic.enroll(resource_class="gold", name=f"web-{number}", extra={"ssh_address": machine.address})
            for number, machine in enumerate(fleet, start=1)
        ]
        sick_node, healthy_nodes = nodes[0], nodes[1:]
        theirs = ironic.enroll(resource_class="gold", name="theirs", extra={"ssh_address": "127.0.0.1:9"})
        instance = ironic.deploy_as_someone_else(theirs)
        theirs_asked = asked(ironic, theirs)
        async with lab_stack(
            tmp_path,
            temporal_client,
            bmdb_url,
            sick.bare.sshd,
            {},
            "/root/agent",
            others=(rack(ironic.url, sick.bare.sshd.username),),
            recovery_budget=1,
            reimage_before_quarantine=True,
            **WATCH,
        ) as stack:
            # One pass deploys the three available nodes; the node someone else deployed is left alone.
            result = await stack.run_pass(RACK)
            assert sorted(result.admitted) == sorted(nodes)
            assert result.plan is not None and result.plan.left_alone == {"deployed or claimed by someone else": 1}
            for node in nodes:
                await stack.wait_for(RACK, node, watching, "WATCHING")
            first = [await stack.after_first_heartbeat(bmdb, node) for node in nodes]
            for record, machine in zip(first, fleet, strict=True):
                assert record.agent_heartbeat_at is not None, f"no heartbeat from the agent on {machine.address}"
                # Each node led Shepherd to its own machine: the host key pinned is that machine's, the agent is there.
                assert record.ssh_host_key == machine.bare.sshd.host_key
                assert (machine.bare.root / "root" / "agent").is_file()
            for node in nodes:
                deployed = ironic.node(node)
                assert deployed["provision_state"] == "active" and deployed["extra"]["shepherd_provider"] == RACK
            # The watchdog's pass: its agent died, and a pass after the heartbeat timeout finds it silent.
            sick_asked, sick_since = asked(ironic, sick_node), datetime.now(UTC)
            assert crash_agent(sick) >= 1
            await asyncio.sleep(WATCH["heartbeat_timeout"] + 1)
            result = await stack.run_pass(RACK)
            assert (result.silent, result.admitted) == ([sick_node], [])
            status = await stack.wait_for(
                RACK, sick_node, lambda s: s.recovery_count == 1 and watching(s), "rebooted and WATCHING again"
            )
            assert status.last_recovery_reason is not None
            assert status.last_recovery_reason.startswith("heartbeat lost: ")
            assert asked(ironic, sick_node) == {**sick_asked, "power": sick_asked["power"] + 1}, "one reboot"
            assert ironic.requests_logged(REBOOTED.format(node=sick_node)) == 1
            for node, before in zip(healthy_nodes, first[1:], strict=True):
                await still_fine(stack, bmdb, ironic, node, before, since=sick_since)

            # Its budget of one recovery is spent: the watchdog's next recovery rebuilds it through Ironic.
            rebooted = await stack.after_first_heartbeat(bmdb, sick_node)
            assert rebooted.agent_heartbeat_at is not None and rebooted.agent_public_key != first[0].agent_public_key
            new_key = asyncssh.generate_private_key("ssh-ed25519")
            new_os = asyncio.create_task(asyncio.to_thread(new_os_once_rebuilt, ironic, sick_node, sick, new_key))
            sick_asked = asked(ironic, sick_node)
            assert crash_agent(sick) >= 1
            await asyncio.sleep(WATCH["heartbeat_timeout"] + 1)
            assert (await stack.run_pass(RACK)).silent == [sick_node]
            status = await stack.wait_for(
                RACK, sick_node, lambda s: s.recovery_count == 2 and watching(s), "rebuilt and WATCHING again"
            )
            await new_os
            assert status.last_recovery_reason is not None
            assert status.last_recovery_reason.endswith("its recovery budget is spent: reimaged before a quarantine")
            assert asked(ironic, sick_node) == {**sick_asked, "provision": sick_asked["provision"] + 1}, "a rebuild"
            assert ironic.requests_logged(REBUILT.format(node=sick_node)) == 1
            [record] = await bmdb.machines_with_provider_id(sick_node)
            assert record.ssh_host_key == new_key.export_public_key("openssh").decode().strip(), "pinned anew"
            assert (sick.bare.root / "root" / "agent").is_file(), "the agent uploaded again to the fresh disk"
            kinds = await event_kinds(bmdb, sick_node)
            assert (kinds.count("heartbeat_lost"), kinds.count("rebooted"), kinds.count("reimaged")) == (2, 1, 1)
            for node, before in zip(healthy_nodes, first[1:], strict=True):
                await still_fine(stack, bmdb, ironic, node, before, since=sick_since)
                assert ironic.requests_logged(REBUILT.format(node=node)) == 0
            untouched = ironic.node(theirs)
            assert (untouched["provision_state"], untouched["instance_uuid"]) == ("active", instance)
            assert "shepherd_provider" not in untouched["extra"] and asked(ironic, theirs) == theirs_asked


async def start_pass(stack: LabStack) -> WorkflowHandle[Any, FleetPassResult]:
    """A fleet pass of the rack, started as its schedule starts one; its handle."""
    return await stack.client.start_workflow(
        FleetWorkflow.run,
        fleet_input(stack.settings, RACK),
        id=f"{fleet_schedule_id(RACK)}-{os.urandom(4).hex()}",
        task_queue=stack.settings.task_queue,
    )


async def retried(handle: WorkflowHandle[Any, FleetPassResult], failure: str, limit: float = 60.0) -> None:
    """Return once the pass's listing failed with failure and waits to be tried again; fail if the pass ended."""
    deadline = asyncio.get_running_loop().time() + limit
    while True:
        described = await handle.describe()
        for pending in described.raw_description.pending_activities:
            if pending.attempt >= 2 and failure in pending.last_failure.message:
                return
        if described.status is not WorkflowExecutionStatus.RUNNING:
            try:
                outcome = await handle.result()
            except WorkflowFailureError as failed:
                raise AssertionError(f"the pass failed without asking Ironic again: {failed.cause}") from failed
            raise AssertionError(f"the pass ended without asking Ironic again: {outcome}")
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the pass's listing did not fail with {failure!r} within {limit:g}s: {described}")
        await asyncio.sleep(0.1)


async def test_ironic_down_or_answering_503_is_waited_out_and_nothing_is_claimed_deployed_or_admitted_twice(
    tmp_path, temporal_client, bmdb_url, bmdb, fleet
):
    first, second = fleet[:2]
    state, port = tmp_path / "ironic", free_port()
    with fault_injecting_proxy(f"http://127.0.0.1:{port}") as proxy, contextlib.ExitStack() as ironic_up:
        ironic = ironic_up.enter_context(running_ironic(state, port=port))
        web1 = ironic.enroll(resource_class="gold", name="web-1", extra={"ssh_address": first.address})
        async with lab_stack(
            tmp_path,
            temporal_client,
            bmdb_url,
            first.bare.sshd,
            {},
            "/root/agent",
            others=(rack(proxy.url, first.bare.sshd.username),),
            **WATCH,
        ) as stack:
            # Ironic answers 503 from the worker's very first call on, its version discovery included: the pass
            # asks again until the 503s end.
            proxy.refusing = True
            passing = await start_pass(stack)
            await retried(passing, "HTTP 503")
            proxy.refusing = False
            result = await passing.result()
            assert result.admitted == [web1] and proxy.refused
            await stack.wait_for(RACK, web1, watching, "WATCHING")
            [fine] = await bmdb.machines_with_provider_id(web1)
            web2 = await asyncio.to_thread(
                ironic.enroll, resource_class="gold", name="web-2", extra={"ssh_address": second.address}
            )

            # Ironic stops: a pass finds no answer and asks again, until Ironic is back on its port with its state.
            # Once back, the replies to Shepherd's changes get lost on the way for a while: each change is made once.
            await asyncio.to_thread(ironic_up.close)
            down_since = datetime.now(UTC)
            passing = await start_pass(stack)
            await retried(passing, "no answer from Ironic")
            proxy.losing_replies_to = frozenset({"PATCH", "PUT"})
            ironic = await asyncio.to_thread(ironic_up.enter_context, running_ironic(state, port=port))
            result = await passing.result()
            assert (result.admitted, result.silent) == ([web2], [])
            await stack.wait_for(RACK, web2, watching, "WATCHING")
            proxy.losing_replies_to = frozenset()

            assert proxy.lost == [f"PATCH /v1/nodes/{web2}", f"PUT /v1/nodes/{web2}/states/provision"]
            assert asked(ironic, web2) == {"changes": 1, "provision": 3, "power": 0}, "claimed once, deployed once"
            nodes = ironic.api("GET", "/nodes?fields=uuid,instance_uuid,provision_state")["nodes"]
            assert sorted((n["uuid"], n["provision_state"]) for n in nodes) == sorted(
                [(web1, "active"), (web2, "active")]
            )
            assert len({n["instance_uuid"] for n in nodes}) == 2
            await still_fine(stack, bmdb, ironic, web1, fine, since=down_since)
            assert sorted(m.provider_id for m in await bmdb.list_machines()) == sorted([web1, web2])
            for node in (web1, web2):
                assert (await event_kinds(bmdb, node)).count("admitted") == 1
