"""BMDB's roles on a real PostgreSQL: each process's credential can do what its process does, and nothing more.

The heartbeat server, run with a login user granted shepherd_heartbeat alone, records heartbeats; with that
credential a hold cannot be released, a heartbeat deleted, a machine changed or an event written. The workers'
role writes every row and changes no table; operators' reads only read. The roles are the cluster's: made by the
first BMDB that needs them, taken as they are by the next, and dropped on a downgrade only when nothing holds them.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import grpc
import psycopg
import pytest
import yaml
from alembic import command
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from agent.heartbeat import signed_heartbeat
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.schema import metadata
from bmdb.store import BMDB, sqlalchemy_url
from foundation.settings import Settings
from foundation.tls import local_certificates
from lifecycle.contracts import MachineStage
from proto import agent_api_pb2_grpc
from shepherd.commands.doctor import Doctor
from shepherd.commands.doctor_checks.verdicts import Status
from tests.conftest import database_url, fresh_bmdb
from tests.fleet_stack import fleet_stack
from tests.ports import free_port
from tests.sandbox import confined

# Written out here rather than read from the migration, so that a grant made broader there fails here.
HEARTBEAT = "shepherd_heartbeat"
WORKER = "shepherd_worker"
READER = "shepherd_reader"
ROLES = (HEARTBEAT, WORKER, READER)
# (relation, column or None for the whole relation, privilege): exactly what the heartbeat server's statements use.
HEARTBEAT_PRIVILEGES = {
    ("machine_agent_started", "machine_id", "SELECT"),
    ("machine_agent_started", "agent_public_key", "SELECT"),
    ("machine_agent_heartbeat", "machine_id", "SELECT"),
    ("machine_agent_heartbeat", "agent_heartbeat_at", "SELECT"),
    ("machine_agent_heartbeat", "agent_sent_at", "SELECT"),
    ("machine_agent_heartbeat", "machine_id", "INSERT"),
    ("machine_agent_heartbeat", "agent_heartbeat_at", "INSERT"),
    ("machine_agent_heartbeat", "agent_sent_at", "INSERT"),
    ("machine_agent_heartbeat", "agent_heartbeat_at", "UPDATE"),
    ("machine_agent_heartbeat", "agent_sent_at", "UPDATE"),
    ("alembic_version", None, "SELECT"),
}
SCHEMA_VERSION = ("alembic_version", None, "SELECT")
# What a role (or PUBLIC, which every role is) is granted on this database's relations and their columns.
GRANTED = """
    SELECT c.relname, NULL, a.privilege_type
    FROM pg_class AS c, aclexplode(c.relacl) AS a
    WHERE c.relnamespace = current_schema()::regnamespace AND a.grantee IN (0, %(role)s::regrole)
    UNION ALL
    SELECT c.relname, attribute.attname, a.privilege_type
    FROM pg_attribute AS attribute JOIN pg_class AS c ON c.oid = attribute.attrelid, aclexplode(attribute.attacl) AS a
    WHERE c.relnamespace = current_schema()::regnamespace AND a.grantee IN (0, %(role)s::regrole)
"""
ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_UNIT = ROOT / "deploy" / "systemd" / "shepherd-heartbeat-server.service"
WORKER_UNIT = ROOT / "deploy" / "systemd" / "shepherd-worker.service"
DENIED = "42501"  # insufficient_privilege
PASSWORD = "not-for-the-report-4b1e"
STOP_TIMEOUT = 30.0
# Longest a fleet pass of one machine may take.
PASS_TIMEOUT = 60.0


T = TypeVar("T")


def login_url(url: str, user: str) -> str:
    return make_url(url).set(username=user).render_as_string(hide_password=False)


@dataclass(frozen=True)
class Credentials:
    """A BMDB of this module's, and a login user for each role: the credentials a deployment hands out."""

    owner: str
    heartbeat: str
    worker: str
    reader: str


@pytest.fixture(scope="module")
def credentials(postgres_server: str) -> Iterator[Credentials]:
    owner = fresh_bmdb(postgres_server)
    # Login users are the cluster's, as the roles are: named for this run alone.
    suffix = uuid.uuid4().hex[:8]
    users = {role: f"{role.removeprefix('shepherd_')}_{suffix}" for role in ROLES}
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        for role, user in users.items():
            conn.execute(f"CREATE ROLE {user} LOGIN IN ROLE {role}")
    try:
        yield Credentials(owner, *(login_url(owner, users[role]) for role in ROLES))
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {make_url(owner).database} WITH (FORCE)")
            for user in users.values():
                conn.execute(f"DROP ROLE {user}")


