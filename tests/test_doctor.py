"""`shepherd doctor` on real parts: a healthy installation passes every check, and each thing broken fails its
own check, naming the cause, with the checks that need it skipped and the rest still ok."""

from __future__ import annotations

import asyncio
import hashlib
import json
import platform
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from alembic.script import ScriptDirectory
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from bmdb import migrate
from bmdb.store import BMDB
from foundation.settings import Settings
from foundation.tls import CertificateAuthority, subject_alternative_name
from processes.heartbeat_server import build_server
from processes.heartbeat_service import HeartbeatService
from processes.worker import ensure_fleet_schedules
from shepherd.commands.dev_stack.stack_settings import AGENT_ENDPOINT
from shepherd.commands.doctor import embedded_stack
from shepherd.commands.doctor_checks.temporal import (
    CLOCK_PROBE_WORKFLOW,
    Poller,
    shown_identities,
    task_queue_pollers,
    worker_task_queues,
)
from tests.conftest import database_url, register_bare_namespace
from tests.elf_files import AARCH64, elf
from tests.fleet_stack import fleet_stack
from tests.ports import free_port
from tests.test_recovery import wait_for

EVERY_CHECK = [
    "temporal",
    "temporal namespace",
    "search attributes",
    "workers",
    "workers sim",
    "workers sim machines",
    "fleet sim",
    "temporal clock",
    "bmdb",
    "bmdb schema",
    "bmdb clock",
    "bmdb tls",
    "heartbeat endpoint",
    "heartbeat endpoint certificate",
    "ssh key",
    "agent executable",
    "provider sim",
]


@dataclass
class Installation:
    """A healthy installation: the environment that points `shepherd doctor` at it, and its heartbeat TLS."""

    env: dict[str, str]
    tmp_path: Path
    bmdb: BMDB
    agents_ca: CertificateAuthority
    servers: list[grpc.aio.Server]

    async def serve_heartbeats(self, authority: CertificateAuthority, not_after: datetime) -> str:
        """Another heartbeat server, with a certificate for 127.0.0.1 from authority valid until not_after."""
        certificate, key = authority.issue(
            "heartbeats", datetime.now(UTC) - timedelta(days=400), not_after, subject_alternative_name("127.0.0.1")
        )
        name = uuid.uuid4().hex[:8]
        (self.tmp_path / f"{name}.pem").write_bytes(certificate)
        (self.tmp_path / f"{name}-key.pem").write_bytes(key)
        service = HeartbeatService(self.bmdb, interval=1.0, max_skew=60.0)
        tls = (self.tmp_path / f"{name}.pem", self.tmp_path / f"{name}-key.pem")
        server, port = build_server(service, "127.0.0.1:0", tls)
        await server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"


def days_from_now(days: float) -> datetime:
    return datetime.now(UTC) + timedelta(days=days)


@asynccontextmanager
async def installed(
    tmp_path: Path, temporal_client: Client, bmdb_url: str, bmdb: BMDB, *, run_worker: bool
) -> AsyncIterator[Installation]:
    agents_ca = CertificateAuthority("agents' CA", days_from_now(-400), days_from_now(3650))
    (tmp_path / "agents-ca.pem").write_bytes(agents_ca.certificate_pem)
    # A real deployment's: the agents' CA file, a TLS heartbeat server, an SSH key 0600 (the worker's start
    # creates it), an agent executable, and a Shepherd worker polling its task queues unless run_worker is false.
    found = Installation({}, tmp_path, bmdb, agents_ca, [])
    try:
        endpoint = await found.serve_heartbeats(agents_ca, days_from_now(365))
        async with fleet_stack(
            tmp_path,
            temporal_client,
            bmdb_url,
            machines=1,
            run_worker=run_worker,
            agent_endpoint=endpoint,
            agent_endpoint_ca_certificate_path=tmp_path / "agents-ca.pem",
            # No pass comes due while the test runs (passes fall on multiples of the interval since the epoch).
            reconcile_interval=7 * 86400.0,
        ) as stack:
            await ensure_fleet_schedules(temporal_client, stack.settings)
            if run_worker:
                queues = worker_task_queues(stack.settings)

                async def every_queue_polled() -> bool:
                    return all([await task_queue_pollers(temporal_client, queue, kind) for _, queue, kind in queues])

                # A worker's first polls reach the server a moment after it starts.
                await wait_for(every_queue_polled, limit=30, what="the worker polling each of its task queues")
            found.env = stack.environment(bmdb_url)
            yield found
    finally:
        for server in found.servers:
            await server.stop(None)


