"""A whole Shepherd stack for integration tests: simulator, BMDB, Temporal, worker.

Real parts throughout: the simulator's HTTP API and SSH servers, PostgreSQL,
a Temporal dev server, the reference agent uploaded and run over SSH.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from temporalio.client import Client, WorkflowHandle
from temporalio.common import MetricMeter

from activities.deps import ActivityDeps, open_activity_deps
from agent.build import build_agent_executable
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.tls import local_certificates
from lifecycle.contracts import FleetPassResult, MachineStage, MachineStatus, fleet_schedule_id, machine_workflow_id
from lifecycle.inputs import fleet_input
from processes.heartbeat_server import build_server
from processes.heartbeat_service import HeartbeatService
from processes.worker import serving
from simulator import Faults, Simulator, SimulatorConfig
from workflows.fleet import FleetWorkflow
from workflows.machine import MachineWorkflow


def stack_settings(tmp_path: Path, sim_api_url: str, temporal_client: Client, **overrides: Any) -> Settings:
    """Settings of a test stack: everything local and fast."""
    agent = tmp_path / "agent"
    if not agent.exists():
        build_agent_executable(agent)
    values: dict[str, Any] = dict(
        temporal_address=temporal_client.service_client.config.target_host,
        temporal_namespace=temporal_client.namespace,
        task_queue=f"shepherd-{uuid.uuid4().hex[:8]}",
        state_dir=tmp_path / "state",
        sim_api_url=sim_api_url,
        provider_timeout=3.0,
        ssh_key_path=tmp_path / "ssh_key",
        ssh_exec_timeout=10.0,
        agent_executable_path=agent,
        agent_endpoint="127.0.0.1:8900",
        agent_start_backoff_initial=0.5,
        agent_start_backoff_maximum=2.0,
        provision_backoff_initial=0.5,
        provision_backoff_maximum=2.0,
        max_machines=50,
        chunk_size=20,
        device_creation_interval=0.01,
        shutdown_grace=2.0,
        # Below the tests' short heartbeat timeouts (the stack's own heartbeat server asks every 0.3 s).
        heartbeat_interval=1.0,
        heartbeat_max_skew=1.0,
    )
    values.update(overrides)
    return Settings(**values).check_agent()


def shepherd_environment(settings: Settings, bmdb_url: str) -> dict[str, str]:
    """SHEPHERD_* variables that point a `shepherd` command at a test stack of these settings and this BMDB."""
    from shepherd.commands.dev_stack.stack_settings import settings_environment

    return {**settings_environment(settings), "SHEPHERD_DATABASE_URL": bmdb_url}


@dataclass
class HeartbeatPath:
    """The stack's TLS heartbeat server, which a test may stop and start again on the same port (an outage)."""

    tmp_path: Path
    bmdb: BMDB
    port: int = 0
    server: grpc.aio.Server | None = None
    ca_certificate: Path | None = None

    async def start(self) -> str:
        self.server, endpoint, self.ca_certificate = await start_heartbeat_server(self.tmp_path, self.bmdb, self.port)
        self.port = int(endpoint.rpartition(":")[2])
        return endpoint

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
            self.server = None


