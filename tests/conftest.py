"""Session-wide real servers: PostgreSQL and a Temporal dev server.

Each test that touches BMDB gets a database of its own, copied from a
migrated template, so tests never see each other's rows.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from xdist.remote import Producer
from xdist.scheduler import LoadGroupScheduling

from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB
from foundation.temporal_payloads import DATA_CONVERTER
from lifecycle.contracts import SEARCH_ATTRIBUTES
from shepherd.commands.dev_stack.children import DevError, check_port_free

BIN = Path(sys.executable).parent
TEMPLATE_DB = "bmdb_template"


def database_url(server_url: str, database: str) -> str:
    return make_url(server_url).set(database=database).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = LocalPostgres(tmp_path_factory.mktemp("postgres") / "data")
    url = server.start()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    migrate.upgrade(database_url(url, TEMPLATE_DB))
    yield url
    server.stop()


@pytest.fixture
def bmdb_url(postgres_server: str) -> str:
    return fresh_bmdb(postgres_server)


@pytest.fixture(scope="module")
def bmdb_url_module(postgres_server: str) -> str:
    """A BMDB of its own for a module whose tests share one (the fuzz suite's many examples)."""
    return fresh_bmdb(postgres_server)


def fresh_bmdb(postgres_server: str) -> str:
    name = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    return database_url(postgres_server, name)


@pytest.fixture
async def bmdb(bmdb_url: str) -> AsyncIterator[BMDB]:
    db = BMDB(bmdb_url, pool_size=2)
    yield db
    await db.close()


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        data_converter=DATA_CONVERTER,
    )
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"), data_converter=DATA_CONVERTER
    )
    await register_search_attributes(env.client, env.client.namespace)
    yield env
    await env.shutdown()


async def register_search_attributes(client: Client, namespace: str) -> None:
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest

    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=namespace,
            search_attributes={key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for key in SEARCH_ATTRIBUTES},
        )
    )


async def register_bare_namespace(client: Client) -> str:
    """A new namespace without Shepherd's search attributes, once the server answers for it."""
    from google.protobuf.duration_pb2 import Duration
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest

    name = f"bare-{uuid.uuid4().hex[:10]}"
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=name, workflow_execution_retention_period=Duration(seconds=86400))
    )
    # A new namespace takes a moment to reach every part of the server.
    for _ in range(100):
        try:
            await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=name))
            return name
        except RPCError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"namespace {name} did not become usable")


async def create_namespace(env: WorkflowEnvironment) -> Client:
    """A client on a namespace of its own, with Shepherd's search attributes registered.

    Workflow ids are unique per namespace, so tests that bring up the same
    simulated machines (machine-sim-node-0001, ...) must not share one.
    """
    from google.protobuf.duration_pb2 import Duration
    from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest

    name = f"test-{uuid.uuid4().hex[:10]}"
    await env.client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=name, workflow_execution_retention_period=Duration(seconds=86400))
    )
    await register_search_attributes(env.client, name)
    client = await Client.connect(
        env.client.service_client.config.target_host, namespace=name, data_converter=DATA_CONVERTER
    )
    # A new namespace takes a moment to reach every part of the server.
    for _ in range(100):
        try:
            await client.count_workflows()
            return client
        except RPCError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"namespace {name} did not become usable")


@pytest.fixture
async def temporal_client(temporal_env: WorkflowEnvironment) -> Client:
    return await create_namespace(temporal_env)


@pytest.fixture
def shepherd_cli(monkeypatch, capsys):
    """Run ``shepherd ARGS`` in this process with extra environment; returns (exit code, stdout, stderr)."""
    from shepherd import cli

    configure = cli.configure_logging

    def configure_for_this_thread(*args: Any, **kwargs: Any) -> None:
        # Workers of the test's stack log from the test's own thread meanwhile: not into the command's stderr.
        configure(*args, **kwargs)
        command = threading.get_ident()
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda record: record.thread == command)

    monkeypatch.setattr(cli, "configure_logging", configure_for_this_thread)

    async def run(env: dict[str, str], *args: str) -> tuple[int, str, str]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # The command sets up logging on this test's captured stderr; later tests must not write to it.
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            code = await asyncio.to_thread(cli.main, list(args))
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        out, err = capsys.readouterr()
        return code, out, err

    return run


# Modules whose tests start `shepherd dev`, whose embedded stack listens on its fixed ports (Temporal 7233 and
# 8233, the simulator 8800, heartbeats 8900, the operator API 8443): with the suite spread over processes, one
# process runs them all.
FIXED_PORT_MODULES = {
    "test_cli",
    "test_dev_stop",
    "test_ironic_machines",
    "test_static_machines",
    "test_doctor",
    "test_observability",
}


# The embedded stack's fixed ports, and how long a test of those modules waits for the stack before it to let go of
# them (its processes are stopped, but a port is free only once the kernel has closed the socket).
DEV_PORTS = (7233, 8233, 8800, 8900, 8443)
DEV_PORTS_WAIT = 60.0


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def _taken(port: int) -> bool:
    """Whether `shepherd dev` would find the port taken, asked by its own check."""
    try:
        check_port_free(port, "a port of the embedded stack")
    except DevError:
        return True
    return False


@pytest.fixture(autouse=True)
def dev_ports_free(request: pytest.FixtureRequest) -> None:
    """Before a test of a module that starts `shepherd dev`: its ports free, or a failure naming who holds them."""
    if _module_of(request.node) not in FIXED_PORT_MODULES:
        return
    deadline = time.monotonic() + DEV_PORTS_WAIT
    while taken := [port for port in DEV_PORTS if _taken(port)]:
        if time.monotonic() > deadline:
            listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, check=False).stdout
            holders = [line for line in listening.splitlines() if any(f":{port} " in line for port in taken)]
            raise AssertionError(f"ports {taken} of `shepherd dev` are still taken: {holders}")
        time.sleep(0.2)


def _group_of(nodeid: str) -> str:
    """The process group of a test: its module's, or one for all the modules of FIXED_PORT_MODULES."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "fixed-ports" if module in FIXED_PORT_MODULES else module


class ModuleGroupScheduling(LoadGroupScheduling):
    """pytest-xdist's --dist loadgroup, each test in the group _group_of names: a module's tests stay in one
    process, so its module fixtures (an Ironic, a fleet stack) start once, and the modules of FIXED_PORT_MODULES
    share one process.

    pytest-xdist's own loadgroup reads a test's group from a suffix that its hook adds to the test's node id, and
    pytest 9.2 no longer lets a plugin change a node id (pytest-xdist issue 1386): with xdist_group marks alone,
    every test would be spread on its own, the modules of FIXED_PORT_MODULES at the same time, all on the same
    ports. The group comes from the node id instead.
    """

    def _split_scope(self, nodeid: str) -> str:
        return _group_of(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadGroupScheduling | None:
    """The scheduler of --dist loadgroup; pytest-xdist's own for the other modes."""
    if config.getvalue("dist") == "loadgroup":
        return ModuleGroupScheduling(config, log)
    return None