@pytest.fixture
async def stores(credentials: Credentials) -> AsyncIterator[dict[str, BMDB]]:
    opened = {
        "worker": BMDB(credentials.worker, pool_size=1),
        "heartbeat": BMDB(credentials.heartbeat, pool_size=1),
        "reader": BMDB(credentials.reader, pool_size=1),
    }
    yield opened
    for bmdb in opened.values():
        await bmdb.close()


def granted(url: str, role: str) -> set[tuple[str, str | None, str]]:
    with psycopg.connect(url) as conn:
        return {(row[0], row[1], row[2]) for row in conn.execute(GRANTED, {"role": role})}


def every_table(privileges: tuple[str, ...]) -> set[tuple[str, str | None, str]]:
    return {(table, None, privilege) for table in metadata.tables for privilege in privileges}


def test_each_role_is_granted_exactly_what_its_process_uses(credentials):
    assert granted(credentials.owner, HEARTBEAT) == HEARTBEAT_PRIVILEGES
    # Every table of the schema the code uses, so that a migration adding one must grant it too.
    assert granted(credentials.owner, WORKER) == every_table(("SELECT", "INSERT", "UPDATE", "DELETE")) | {
        ("events_event_id_seq", None, "USAGE"),
        ("events_event_id_seq", None, "SELECT"),
        SCHEMA_VERSION,
    }
    assert granted(credentials.owner, READER) == every_table(("SELECT",)) | {SCHEMA_VERSION}
    with psycopg.connect(credentials.owner) as conn:
        attributes = conn.execute(
            "SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls, rolreplication, "
            "rolinherit FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname",
            [list(ROLES)],
        ).fetchall()
        # A group role of another role would hand on that one's privileges too.
        memberships = conn.execute(
            "SELECT r.rolname FROM pg_auth_members AS m JOIN pg_roles AS r ON r.oid = m.member "
            "WHERE r.rolname = ANY(%s)",
            [list(ROLES)],
        ).fetchall()
    assert attributes == [(role, False, False, False, False, False, False, True) for role in sorted(ROLES)]
    assert memberships == []


def unit_directive(unit: Path, key: str) -> list[str]:
    """The values of every `key=` line of a systemd unit, in order."""
    return [line.partition("=")[2] for line in unit.read_text().splitlines() if line.startswith(f"{key}=")]


@contextmanager
def confined_shepherd(
    args: list[str], unit: Path, env: dict[str, str], url_setting: str, tmp: Path, writable: Sequence[Path] = ()
) -> Iterator[subprocess.Popen[str]]:
    """`shepherd ARGS` confined as its systemd unit confines it (nothing written but the writable paths and its
    private temporary directory, no capabilities, no W^X memory, only the unit's system calls, /proc as the unit
    has it), with the BMDB URL of env's url_setting as its credential."""
    # PostgreSQL's socket lies in its data directory, which only its own user may enter.
    url = make_url(env[url_setting])
    socket_name = f".s.PGSQL.{url.port or 5432}"
    seen_at = tmp.parent / "bmdb-socket"
    env[url_setting] = url.update_query_dict({"host": str(seen_at)}).render_as_string(hide_password=False)
    sockets = {Path(str(url.query["host"])) / socket_name: seen_at / socket_name}
    command = confined(
        [sys.executable, "-m", "shepherd", *args],
        syscall_filter=unit_directive(unit, "SystemCallFilter"),
        writable=writable,
        private_tmp=tmp,
        env=env,
        protect_proc=(unit_directive(unit, "ProtectProc") or ["default"])[-1],
        proc_subset=(unit_directive(unit, "ProcSubset") or ["all"])[-1],
        sockets=sockets,
    )
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


async def while_running(process: subprocess.Popen[str], work: Awaitable[T], limit: float) -> T:
    """What work comes to; failing at once, with the process's log, when the process stops first."""
    task = asyncio.ensure_future(work)
    deadline = asyncio.get_running_loop().time() + limit
    try:
        while not task.done():
            if process.poll() is not None:
                raise AssertionError(f"the process stopped: {process.communicate()[1]}")
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not done within {limit}s")
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
    finally:
        task.cancel()