@pytest.fixture
async def installation(
    tmp_path: Path, temporal_client: Client, bmdb_url: str, bmdb: BMDB
) -> AsyncIterator[Installation]:
    async with installed(tmp_path, temporal_client, bmdb_url, bmdb, run_worker=True) as found:
        yield found


@pytest.fixture
async def installation_without_worker(
    tmp_path: Path, temporal_client: Client, bmdb_url: str, bmdb: BMDB
) -> AsyncIterator[Installation]:
    async with installed(tmp_path, temporal_client, bmdb_url, bmdb, run_worker=False) as found:
        yield found


@dataclass(frozen=True)
class Report:
    code: int
    lines: dict[str, tuple[str, str]]  # check name -> (status, detail)
    summary: str
    err: str

    def statuses(self) -> dict[str, str]:
        return {name: status for name, (status, _) in self.lines.items()}

    def failed(self) -> set[str]:
        return {name for name, (status, _) in self.lines.items() if status == "FAIL"}

    def detail(self, name: str) -> str:
        return self.lines[name][1]


async def doctor(shepherd_cli: Any, env: dict[str, str], *args: str) -> Report:
    code, out, err = await shepherd_cli(env, "doctor", *args)
    *lines, summary = out.splitlines()
    parsed: dict[str, tuple[str, str]] = {}
    for line in lines:
        status, rest = line.split(None, 1)
        name, detail = rest.split(": ", 1)
        parsed[name] = (status, detail)
    assert list(parsed) == EVERY_CHECK, out
    return Report(code, parsed, summary, err)


def assert_only_these_fail(report: Report, failed: set[str], skipped: frozenset[str] | set[str] = frozenset()) -> None:
    """Exit 1, the named checks failed, those that need them skipped, and every other check still ok."""
    assert report.code == 1, report
    assert report.failed() == failed, report
    assert {name for name, status in report.statuses().items() if status == "skipped"} == skipped, report
    others = set(EVERY_CHECK) - failed - skipped
    assert {report.statuses()[name] for name in others} == {"ok"}, report
    assert "Traceback" not in report.err


async def test_a_healthy_installation_passes_every_check(installation, shepherd_cli, temporal_client):
    report = await doctor(shepherd_cli, installation.env)
    assert report.code == 0, report
    assert report.statuses() == {name: "ok" for name in EVERY_CHECK}
    assert report.summary == f"{len(EVERY_CHECK)} checks: {len(EVERY_CHECK)} ok"
    address = temporal_client.service_client.config.target_host
    assert report.detail("temporal").startswith(
        f"reachable at {address} over plain text (address from Shepherd setting temporal_address), server "
    )
    assert report.detail("search attributes") == (
        f"MachineStage, Provider, ProviderId, MachineId registered in {temporal_client.namespace}"
    )
    queue, identity = installation.env["SHEPHERD_TASK_QUEUE"], temporal_client.identity
    assert report.detail("workers").startswith(
        f"1 poller of workflow tasks on task queue {queue}: {identity}; last poll "
    )
    assert report.detail("workers sim").startswith(
        f"1 poller of activity tasks on task queue {queue}-provider-sim: {identity}; last poll "
    )
    assert report.detail("workers sim machines").startswith(
        f"1 poller of activity tasks on task queue {queue}-machines-sim: {identity}; last poll "
    )
    assert report.detail("fleet sim").startswith("shepherd-fleet-sim: running, every 7d")
    assert report.detail("fleet sim").endswith("; no passes yet")
    assert report.detail("bmdb schema") == f"at the newest migration, {migrate.head_revision()}"
    assert f"verified for 127.0.0.1 with the agents' CA {installation.tmp_path / 'agents-ca.pem'}" in report.detail(
        "heartbeat endpoint certificate"
    )
    assert report.detail("ssh key").endswith("mode 0600")
    assert "Temporal's clock is" in report.detail("temporal clock")
    assert "BMDB's clock is" in report.detail("bmdb clock")
    assert report.detail("provider sim") == "type sim, answered: 1 machine listed (1 free)"

    code, out, _ = await shepherd_cli(installation.env, "doctor", "--json")
    document = json.loads(out)
    assert code == 0 and document["ok"] is True and document["embedded_stack"] is None
    checks = {check["name"]: check for check in document["checks"]}
    assert list(checks) == EVERY_CHECK
    assert {name: (check["status"], check["detail"].split(" ")[0]) for name, check in checks.items()} == {
        name: ("ok", detail.split(" ")[0]) for name, (_, detail) in report.lines.items()
    }
    assert document["summary"] == {"ok": len(EVERY_CHECK), "warn": 0, "fail": 0, "skipped": 0}
    assert checks["search attributes"]["missing"] == []
    assert checks["bmdb schema"]["revision"] == checks["bmdb schema"]["head"] == migrate.head_revision()
    assert 363 <= checks["heartbeat endpoint certificate"]["days_left"] <= 365
    assert checks["heartbeat endpoint"]["alpn"] == "h2"
    # One host, one clock: both readings agree with this host's within their own uncertainty and a little.
    for clock in ("temporal clock", "bmdb clock"):
        assert abs(checks[clock]["offset_seconds"]) <= checks[clock]["uncertainty_seconds"] + 0.05
    assert checks["fleet sim"]["paused"] is False and checks["fleet sim"]["last_pass"] is None
    for name, task_queue, kind in (
        ("workers", queue, "workflow"),
        ("workers sim", f"{queue}-provider-sim", "activity"),
        ("workers sim machines", f"{queue}-machines-sim", "activity"),
    ):
        assert (checks[name]["task_queue"], checks[name]["kind"]) == (task_queue, kind)
        assert checks[name]["pollers"] == [identity] and checks[name]["gone"] == []

    # The clock probes (one a run) were terminated at once: nothing polls their task queue to run them.
    query = f'WorkflowType = "{CLOCK_PROBE_WORKFLOW}"'
    probes = [execution.id async for execution in temporal_client.list_workflows(query)]
    for _ in range(100):
        if len(probes) == 2:
            break
        await asyncio.sleep(0.1)  # visibility lags the start a little
        probes = [execution.id async for execution in temporal_client.list_workflows(query)]
    assert len(probes) == 2
    for probe in probes:
        described = await temporal_client.get_workflow_handle(probe).describe()
        assert described.status == WorkflowExecutionStatus.TERMINATED


