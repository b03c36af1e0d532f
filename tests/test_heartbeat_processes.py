"""shepherd heartbeat-server --processes N: several processes on one port, started and stopped as one."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent.heartbeat import signed_heartbeat
from bmdb.store import BMDB
from foundation.procfs import children_of
from proto import agent_api_pb2_grpc
from shepherd.cli import main
from tests.ports import free_port

STOP_TIMEOUT = 30.0


def two_free_ports() -> int:
    """A port free with the next one too, for the metrics of two processes."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def accepted_by(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("shepherd_heartbeat_requests_total{") and 'result="accepted"' in line
    )


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def server_processes(parent: int) -> list[int]:
    return children_of(parent, mentioning="spawn_main")


@contextmanager
def heartbeat_servers(
    bmdb_url: str, port: int, tmp_path: Path, metrics_port: int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    env = {
        **os.environ,
        "SHEPHERD_METRICS_LISTEN": f"127.0.0.1:{metrics_port}" if metrics_port else "",
        "SHEPHERD_DATABASE_URL": bmdb_url,
        "SHEPHERD_HEARTBEAT_PLAINTEXT": "true",
        "SHEPHERD_STATE_DIR": str(tmp_path),
    }
    command = [sys.executable, "-m", "shepherd", "heartbeat-server", "--processes", "2"]
    command += ["--listen", f"127.0.0.1:{port}"]
    parent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield parent
    finally:
        for pid in server_processes(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


async def accepted_over_new_connections(port: int, machine_id: str, key: Ed25519PrivateKey, count: int) -> int:
    """Heartbeats accepted, each over a connection of its own: the kernel spreads them over the processes."""
    accepted = 0
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    for n in range(count):
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            stub = agent_api_pb2_grpc.AgentCallbackStub(channel)
            for _ in range(100):
                try:
                    await stub.Heartbeat(signed_heartbeat(machine_id, key, now_ms=now_ms + n), timeout=5)
                    accepted += 1
                    break
                except grpc.aio.AioRpcError as error:
                    if error.code() != grpc.StatusCode.UNAVAILABLE:  # not listening yet
                        raise
                    await asyncio.sleep(0.2)
    return accepted


async def started_agent(bmdb: BMDB) -> tuple[str, Ed25519PrivateKey]:
    machine_id, _ = await bmdb.admit_machine("sim", "node-0001")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    await bmdb.record_agent_started(machine_id, datetime.now(UTC), public)
    return str(machine_id), key


async def test_processes_share_the_port_and_stop_together_on_sigterm(bmdb, bmdb_url, tmp_path):
    machine_id, key = await started_agent(bmdb)
    port, metrics_port = free_port(), two_free_ports()
    with heartbeat_servers(bmdb_url, port, tmp_path, metrics_port) as parent:
        assert await accepted_over_new_connections(port, machine_id, key, 30) == 30
        children = server_processes(parent.pid)
        assert len(children) == 2
        # Thirty connections all landing on one process would be a chance of one in 500 million.
        by_process = [await asyncio.to_thread(accepted_by, metrics_port + n) for n in range(2)]
        assert sum(by_process) == 30 and min(by_process) > 0, by_process
        parent.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(parent.wait, STOP_TIMEOUT) == 0
        assert not [pid for pid in children if running(pid)], "every process stopped"
        _, err = parent.communicate()
    assert err.decode().count("heartbeat server on 127.0.0.1") == 2
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # the port is free again


async def test_one_process_that_dies_stops_the_others_and_says_which(bmdb, bmdb_url, tmp_path):
    machine_id, key = await started_agent(bmdb)
    port = free_port()
    with heartbeat_servers(bmdb_url, port, tmp_path) as parent:
        assert await accepted_over_new_connections(port, machine_id, key, 1) == 1
        victim, other = server_processes(parent.pid)
        os.kill(victim, signal.SIGKILL)
        assert await asyncio.to_thread(parent.wait, STOP_TIMEOUT) == 1
        _, err = parent.communicate()
        assert not running(other)
    lines = err.decode().strip().splitlines()
    assert lines[-1].startswith("shepherd heartbeat-server: heartbeat server process heartbeat-server-")
    assert "stopped with status -9" in lines[-1]


async def test_a_taken_port_is_refused_before_any_process_starts(bmdb_url, shepherd_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            "SHEPHERD_DATABASE_URL": bmdb_url,
            "SHEPHERD_HEARTBEAT_PLAINTEXT": "true",
            "SHEPHERD_HEARTBEAT_LISTEN": f"127.0.0.1:{port}",
        }
        code, out, err = await shepherd_cli(env, "heartbeat-server", "--processes", "2")
    assert (code, out) == (1, "")
    assert err == (
        f"shepherd heartbeat-server: cannot listen on 127.0.0.1:{port}: the port is taken, or the address is not "
        "this host's\n"
    )


@pytest.mark.parametrize("processes", ["0", "-1", "two"])
def test_processes_must_be_a_positive_count(processes, capsys):
    with pytest.raises(SystemExit) as usage:
        main(["heartbeat-server", "--processes", processes])
    assert usage.value.code == 2
    assert "argument --processes:" in capsys.readouterr().err