def stop(server: subprocess.Popen[str]) -> str:
    """Stop the server as systemd does, with SIGTERM; its log."""
    server.send_signal(signal.SIGTERM)
    _, log = server.communicate(timeout=STOP_TIMEOUT)
    assert server.returncode == 0, log
    return log


@dataclass(frozen=True)
class Agent:
    machine_id: uuid.UUID
    key: Ed25519PrivateKey


async def heartbeat(
    server: subprocess.Popen[str], stub: agent_api_pb2_grpc.AgentCallbackStub, agent: Agent, now_ms: int
) -> None:
    """One heartbeat through the server, once it listens."""
    for _ in range(150):
        try:
            await stub.Heartbeat(signed_heartbeat(str(agent.machine_id), agent.key, now_ms=now_ms), timeout=5)
            return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:  # not listening yet
                raise
        if server.poll() is not None:
            raise AssertionError(f"the heartbeat server stopped: {server.communicate()[1]}")
        await asyncio.sleep(0.2)
    raise AssertionError("the heartbeat server never answered")


async def denied(operation: Callable[[], Awaitable[object]]) -> str:
    """The SQLSTATE an operation failed with; it must fail."""
    with pytest.raises(ProgrammingError) as raised:
        await operation()
    return str(getattr(raised.value.orig, "sqlstate", ""))


async def test_the_heartbeat_server_confined_records_heartbeats_with_its_own_credential_and_can_do_nothing_else(
    credentials, stores, tmp_path
):
    worker, heartbeat_store, reader = stores["worker"], stores["heartbeat"], stores["reader"]
    # What the workers wrote before, with their own credential: a machine, its agent, and a hold of its provider.
    machine_id, _ = await worker.admit_machine("sim", "node-hb-0001")
    await worker.record_provided(machine_id, address="10.0.0.1", ssh_port=22, location=None)
    agent = Agent(machine_id, Ed25519PrivateKey.generate())
    public = agent.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await worker.record_takeover(machine_id, datetime.now(UTC), public, "ssh-ed25519 AAAA", "agent 1")
    await worker.hold_recoveries("sim", reason="many silent", silent_count=9, threshold=5, sample=["node-hb-0001"])

    port = free_port()
    tls = local_certificates(tmp_path / "tls")
    env = {
        **os.environ,
        # Nothing answers here: a server that used the workers' URL instead would not start.
        "SHEPHERD_DATABASE_URL": "postgresql://worker@127.0.0.1:1/bmdb?connect_timeout=2",
        "SHEPHERD_HEARTBEAT_TLS_CERTIFICATE_PATH": str(tls.server_certificate),
        "SHEPHERD_HEARTBEAT_TLS_KEY_PATH": str(tls.server_key),
        "SHEPHERD_HEARTBEAT_DATABASE_URL": credentials.heartbeat,
        "SHEPHERD_STATE_DIR": str(tmp_path / "state"),
        "SHEPHERD_METRICS_LISTEN": "",
    }
    credentials_of_tls = grpc.ssl_channel_credentials(root_certificates=tls.ca_certificate.read_bytes())
    # Two processes on the port, as a larger host runs it.
    args = ["heartbeat-server", "--listen", f"127.0.0.1:{port}", "--processes", "2"]
    with confined_shepherd(args, HEARTBEAT_UNIT, env, "SHEPHERD_HEARTBEAT_DATABASE_URL", tmp_path / "tmp") as server:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials_of_tls) as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            now_ms = int(datetime.now(UTC).timestamp() * 1000)
            # The first heartbeat inserts its row, the second takes the upsert's update.
            await heartbeat(server, stub, agent, now_ms)
            first = await reader.get_machine(machine_id)
            await heartbeat(server, stub, agent, now_ms + 1000)
            second = await reader.get_machine(machine_id)
        log = await asyncio.to_thread(stop, server)
    # Each process loaded the keys at its start, with the same credential.
    assert log.count("1 agent keys loaded") == 2 and "could not load" not in log, log
    assert first is not None and second is not None
    assert first.agent_heartbeat_at is not None and second.agent_heartbeat_at is not None
    assert second.agent_heartbeat_at > first.agent_heartbeat_at

    # A compromised heartbeat server, trying the store's own ways and plain SQL.
    async def sql(statement: str) -> None:
        async with heartbeat_store.engine.begin() as conn:
            await conn.execute(text(statement))

    attempts: dict[str, Callable[[], Awaitable[object]]] = {
        "release a recovery hold": lambda: heartbeat_store.release_recoveries("sim", by="intruder", reason="go"),
        "delete a heartbeat": lambda: heartbeat_store.forget_agent(machine_id, "gone"),
        "change a machine": lambda: heartbeat_store.set_maintenance(machine_id, True, "hands off"),
        "write an event": lambda: heartbeat_store.add_event(machine_id, "force_recover", "by the heartbeat server"),
        "delete heartbeats by hand": lambda: sql("DELETE FROM machine_agent_heartbeat"),
        "swap an agent's key": lambda: sql("UPDATE machine_agent_started SET agent_public_key = '\\x00'"),
        "end a hold by hand": lambda: sql("UPDATE recovery_holds SET ended_at = now()"),
        "retire a machine by hand": lambda: sql("DELETE FROM machines"),
    }
    outcomes = {what: await denied(attempt) for what, attempt in attempts.items()}
    assert outcomes == dict.fromkeys(attempts, DENIED)
    # And nothing changed.
    assert (await worker.recovery_hold_state("sim"))[0]
    assert await reader.get_machine(machine_id) == second
    assert second.agent_public_key == public
    kinds = [event.kind for event in await reader.list_events(machine_id)]
    assert "maintenance_on" not in kinds and "force_recover" not in kinds