async def test_a_paused_fleet_and_a_certificate_near_its_end_warn_without_failing(installation, shepherd_cli):
    endpoint = await installation.serve_heartbeats(installation.agents_ca, days_from_now(10))
    env = {**installation.env, "SHEPHERD_AGENT_ENDPOINT": endpoint}
    code, _, err = await shepherd_cli(env, "fleet", "--pause", "--note", "rack move")
    assert code == 0, err
    report = await doctor(shepherd_cli, env)
    assert report.code == 0, report
    assert {name for name, status in report.statuses().items() if status != "ok"} == {
        "fleet sim",
        "heartbeat endpoint certificate",
    }
    assert report.lines["fleet sim"][0] == "warn"
    assert "PAUSED (rack move; by " in report.detail("fleet sim")
    assert report.detail("fleet sim").endswith("no passes until `shepherd fleet --resume`")
    status, detail = report.lines["heartbeat endpoint certificate"]
    assert status == "warn" and detail.startswith("expires in 9 days (") and detail.endswith("under 30 days, renew it")


async def test_a_namespace_without_the_search_attributes_fails_naming_them(
    installation, shepherd_cli, temporal_env: WorkflowEnvironment
):
    bare = await register_bare_namespace(temporal_env.client)
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_TEMPORAL_NAMESPACE": bare})
    # A fresh namespace has no fleet schedule either, nor a worker polling in it.
    assert_only_these_fail(report, {"search attributes", "workers", "workers sim", "workers sim machines", "fleet sim"})
    detail = report.detail("search attributes")
    assert detail.startswith(f"namespace '{bare}' lacks the search attributes MachineStage, Provider, ProviderId, ")
    assert f"temporal operator search-attribute create --namespace {bare} --name MachineId --type Keyword" in detail


async def test_a_missing_fleet_schedule_fails(installation, shepherd_cli, temporal_client):
    await temporal_client.get_schedule_handle("shepherd-fleet-sim").delete()
    report = await doctor(shepherd_cli, installation.env)
    assert_only_these_fail(report, {"fleet sim"})
    assert report.detail("fleet sim") == (
        "there is no fleet schedule 'shepherd-fleet-sim' yet: a worker creates it when it starts"
    )


