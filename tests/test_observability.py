"""Metrics on /metrics of every long-running process, and log lines with the machine as fields."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
from cryptography import x509

from foundation.logs import ContextFilter, JsonFormatter, TextFormatter
from foundation.metrics import meter_of, metrics_runtime
from foundation.tls import days_left, local_certificates
from lifecycle.contracts import MachineStage
from simulator import Faults
from tests.fleet_stack import FleetStack, fleet_stack
from tests.ports import free_ports
from tests.test_fleet import sim_admin
from tests.test_recovery import wait_for

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Series:
    """Prometheus text exposition, parsed: (name, labels) -> value."""
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    series: Series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = frozenset(
            (key, raw.strip('"'))
            for key, _, raw in (item.partition("=") for item in labels.rstrip("}").split(",") if item)
        )
        series[(name, pairs)] = float(value)
    return series


def total(series: Series, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(value for (metric, pairs), value in series.items() if metric == name and wanted <= pairs)


@contextmanager
def process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    try:
        yield child
    finally:
        child.terminate()
        child.wait(30)


async def test_worker_heartbeat_server_and_simulator_serve_their_metrics(tmp_path, temporal_client, bmdb_url, bmdb):
    sim_port, worker_port, heartbeat_metrics_port, heartbeat_port = free_ports(4)
    sim_runtime = metrics_runtime(f"127.0.0.1:{sim_port}", "simulator")
    certificates = local_certificates(tmp_path / "tls")
    async with fleet_stack(
        tmp_path,
        temporal_client,
        bmdb_url,
        machines=2,
        run_worker=False,
        sim_meter=meter_of(sim_runtime),
        agent_endpoint=f"127.0.0.1:{heartbeat_port}",
        agent_endpoint_ca_certificate_path=certificates.ca_certificate,
        heartbeat_listen=f"127.0.0.1:{heartbeat_port}",
        heartbeat_tls_certificate_path=certificates.server_certificate,
        heartbeat_tls_key_path=certificates.server_key,
        heartbeat_interval=0.5,
        heartbeat_timeout=3.0,
        reconcile_interval=1.0,
    ) as stack:
        env = stack.environment(bmdb_url)
        shepherd = [sys.executable, "-m", "shepherd"]
        with (
            process(
                [*shepherd, "heartbeat-server"],
                {
                    **env,
                    "SHEPHERD_METRICS_LISTEN": f"127.0.0.1:{heartbeat_metrics_port}",
                    "SHEPHERD_LOG_FORMAT": "json",
                },
                tmp_path / "heartbeat-server.log",
            ),
            process(
                [*shepherd, "worker"],
                {**env, "SHEPHERD_METRICS_LISTEN": f"127.0.0.1:{worker_port}"},
                tmp_path / "worker.log",
            ),
        ):
            # The worker's fleet schedule runs the passes (every second here).
            await stack.wait_for_stage(["node-0001", "node-0002"], MachineStage.WATCHING)
            await kill_agent_and_wait_for_recovery(stack)

            async def worker_saw_fleet() -> Series | None:
                # The gauges count running workflows through Temporal's visibility, which for a moment after a
                # continue-as-new may still list the run that ended (RECOVERING) beside the new one (WATCHING).
                series = await scrape(worker_port)
                settled = total(series, "shepherd_machines", stage="RECOVERING") == 0
                return series if settled and total(series, "shepherd_machines", stage="WATCHING") == 2 else None

            worker_series = await wait_for(worker_saw_fleet, what="worker gauges")
            assert total(worker_series, "shepherd_takeovers_total", outcome="ok") >= 3
            assert total(worker_series, "shepherd_reconcile_passes_total", outcome="completed") >= 1
            assert total(worker_series, "shepherd_machines_admitted_total") == 2
            assert total(worker_series, "shepherd_silent_machines_signalled_total") >= 1
            # Its own watchdog took its turn at the start, beside the passes' looks.
            assert total(worker_series, "shepherd_watchdog_looks_total", provider="sim") >= 1
            assert total(worker_series, "shepherd_watchdog_looks_total", provider="sim", outcome="failed") == 0
            assert total(worker_series, "shepherd_recovery_reboots_total", cause="heartbeat_lost", outcome="ok") == 1
            assert total(worker_series, "shepherd_heartbeat_age_max_seconds") < 3
            silent_of_sim = frozenset({("shepherd_process", "worker"), ("provider", "sim"), *service()})
            assert ("shepherd_machines_silent", silent_of_sim) in worker_series
            assert total(worker_series, "shepherd_recoveries_held", provider="sim") == 0
            assert ("shepherd_recoveries_held", silent_of_sim) in worker_series
            assert total(worker_series, "shepherd_machines_stuck", provider="sim") == 0
            assert total(worker_series, "temporal_worker_task_slots_available", worker_type="ActivityWorker") > 0

            heartbeat_series = await scrape(heartbeat_metrics_port)
            assert total(heartbeat_series, "shepherd_heartbeat_requests_total", result="accepted") > 0
            # The agents, real processes, send on the Heartbeats stream.
            assert total(heartbeat_series, "shepherd_heartbeat_requests_total", result="accepted", call="stream") > 0

            # Days left of the certificates each holds: the CA agents are given, the certificate served to them.
            for series, certificate, path in (
                (worker_series, "agent_endpoint_ca", certificates.ca_certificate),
                (heartbeat_series, "heartbeat_server", certificates.server_certificate),
            ):
                exported = total(series, "shepherd_certificate_expiry_days", certificate=certificate)
                assert abs(exported - days_left(x509.load_pem_x509_certificate(path.read_bytes()))) < 0.01

            sim_series = await scrape(sim_port)
            assert total(sim_series, "shepherd_sim_api_requests_total", method="POST", route="/v1/machines") == 2
            assert total(sim_series, "shepherd_sim_reboots_total") == 1
            assert total(sim_series, "shepherd_sim_machines", status="active") == 2

    # Text lines carry the machine as fields, not the SDK's dict; JSON lines are JSON.
    worker_log = (tmp_path / "worker.log").read_text()
    record = (await bmdb.machines_with_provider_id("node-0001"))[0]
    rebooted = [line for line in worker_log.splitlines() if "rebooted sim machine node-0001" in line]
    assert rebooted and rebooted[0].endswith(
        f"[machine_id={record.machine_id} provider=sim provider_id=node-0001 workflow_id=machine-sim-node-0001]"
    )
    assert "({" not in worker_log
    heartbeat_log = (tmp_path / "heartbeat-server.log").read_text().splitlines()
    assert heartbeat_log and all(json.loads(line)["level"] for line in heartbeat_log)


def service() -> set[tuple[str, str]]:
    return {("service_name", "temporal-core-sdk")}


async def kill_agent_and_wait_for_recovery(stack: FleetStack) -> None:
    await sim_admin(stack, "/admin/machines/node-0001/kill-agent", {})

    async def recovered() -> bool:
        status = await stack.status("node-0001")
        return status.recovery_count == 1 and status.stage is MachineStage.WATCHING

    await wait_for(recovered, what="recovery of node-0001")


@contextmanager
def captured_log(formatter: logging.Formatter) -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_log_lines_name_the_machine_and_workflow(tmp_path, temporal_client, bmdb_url, bmdb):
    with captured_log(JsonFormatter()) as stream:
        async with fleet_stack(
            tmp_path, temporal_client, bmdb_url, machines=1, sim_faults=Faults(ssh_refuse=["node-0001"])
        ) as stack:
            await stack.run_pass()
            await stack.wait_for_error("node-0001")
            await sim_admin(stack, "/admin/faults", {"ssh_refuse": []})
            await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
    record = (await bmdb.machines_with_provider_id("node-0001"))[0]
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    machine = {
        "machine_id": str(record.machine_id),
        "provider": "sim",
        "provider_id": "node-0001",
        "workflow_id": "machine-sim-node-0001",
    }

    def logged(text: str) -> dict[str, str]:
        found = [line for line in lines if text in line["message"]]
        assert found, f"no line with {text!r} in {lines}"
        return found[0]

    # From an activity (fields from its input) and from the workflow (fields it passes).
    for text in ("agent started on sim machine node-0001", "AGENT_STARTING attempt 1 failed"):
        line = logged(text)
        assert {name: line.get(name) for name in machine} == machine, line
        assert line["level"] in ("INFO", "WARNING") and line["time"].endswith("+00:00")


def test_text_lines_put_the_fields_after_the_message():
    with captured_log(TextFormatter()) as stream:
        logging.getLogger("shepherd.test").info(
            "rebooted", extra={"machine_id": "m-1", "provider_id": "node-0001", "workflow_id": "machine-sim-node-0001"}
        )
        logging.getLogger("shepherd.test").info("nothing to say")
    first, second = stream.getvalue().splitlines()
    assert first.endswith(
        "shepherd.test: rebooted [machine_id=m-1 provider_id=node-0001 workflow_id=machine-sim-node-0001]"
    )
    assert second.endswith("shepherd.test: nothing to say")