async def test_a_worker_confined_with_the_workers_role_takes_a_machine_over(
    credentials, bmdb_url, temporal_client, tmp_path
):
    async with fleet_stack(tmp_path, temporal_client, bmdb_url, machines=1, run_worker=False) as stack:
        worker_user = make_url(credentials.worker).username
        assert worker_user is not None
        env = {**os.environ, **stack.environment(login_url(bmdb_url, worker_user))}
        with confined_shepherd(
            ["worker"], WORKER_UNIT, env, "SHEPHERD_DATABASE_URL", tmp_path / "tmp", [stack.settings.state_dir]
        ) as worker:
            # Provisioned through the simulator, taken over through SSH, recorded in BMDB, all by the worker.
            await while_running(worker, stack.run_pass(), PASS_TIMEOUT)
            await while_running(worker, stack.wait_for_stage(["node-0001"], MachineStage.WATCHING), PASS_TIMEOUT)
            log = await asyncio.to_thread(stop, worker)
    assert "Traceback" not in log, log


async def test_the_workers_role_writes_every_row_and_changes_no_table(credentials, stores):
    worker = stores["worker"]
    machine_id, _ = await worker.admit_machine("sim", "node-w-0001")
    await worker.record_provided(machine_id, address="10.0.0.2", ssh_port=22, location="rack-1")
    await worker.record_takeover(machine_id, datetime.now(UTC), b"k" * 32, "ssh-ed25519 BBBB", "agent 1")
    assert await worker.record_heartbeat(machine_id, b"k" * 32, datetime.now(UTC))
    await worker.hold_recoveries("other", reason="many silent", silent_count=9, threshold=5, sample=[])
    assert (await worker.release_recoveries("other", by="alice", reason="checked"))[1]
    assert await worker.set_maintenance(machine_id, True, "disk swap")
    assert await worker.record_reboot(machine_id, "cycle-1", "silent")
    assert await worker.retire(machine_id, "end of life")
    assert "decommissioned" in [event.kind for event in await worker.list_events(machine_id)]

    async def sql(statement: str) -> None:
        async with worker.engine.begin() as conn:
            await conn.execute(text(statement))

    attempts: dict[str, Callable[[], Awaitable[object]]] = {
        "create a table": lambda: sql("CREATE TABLE intruder (id int)"),
        "add a column": lambda: sql("ALTER TABLE machines ADD COLUMN intruder text"),
        "drop a table": lambda: sql("DROP TABLE events"),
        "empty a table at once": lambda: sql("TRUNCATE events"),
        "add an index": lambda: sql("CREATE INDEX intruder ON events (kind)"),
    }
    outcomes = {what: await denied(attempt) for what, attempt in attempts.items()}
    assert outcomes == dict.fromkeys(attempts, DENIED)


async def test_operators_reads_only_read(stores):
    reader = stores["reader"]
    await reader.list_machines()
    await reader.list_events(None)
    assert await denied(lambda: reader.add_event(None, "fleet_paused", "by a reader")) == DENIED
    assert await denied(lambda: reader.admit_machine("sim", "node-r-0001")) == DENIED