async def test_no_worker_running_fails_naming_each_task_queue_nobody_polls(installation_without_worker, shepherd_cli):
    env = installation_without_worker.env
    report = await doctor(shepherd_cli, env)
    assert_only_these_fail(report, {"workers", "workers sim", "workers sim machines"})
    queue = env["SHEPHERD_TASK_QUEUE"]
    assert report.detail("workers") == f"no worker polls task queue {queue}: start `shepherd worker`"
    assert report.detail("workers sim") == f"no worker polls task queue {queue}-provider-sim: start `shepherd worker`"
    assert report.detail("workers sim machines") == (
        f"no worker polls task queue {queue}-machines-sim: start `shepherd worker`"
    )
    assert report.summary == f"{len(EVERY_CHECK)} checks: {len(EVERY_CHECK) - 3} ok, 3 fail"

    code, out, _ = await shepherd_cli({}, "doctor", "--json")
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert code == 1
    assert {key: checks["workers sim"][key] for key in ("status", "task_queue", "kind", "pollers", "gone")} == {
        "status": "fail",
        "task_queue": f"{queue}-provider-sim",
        "kind": "activity",
        "pollers": [],
        "gone": [],
    }


def test_many_pollers_are_shortened_to_the_latest_three_and_a_count():
    now = datetime.now(UTC)
    pollers = [Poller(f"{pid}@worker{pid}", now - timedelta(seconds=pid)) for pid in range(1, 6)]
    assert shown_identities(pollers[:1]) == "1@worker1"
    assert shown_identities(pollers[:3]) == "1@worker1, 2@worker2, 3@worker3"
    assert shown_identities(pollers) == "1@worker1, 2@worker2, 3@worker3 and 2 more"


async def test_an_unreachable_temporal_fails_and_skips_what_needs_it(installation, shepherd_cli):
    port = free_port()
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_TEMPORAL_ADDRESS": f"127.0.0.1:{port}"})
    assert_only_these_fail(
        report,
        {"temporal"},
        {
            "temporal namespace",
            "search attributes",
            "workers",
            "workers sim",
            "workers sim machines",
            "fleet sim",
            "temporal clock",
        },
    )
    assert report.detail("temporal") == (
        f"cannot reach Temporal at 127.0.0.1:{port} (Shepherd setting temporal_address), namespace "
        f"'{installation.env['SHEPHERD_TEMPORAL_NAMESPACE']}': nothing listens at 127.0.0.1:{port} (connection "
        "refused): is Temporal's frontend there?"
    )
    assert report.detail("temporal namespace") == "needs temporal, which failed"
    assert report.detail("fleet sim") == "needs temporal namespace; temporal failed"
    assert report.detail("workers") == "needs temporal namespace; temporal failed"

    code, out, _ = await shepherd_cli({}, "doctor", "--json")
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert code == 1 and checks["temporal"]["status"] == "fail"
    assert checks["search attributes"] == {
        "name": "search attributes",
        "status": "skipped",
        "detail": "needs temporal namespace; temporal failed",
        "needs": ["temporal namespace"],
        "failed": ["temporal"],
    }


async def test_an_unreachable_bmdb_fails_without_its_password_and_skips_what_needs_it(installation, shepherd_cli):
    port = free_port()
    url = f"postgresql://shepherd:secret-pw@127.0.0.1:{port}/bmdb"
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_DATABASE_URL": url})
    assert_only_these_fail(report, {"bmdb"}, {"bmdb schema", "bmdb clock"})
    detail = report.detail("bmdb")
    assert detail.startswith(f"BMDB at postgresql://shepherd:***@127.0.0.1:{port}/bmdb ")
    assert "refused" in detail and detail.endswith("(setting database_url)")
    assert "secret-pw" not in detail and report.detail("bmdb schema") == "needs bmdb, which failed"


@pytest.mark.parametrize("migrated", [True, False], ids=["one migration behind", "not migrated"])
async def test_a_schema_behind_fails_naming_the_migration(installation, shepherd_cli, postgres_server, migrated):
    head = migrate.head_revision()
    before_head = ScriptDirectory.from_config(migrate.alembic_config()).get_revision(head).down_revision
    assert isinstance(before_head, str)
    behind = before_head if migrated else None
    name = f"behind_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = database_url(postgres_server, name)
    if behind is not None:
        await asyncio.to_thread(migrate.upgrade, url, behind)
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_DATABASE_URL": url})
    assert_only_these_fail(report, {"bmdb schema"})
    assert report.detail("bmdb schema").endswith(
        f"has schema revision {behind or 'none'}, this Shepherd needs {head}: run `shepherd migrate`"
    )


