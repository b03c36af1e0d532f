"""The shepherd command refuses to start on bad settings or unreachable services, in one line."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys

import pytest

from agent.build import build_agent_executable
from bmdb import migrate
from tests.conftest import register_bare_namespace
from tests.test_operator_api_certificates import machines_as_printed


def shepherd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    return subprocess.run(
        [sys.executable, "-m", "shepherd", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def agent_env(tmp_path) -> dict[str, str]:
    return {
        "SHEPHERD_AGENT_EXECUTABLE_PATH": str(build_agent_executable(tmp_path / "agent")),
        "SHEPHERD_AGENT_ENDPOINT": "127.0.0.1:8900",
        "SHEPHERD_STATE_DIR": str(tmp_path / "state"),
    }


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"SHEPHERD_AGENT_EXECUTABLE_PATH": ""}, "agent_executable_path"),
        ({"SHEPHERD_AGENT_EXECUTABLE_PATH": "/nonexistent/agent"}, "agent_executable_path"),
        ({"SHEPHERD_AGENT_ENDPOINT": ""}, "agent_endpoint"),
        ({"SHEPHERD_SSH_CONNECT_TIMEOUT": "0"}, "ssh_connect_timeout"),
        ({"SHEPHERD_SSH_EXEC_TIMEOUT": "-1"}, "ssh_exec_timeout"),
        ({"SHEPHERD_DATABASE_URL": "sqlite:///x"}, "database_url"),
        ({"SHEPHERD_METRICS_LISTEN": "9464"}, "metrics_listen"),
        ({"SHEPHERD_METRICS_LISTEN": "0.0.0.0:99999"}, "metrics_listen"),
        ({"SHEPHERD_LOG_FORMAT": "xml"}, "log_format"),
    ],
)
def test_worker_refuses_bad_settings_naming_them(agent_env, changes, setting):
    result = shepherd("worker", env={**agent_env, **changes})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and setting in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_worker_refuses_an_unreachable_temporal(agent_env):
    result = shepherd("worker", env={**agent_env, "SHEPHERD_TEMPORAL_ADDRESS": "127.0.0.1:1"})
    assert result.returncode == 1
    assert "temporal_address" in result.stderr and "Traceback" not in result.stderr


async def test_worker_refuses_a_namespace_without_the_search_attributes(agent_env, temporal_env):
    bare = await register_bare_namespace(temporal_env.client)
    env = {
        **agent_env,
        "SHEPHERD_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "SHEPHERD_TEMPORAL_NAMESPACE": bare,
    }
    result = await asyncio.to_thread(shepherd, "worker", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"namespace '{bare}' lacks the search attributes MachineStage, Provider, ProviderId, MachineId" in (
        result.stderr
    )
    assert f"temporal operator search-attribute create --namespace {bare} --name MachineId --type Keyword" in (
        result.stderr
    )


def test_worker_refuses_a_metrics_port_in_use(agent_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = shepherd("worker", env={**agent_env, "SHEPHERD_METRICS_LISTEN": f"127.0.0.1:{port}"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot serve /metrics on 127.0.0.1:{port} (setting metrics_listen)" in result.stderr


def test_worker_refuses_an_unreachable_database(agent_env, temporal_env, tmp_path):
    target = temporal_env.client.service_client.config.target_host
    env = {
        **agent_env,
        "SHEPHERD_TEMPORAL_ADDRESS": target,
        "SHEPHERD_DATABASE_URL": f"postgresql://shepherd:pw@/bmdb?host={tmp_path}",
    }
    result = shepherd("worker", env=env)
    assert result.returncode == 1
    assert "database_url" in result.stderr and "unreachable" in result.stderr
    assert "pw@" not in result.stderr and "Traceback" not in result.stderr


def test_worker_refuses_an_unmigrated_database(agent_env, temporal_env, postgres_server):
    import psycopg

    from tests.conftest import database_url

    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute("CREATE DATABASE empty_bmdb")
    target = temporal_env.client.service_client.config.target_host
    env = {
        **agent_env,
        "SHEPHERD_TEMPORAL_ADDRESS": target,
        "SHEPHERD_DATABASE_URL": database_url(postgres_server, "empty_bmdb"),
    }
    result = shepherd("worker", env=env)
    assert result.returncode == 1
    assert "shepherd migrate" in result.stderr


def test_migrate_then_migrate_again(postgres_server):
    import psycopg

    from tests.conftest import database_url

    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute("CREATE DATABASE migrated_by_cli")
    env = {"SHEPHERD_DATABASE_URL": database_url(postgres_server, "migrated_by_cli")}
    for _ in range(2):
        result = shepherd("migrate", env=env)
        assert result.returncode == 0, result.stderr
        assert f"schema revision {migrate.head_revision()}" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["dev", "--machines", "0"],
        ["dev", "--timeout", "soon"],
        ["dev", "--chaos-kills", "2"],
        ["dev", "--chaos", "--until-ready"],
        ["dev", "--chaos", "--chaos-interval", "0s"],
        ["recover", "node-0001"],
        ["recover", "node-0001", "--reason", "  "],
        ["recover", "node-0001", "--reason", "x" * 501],
        ["nonsense"],
        ["sim", "--machines", "0"],
    ],
)
def test_bad_arguments_are_usage_errors(args):
    result = shepherd(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.strip()


def printed_exports(lines: list[str]) -> dict[str, str]:
    """The variables of the export line `shepherd dev` prints for the commands to reach its operator API."""
    line = next(line for line in lines if "export SHEPHERD_API_URL=" in line)
    words = shlex.split(line[line.index("export ") :])[1:]
    return dict(word.split("=", 1) for word in words)


def test_dev_brings_a_fleet_up_recovers_it_from_chaos_and_stops_everything(tmp_path):
    argv = ["dev", "--machines", "3", "--chaos", "--chaos-interval", "1s", "--chaos-kills", "2"]
    argv += ["--until-ready", "--timeout", "4m", "--state-dir", str(tmp_path)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    dev = subprocess.Popen(
        [sys.executable, "-m", "shepherd", *argv],
        env=clean,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Its operator API answers the client certificate it printed while the chaos runs: a recovery first waits
        # out the stack's 20 s heartbeat timeout, so the stack is still up.
        assert dev.stdout is not None
        printed, machines = machines_as_printed(dev.stdout)
        # And the commands go through it with the exports it printed, as its admin.
        listed = shepherd("machines", "--json", env=printed_exports(printed))
        rest, _ = dev.communicate(timeout=360)
    finally:
        if dev.poll() is None:
            dev.send_signal(signal.SIGINT)  # it stops its children itself
            dev.wait(60)
    output = "".join(printed) + rest
    assert machines and {machine["provider"] for machine in machines} == {"sim"}, machines
    assert listed.returncode == 0, listed.stderr
    assert {machine["provider_id"] for machine in json.loads(listed.stdout)} >= {m["provider_id"] for m in machines}
    assert dev.returncode == 0, output
    assert output.count("chaos: killed the agent of") == 2
    assert "all 3 machines are WATCHING after 2 recoveries" in output
    again = shepherd(
        "dev", "--machines", "3", "--until-ready", "--timeout", "1ms", "--state-dir", str(tmp_path / "x"), timeout=300
    )
    assert again.returncode == 1
    assert "machines reached WATCHING within" in again.stderr


def test_config_prints_the_effective_settings_with_the_password_hidden(tmp_path):
    config = tmp_path / "shepherd.toml"
    config.write_text('max_machines = 7\ndatabase_url = "postgresql://shepherd:hunter2@db.example.net/bmdb"\n')
    result = shepherd("config", "--config", str(config), env={**os.environ, "SHEPHERD_CHUNK_SIZE": "3"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"max_machines = 7  # file {config}" in lines
    assert "chunk_size = 3  # environment SHEPHERD_CHUNK_SIZE" in lines
    assert "# temporal_namespace is unset  (default)" in lines
    assert "#   namespace = default  (default)" in lines
    assert f'database_url = "postgresql://shepherd:***@db.example.net/bmdb"  # file {config}' in lines
    assert "hunter2" not in result.stdout + result.stderr

    config.write_text("max_machine = 7\n")
    refused = shepherd("config", "--config", str(config))
    assert refused.returncode == 2 and refused.stdout == ""
    unknown = "setting max_machine (SHEPHERD_MAX_MACHINE): is not a setting Shepherd knows"
    assert refused.stderr == f"shepherd config: {unknown} (in {config})\n"


async def test_a_refused_start_exits_1_with_its_line_never_a_fatal_error(agent_env, temporal_env):
    # Refused after connecting: the SDK's native threads are alive, and an interpreter finalizing beside them
    # used to abort now and then ("Fatal Python error: PyGILState_Release", status 134). Several tries, since
    # it did not happen every time.
    env = {
        **agent_env,
        "SHEPHERD_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "SHEPHERD_TEMPORAL_NAMESPACE": "no-such-namespace",
        "SHEPHERD_METRICS_LISTEN": "127.0.0.1:0",
    }
    for _ in range(8):
        result = await asyncio.to_thread(shepherd, "worker", env=env)
        assert (result.returncode, result.stdout) == (1, ""), result.stderr
        assert result.stderr.splitlines() == [
            "shepherd worker: cannot list the search attributes of namespace 'no-such-namespace': "
            "Namespace no-such-namespace is not found."
        ]