def with_password(url: str) -> str:
    """The URL with a password, which this PostgreSQL does not ask for and nothing may show."""
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


async def test_doctor_and_config_show_the_heartbeat_credential_and_what_it_may_do(credentials, shepherd_cli):
    found = {}
    for user in ("heartbeat", "worker", "reader"):
        url = with_password(getattr(credentials, user))
        settings = Settings.from_env(
            {"SHEPHERD_DATABASE_URL": credentials.owner, "SHEPHERD_HEARTBEAT_DATABASE_URL": url}
        )
        doctor = Doctor(settings, timeout=10.0, environ={})
        async with doctor.stack:
            await doctor.bmdb_checks()
        found[user] = doctor.checks["bmdb heartbeat credential"]
    assert found["heartbeat"].status is Status.OK, found["heartbeat"]
    assert "allowed what the heartbeat server does and nothing more" in found["heartbeat"].detail
    # The workers' credential would let a heartbeat server broken into delete heartbeats and release holds.
    assert found["worker"].status is Status.WARN, found["worker"]
    assert "DELETE on machine_agent_heartbeat" in found["worker"].facts["beyond"]
    assert "UPDATE on recovery_holds" in found["worker"].facts["beyond"]
    assert found["worker"].facts["missing"] == []
    assert found["reader"].status is Status.FAIL, found["reader"]
    assert "no INSERT on machine_agent_heartbeat, UPDATE on machine_agent_heartbeat" in found["reader"].detail
    for check in found.values():
        assert PASSWORD not in check.line() and ":***@" in check.line(), check.line()

    code, out, err = await shepherd_cli(
        {"SHEPHERD_HEARTBEAT_DATABASE_URL": with_password(credentials.heartbeat)}, "config"
    )
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("heartbeat_database_url = ")]
    assert PASSWORD not in out + err and ":***@" in line, line


def downgrade(url: str, revision: str) -> list[str]:
    """Take BMDB at url down to revision; the notices the migrations raised."""
    notices: list[str] = []
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as connection, connection.begin():
            raw = connection.connection.dbapi_connection
            assert isinstance(raw, psycopg.Connection)
            raw.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
            config = migrate.alembic_config()
            config.attributes["connection"] = connection
            command.downgrade(config, revision)
    finally:
        engine.dispose()
    return notices