async def test_a_schema_newer_than_this_shepherd_fails_without_asking_to_migrate(installation, shepherd_cli, bmdb_url):
    with psycopg.connect(bmdb_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    report = await doctor(shepherd_cli, installation.env)
    assert_only_these_fail(report, {"bmdb schema"})
    assert report.detail("bmdb schema").endswith(
        f"has schema revision 9999_from_the_future, newer than this Shepherd knows (it needs "
        f"{migrate.head_revision()}): a newer Shepherd migrated it; run that version"
    )


async def test_a_heartbeat_certificate_from_another_ca_fails(installation, shepherd_cli):
    stranger = CertificateAuthority("another CA", days_from_now(-400), days_from_now(3650))
    endpoint = await installation.serve_heartbeats(stranger, days_from_now(365))
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_ENDPOINT": endpoint})
    assert_only_these_fail(report, {"heartbeat endpoint certificate"})
    ca = installation.tmp_path / "agents-ca.pem"
    assert report.detail("heartbeat endpoint certificate").startswith(
        f"not verifiable with the agents' CA {ca}: unable to get local issuer certificate; it is for 127.0.0.1, "
        "issued by another CA, expires in 364 days ("
    )
    assert report.detail("heartbeat endpoint certificate").endswith(
        ": give the agents the CA that issued it (agent_endpoint_ca_certificate_path), or use one theirs issued"
    )


async def test_a_heartbeat_certificate_that_expired_while_served_fails(installation, shepherd_cli):
    # The heartbeat server refuses to start with an expired certificate, and serves on one that expires.
    not_after = datetime.now(UTC) + timedelta(seconds=2)
    endpoint = await installation.serve_heartbeats(installation.agents_ca, not_after)
    await asyncio.sleep((not_after - datetime.now(UTC)).total_seconds() + 0.1)
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_ENDPOINT": endpoint})
    assert_only_these_fail(report, {"heartbeat endpoint certificate"})
    ca = installation.tmp_path / "agents-ca.pem"
    assert report.detail("heartbeat endpoint certificate") == (
        f"not verifiable with the agents' CA {ca}: certificate has expired; it is for 127.0.0.1, issued by agents' "
        f"CA, expired today ({not_after:%Y-%m-%d %H:%M} UTC): renew it"
    )

    code, out, _ = await shepherd_cli({}, "doctor", "--json")
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert code == 1 and checks["heartbeat endpoint certificate"]["days_left"] == -1
    assert checks["heartbeat endpoint certificate"]["verify_error"] == "certificate has expired"


async def test_a_plain_text_or_absent_heartbeat_endpoint_fails(installation, shepherd_cli):
    service = HeartbeatService(installation.bmdb, interval=1.0, max_skew=60.0)
    plain, port = build_server(service, "127.0.0.1:0", None)
    await plain.start()
    installation.servers.append(plain)
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_ENDPOINT": f"127.0.0.1:{port}"})
    assert_only_these_fail(report, {"heartbeat endpoint"}, {"heartbeat endpoint certificate"})
    assert report.detail("heartbeat endpoint").startswith(f"127.0.0.1:{port} does not answer TLS (")

    closed = free_port()
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_ENDPOINT": f"127.0.0.1:{closed}"})
    assert_only_these_fail(report, {"heartbeat endpoint"}, {"heartbeat endpoint certificate"})
    assert report.detail("heartbeat endpoint").startswith(f"nothing listens at 127.0.0.1:{closed} (connection refused)")


async def test_an_ssh_key_readable_by_others_fails(installation, shepherd_cli):
    key = installation.tmp_path / "ssh_key"
    key.chmod(0o644)
    report = await doctor(shepherd_cli, installation.env)
    assert_only_these_fail(report, {"ssh key"})
    assert report.detail("ssh key") == (
        f"SSH key {key}: is accessible by group or others (mode 0644); a private key must be private: "
        f"run `chmod 600 {key}`"
    )


async def test_a_missing_agent_executable_fails(installation, shepherd_cli):
    missing = installation.tmp_path / "nowhere" / "agent"
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_EXECUTABLE_PATH": str(missing)})
    assert_only_these_fail(report, {"agent executable"})
    assert report.detail("agent executable") == f"{missing} does not exist (agent_executable_path)"


def half_written_copy(executable: Path, copy: Path) -> Path:
    whole = executable.read_bytes()
    copy.write_bytes(whole[: len(whole) // 2])
    copy.chmod(0o755)
    return copy


async def test_an_agent_executable_a_worker_would_refuse_fails(installation, shepherd_cli):
    agent = Path(installation.env["SHEPHERD_AGENT_EXECUTABLE_PATH"])
    half = half_written_copy(agent, installation.tmp_path / "half-written-agent")
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_EXECUTABLE_PATH": str(half)})
    assert_only_these_fail(report, {"agent executable"})
    detail = report.detail("agent executable")
    assert detail.startswith(f"{half} ") and detail.endswith(" (agent_executable_path)"), detail
    assert "cut short" in detail or "damaged" in detail, detail


async def test_an_empty_agent_executable_fails(installation, shepherd_cli):
    empty = installation.tmp_path / "empty-agent"
    empty.touch(mode=0o755)
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_AGENT_EXECUTABLE_PATH": str(empty)})
    assert_only_these_fail(report, {"agent executable"})
    assert report.detail("agent executable") == f"{empty} is empty (agent_executable_path)"


async def test_each_agent_executable_is_shown_with_its_sha256_and_the_machines_it_runs_on(installation, shepherd_cli):
    agent = Path(installation.env["SHEPHERD_AGENT_EXECUTABLE_PATH"])
    foreign = installation.tmp_path / "agent-aarch64"
    foreign.write_bytes(elf(AARCH64))
    both = f"{agent}:{foreign}"
    sha256 = hashlib.sha256(agent.read_bytes()).hexdigest()  # noqa: ASYNC240 (a file of the test's own)
    _, out, _ = await shepherd_cli({**installation.env, "SHEPHERD_AGENT_EXECUTABLE_PATH": both}, "doctor", "--json")
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "agent executable"]
    assert check["status"] == "ok", check
    first, second = check["executables"]
    assert first["sha256"] == sha256
    assert first["runs_on"].startswith(f"{platform.machine()}, glibc ") and first["runs_on"].endswith(" or newer")
    assert (second["path"], second["runs_on"]) == (str(foreign), "aarch64, glibc")
    assert f"sha256 {first['sha256'][:16]}" in check["detail"]


async def test_an_unreachable_provider_fails(installation, shepherd_cli):
    port = free_port()
    report = await doctor(shepherd_cli, {**installation.env, "SHEPHERD_SIM_API_URL": f"http://127.0.0.1:{port}"})
    assert_only_these_fail(report, {"provider sim"})
    assert report.detail("provider sim").startswith(f"list machines (GET http://127.0.0.1:{port}/v1/machines): ")


def test_the_embedded_stack_is_checked_with_its_own_settings(tmp_path):
    """What `shepherd dev` left in the state dir: doctor takes the stack's settings, not the environment's."""
    state = tmp_path / "state"
    state.mkdir()
    base = Settings(state_dir=state)
    assert embedded_stack(base) is None
    (state / "temporal.db").write_bytes(b"")
    (state / "dev-providers.toml").write_text("\n")
    embedded = embedded_stack(base)
    assert embedded is not None
    assert embedded.temporal_address == "127.0.0.1:7233" and embedded.temporal_namespace == "default"
    assert embedded.agent_endpoint == AGENT_ENDPOINT
    assert embedded.agent_endpoint_ca_certificate_path == state / "tls" / "ca.pem"
    assert embedded.agent_executable_path == state / "agent"
    assert [instance.name for instance in embedded.provider_instances] == ["sim"]
    # A BMDB of its own is no embedded stack's.
    assert embedded_stack(base.replace(database_url="postgresql://db.example.net/bmdb")) is None

    inventory = tmp_path / "inventory.toml"
    (state / "dev-providers.toml").write_text(
        f'[[providers]]\nname = "static"\ntype = "static"\ninventory = "{inventory}"\n'
    )
    embedded = embedded_stack(base.replace(agent_endpoint="10.0.0.5:8900"))
    assert embedded is not None and embedded.agent_endpoint == "10.0.0.5:8900"
    assert embedded.agent_endpoint_ca_certificate_path == state / "tls" / "10.0.0.5" / "ca.pem"
    assert [(i.name, i.options["inventory"]) for i in embedded.provider_instances] == [("static", str(inventory))]