@dataclass
class FleetStack:
    settings: Settings
    client: Client
    simulator: Simulator
    deps: ActivityDeps
    heartbeat_path: HeartbeatPath | None = None

    def environment(self, bmdb_url: str) -> dict[str, str]:
        """SHEPHERD_* variables that point a `shepherd` command at this stack."""
        return shepherd_environment(self.settings, bmdb_url)

    async def run_pass(self) -> FleetPassResult:
        return await self.client.execute_workflow(
            FleetWorkflow.run,
            fleet_input(self.settings, "sim"),
            # Named as the schedule names its passes, so `shepherd fleet` lists them with the schedule's.
            id=f"{fleet_schedule_id('sim')}-{uuid.uuid4().hex[:8]}",
            task_queue=self.settings.task_queue,
        )

    def machine(self, provider_id: str) -> WorkflowHandle[Any, Any]:
        return self.client.get_workflow_handle(machine_workflow_id("sim", provider_id))

    async def status(self, provider_id: str) -> MachineStatus:
        return await self.machine(provider_id).query(MachineWorkflow.status)

    async def wait_for_error(self, provider_id: str, attempts: int = 1, limit: float = 30.0) -> MachineStatus:
        """The machine's status once its current step has failed `attempts` times."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            status = await self.status(provider_id)
            if status.last_error and status.attempts >= attempts:
                return status
            if loop.time() > deadline:
                raise AssertionError(f"{provider_id} did not fail {attempts} time(s) within {limit}s: {status}")
            await asyncio.sleep(0.1)

    async def wait_for_stage(self, provider_ids: list[str], stage: MachineStage, limit: float = 60.0) -> None:
        """Wait until every named machine's workflow reports stage; fail naming the laggards."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            statuses: dict[str, MachineStatus | Exception] = {}
            for provider_id in provider_ids:
                try:
                    statuses[provider_id] = await self.status(provider_id)
                except Exception as error:  # not started yet, or a query failure to report
                    statuses[provider_id] = error
            lagging = {p: s for p, s in statuses.items() if not isinstance(s, MachineStatus) or s.stage != stage}
            if not lagging:
                return
            if loop.time() > deadline:
                raise AssertionError(f"not {stage} after {limit}s: {lagging}")
            await asyncio.sleep(0.2)


@asynccontextmanager
async def fleet_stack(
    tmp_path: Path,
    temporal_client: Client,
    bmdb_url: str,
    *,
    machines: int,
    run_worker: bool = True,
    heartbeats: bool = False,
    sim_faults: Faults | None = None,
    sim_meter: MetricMeter = MetricMeter.noop,
    sim_boot_seconds: float = 2.0,
    **setting_overrides: Any,
) -> AsyncIterator[FleetStack]:
    simulator = Simulator(
        SimulatorConfig(
            machines=machines,
            state_dir=tmp_path / "sim",
            api_port=0,
            faults=sim_faults or Faults(),
            boot_seconds=sim_boot_seconds,
        ),
        sim_meter,
    )
    await simulator.start()
    heartbeat_path = None
    try:
        if heartbeats:
            heartbeat_path = HeartbeatPath(tmp_path, BMDB(bmdb_url, pool_size=2))
            endpoint = await heartbeat_path.start()
            setting_overrides = {
                "agent_endpoint": endpoint,
                "agent_endpoint_ca_certificate_path": heartbeat_path.ca_certificate,
                **setting_overrides,
            }
        settings = stack_settings(tmp_path, simulator.api_url, temporal_client, **setting_overrides)
        deps = await open_activity_deps(settings, temporal_client, bmdb_url)
        try:
            stack = FleetStack(settings, temporal_client, simulator, deps, heartbeat_path)
            if run_worker:
                async with serving(temporal_client, deps):
                    yield stack
            else:
                yield stack
        finally:
            await deps.close()
    finally:
        await simulator.stop()
        if heartbeat_path is not None:
            await heartbeat_path.stop()
            await heartbeat_path.bmdb.close()


async def start_heartbeat_server(tmp_path: Path, bmdb: BMDB, port: int = 0) -> tuple[grpc.aio.Server, str, Path]:
    """A TLS heartbeat server asking for a heartbeat every 0.3 s: (server, endpoint, CA file)."""
    certificates = local_certificates(tmp_path / "tls")
    service = HeartbeatService(bmdb, interval=0.3, max_skew=60.0)
    listen = f"127.0.0.1:{port}"
    server, port = build_server(service, listen, (certificates.server_certificate, certificates.server_key))
    await server.start()
    return server, f"127.0.0.1:{port}", certificates.ca_certificate