def roles_in(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname", [list(ROLES)])
        return [row[0] for row in rows]


def grantees_in(url: str) -> set[str]:
    """The Shepherd roles granted anything in the database at url."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT a.grantee::regrole::text FROM pg_class AS c, aclexplode(c.relacl) AS a "
            "WHERE c.relnamespace = current_schema()::regnamespace"
        )
        return {row[0] for row in rows} & set(ROLES)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    """A PostgreSQL of this test's alone: the roles are the cluster's, and this test drops them."""
    server = LocalPostgres(tmp_path / "postgres")
    url = server.start()
    yield url
    server.stop()


async def test_the_roles_are_made_once_for_the_cluster_and_dropped_only_when_nothing_holds_them(cluster, shepherd_cli):
    with psycopg.connect(cluster, autocommit=True) as conn:
        # Owners of a BMDB each: one may create roles, one may not.
        conn.execute("CREATE ROLE creator LOGIN CREATEROLE")
        conn.execute("CREATE ROLE plain LOGIN")
        conn.execute("CREATE DATABASE first OWNER creator")
        conn.execute("CREATE DATABASE second OWNER plain")
    first = login_url(database_url(cluster, "first"), "creator")
    second = login_url(database_url(cluster, "second"), "plain")

    # Without the roles, and without the right to make them, the migration says what to do and changes nothing.
    code, out, err = await shepherd_cli({"SHEPHERD_DATABASE_URL": second}, "migrate")
    assert (code, out) == (1, ""), err
    assert "the BMDB role shepherd_heartbeat does not exist and plain may not create roles" in err
    assert "CREATE ROLE shepherd_heartbeat NOLOGIN; CREATE ROLE shepherd_worker NOLOGIN;" in err
    assert len(err.splitlines()) == 1, err
    assert migrate.current_revision(second) is None

    migrate.upgrade(first)
    assert roles_in(cluster) == sorted(ROLES)
    # A second BMDB on the cluster takes the roles as they are, and grants them its own tables.
    migrate.upgrade(second)
    assert grantees_in(first) == grantees_in(second) == set(ROLES)

    # Going down takes this database's grants back; the roles stay while the first BMDB still grants them.
    downgrade(second, "0009")
    assert grantees_in(second) == set()
    assert grantees_in(first) == set(ROLES)
    assert roles_in(cluster) == sorted(ROLES)
    migrate.upgrade(second)
    assert grantees_in(second) == set(ROLES)
    downgrade(second, "0009")

    # A login user granted a role keeps it through a downgrade and an upgrade: that role is not dropped.
    with psycopg.connect(cluster, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE heartbeat_login LOGIN IN ROLE {HEARTBEAT}")
    notices = downgrade(first, "0009")
    assert notices == [f"the BMDB role {HEARTBEAT} is kept: login users are granted it"]
    assert roles_in(cluster) == [HEARTBEAT]
    migrate.upgrade(first)
    assert roles_in(cluster) == sorted(ROLES)
    with psycopg.connect(login_url(database_url(cluster, "first"), "heartbeat_login")) as conn:
        assert conn.execute("SELECT count(*) FROM machine_agent_started").fetchone() == (0,)

    # With nothing holding them, the roles go with the last BMDB's downgrade.
    with psycopg.connect(cluster, autocommit=True) as conn:
        conn.execute("DROP ROLE heartbeat_login")
    assert downgrade(first, "0009") == []
    assert roles_in(cluster) == []


def sql_blocks(path: Path, section: str) -> list[str]:
    """The ```sql blocks of one section of a Markdown file."""
    text = path.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```sql\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def members(url: str) -> set[tuple[str, str]]:
    """(role, login user) of every Shepherd role granted to a user."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT r.rolname, u.rolname FROM pg_auth_members AS m JOIN pg_roles AS r ON r.oid = m.roleid "
            "JOIN pg_roles AS u ON u.oid = m.member WHERE r.rolname = ANY(%s)",
            [list(ROLES)],
        )
        return {(row[0], row[1]) for row in rows}


def test_the_sql_operators_are_given_grants_each_user_its_role(cluster):
    """docs/operations.md's SQL, as a superuser runs it before a migration that may not make the roles and after
    it, and the compose file's, run twice: each login user ends up with its role, and with what that role allows."""
    roles_sql, users_sql = sql_blocks(ROOT / "docs" / "operations.md", "BMDB roles")
    with psycopg.connect(cluster, autocommit=True) as conn:
        conn.execute("CREATE DATABASE bmdb")
    bmdb = database_url(cluster, "bmdb")
    with psycopg.connect(bmdb, autocommit=True) as conn:
        conn.execute(roles_sql)
    migrate.upgrade(bmdb)
    with psycopg.connect(bmdb, autocommit=True) as conn:
        conn.execute(users_sql)
    expected = {(WORKER, "worker"), (HEARTBEAT, "heartbeat"), (READER, "reader")}
    assert members(bmdb) == expected

    (compose,) = yaml.safe_load_all((ROOT / "deploy" / "docker-compose.yml").read_text())
    service = compose["services"]["bmdb-users"]
    psql = shutil.which("psql")
    assert psql is not None, "psql is not installed (Debian: apt-get install postgresql-client)"
    socket_directory = make_url(cluster).query["host"]
    environment = {
        **os.environ,
        **service["environment"],
        "PGHOST": str(socket_directory),
        "PGUSER": "postgres",  # the compose file's owner is the postgres image's superuser
        "PATH": f"{Path(psql).parent}:{os.environ['PATH']}",
    }
    for _ in range(2):
        done = subprocess.run(
            [*service["entrypoint"], *service["command"]], env=environment, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
    assert members(bmdb) == expected

    with psycopg.connect(login_url(bmdb, "heartbeat")) as conn:
        conn.execute("SELECT machine_id, agent_public_key FROM machine_agent_started")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM machine_agent_heartbeat")
    with psycopg.connect(login_url(bmdb, "worker"), autocommit=True) as conn:
        conn.execute("INSERT INTO events (kind) VALUES ('by the worker')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DROP TABLE events")
    with psycopg.connect(login_url(bmdb, "reader")) as conn:
        assert conn.execute("SELECT kind FROM events").fetchall() == [("by the worker",)]
