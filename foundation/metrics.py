"""Prometheus metrics of every long-running Shepherd process.

One mechanism for all of them: the Temporal SDK's runtime serves ``/metrics``
on ``metrics_listen``, with the SDK's own worker metrics (``temporal_*``) and
Shepherd's (``shepherd_*``) side by side, so a worker has one endpoint, not
two. The heartbeat server and the simulator use a runtime of their own for the
same exporter, without ever connecting to Temporal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from temporalio.common import MetricCounter, MetricGauge, MetricGaugeFloat, MetricMeter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from foundation.periodic import repeat_every
from foundation.setting_values import check_listen_address
from foundation.tls import bmdb_client_certificate_path, read_certificates, soonest_days_left

log = logging.getLogger("shepherd.metrics")

CERTIFICATE_EXPIRY = "shepherd_certificate_expiry_days"
# The certificate label of each: what the heartbeat server serves, the CAs agents are given, the client
# certificates of Temporal and BMDB.
HEARTBEAT_SERVER_CERTIFICATE = "heartbeat_server"
AGENT_ENDPOINT_CA = "agent_endpoint_ca"
TEMPORAL_CLIENT_CERTIFICATE = "temporal_client"
BMDB_CLIENT_CERTIFICATE = "bmdb_client"
# Often enough for a gauge in days, and reading a few small files a minute costs nothing.
CERTIFICATE_REFRESH = 60.0

# What a process holds of one certificate right now: read from its file, or kept in memory since it was read.
CertificateSource = Callable[[], Sequence[x509.Certificate]]


class MetricsUnavailable(OSError):
    """The metrics endpoint could not be served; names the address and why."""


def metrics_runtime(listen: str, process: str, *, setting: str = "metrics_listen") -> Runtime | None:
    """A runtime serving /metrics on listen (host:port), or None when listen is empty."""
    if not listen:
        return None
    host, port = check_listen_address(setting, listen)
    try:
        return Runtime(
            telemetry=TelemetryConfig(
                metrics=PrometheusConfig(bind_address=f"{host}:{port}", durations_as_seconds=True),
                global_tags={"shepherd_process": process},
            )
        )
    except Exception as error:  # the core reports a taken port as a plain RuntimeError
        raise MetricsUnavailable(f"cannot serve /metrics on {listen} (setting {setting}): {error}") from error


def meter_of(runtime: Runtime | None) -> MetricMeter:
    """The runtime's metric meter, or the no-op meter when there is no runtime."""
    return runtime.metric_meter if runtime is not None else MetricMeter.noop


@dataclass(frozen=True)
class WorkerMetrics:
    """What the worker's activities and its fleet observer record."""

    takeovers: MetricCounter
    reboots: MetricCounter
    reimages: MetricCounter
    machines: MetricGauge
    heartbeat_age_max: MetricGaugeFloat
    machines_silent: MetricGauge
    recoveries_held: MetricGauge
    machines_stuck: MetricGauge
    watchdog_looks: MetricCounter
    silent_signalled: MetricCounter

    @classmethod
    def on(cls, meter: MetricMeter) -> WorkerMetrics:
        """The worker's metrics, created on that meter."""
        return cls(
            takeovers=meter.create_counter(
                "shepherd_takeovers_total", "Agent takeovers over SSH, by outcome (ok or the failure kind)"
            ),
            reboots=meter.create_counter(
                "shepherd_recovery_reboots_total", "Recovery reboots through the provider, by cause and outcome"
            ),
            reimages=meter.create_counter(
                "shepherd_reimages_total", "Reimages through the provider (a fresh OS), by cause and outcome"
            ),
            machines=meter.create_gauge("shepherd_machines", "Running machine workflows, by stage"),
            heartbeat_age_max=meter.create_gauge_float(
                "shepherd_heartbeat_age_max_seconds", "Oldest last heartbeat among machines with an agent", "s"
            ),
            machines_silent=meter.create_gauge(
                "shepherd_machines_silent", "Machines the watchdog rule finds silent right now, by provider instance"
            ),
            recoveries_held=meter.create_gauge(
                "shepherd_recoveries_held",
                "Silent machines the watchdog holds from recovery, by provider instance; alert when above 0",
            ),
            machines_stuck=meter.create_gauge(
                "shepherd_machines_stuck",
                "Machines whose provisioning or agent start outlasted its deadline, by provider instance",
            ),
            watchdog_looks=meter.create_counter(
                "shepherd_watchdog_looks_total",
                "This worker's turns to look for silent machines, by provider instance and outcome (looked, "
                "another_looked: a look by another worker or a pass was recent, paused: the fleet schedule is, "
                "failed)",
            ),
            silent_signalled=meter.create_counter(
                "shepherd_silent_machines_signalled_total",
                "heartbeat_lost signals sent by the watchdog's looks, a worker's or a pass's, by provider instance",
            ),
        )


def certificate_file(path: Path) -> CertificateSource:
    """The certificates in the PEM file at path, read again each time: the gauge follows a rotated file."""
    return lambda: read_certificates(path)


class CertificateExpiry:
    """shepherd_certificate_expiry_days{certificate}: days until the soonest notAfter of each certificate a process
    holds, negative once expired. A certificate that expires stops what depends on it at once (an expired heartbeat
    server certificate stops every heartbeat), so it is watched in days, long before.

    A certificate may have several sources (the one in use and the file it came from, which may have been
    renewed meanwhile): the soonest of them counts, so renewing a file a process reads only at start clears the
    alert once the process was restarted and uses it.
    """

    def __init__(self, meter: MetricMeter) -> None:
        self._gauge = meter.create_gauge_float(
            CERTIFICATE_EXPIRY, "Days until the certificate expires (negative once expired), by certificate", "d"
        )
        self._watched: dict[str, tuple[CertificateSource, ...]] = {}
        # Certificate name -> the problem last logged about it, so a lasting problem is logged once.
        self._problems: dict[str, str] = {}

    def watch(self, name: str, *sources: CertificateSource) -> None:
        """Report the days until the soonest expiry among the certificates of sources, under that name."""
        self._watched[name] = sources

    def watch_bmdb_client(self, database_url: str) -> None:
        """BMDB's client certificate, where database_url names one (sslcert): libpq reads it for each connection,
        so the file is what is in use."""
        path = bmdb_client_certificate_path(database_url)
        if path is not None:
            self.watch(BMDB_CLIENT_CERTIFICATE, certificate_file(path))

    def refresh(self) -> None:
        """Set the gauge of every certificate watched from what its sources hold now."""
        for name, sources in self._watched.items():
            certificates: list[x509.Certificate] = []
            problems = []
            for source in sources:
                try:
                    certificates += source()
                except ValueError as problem:  # CertificateProblem names the file; a DER held is parsed too
                    problems.append(str(problem))
            self._note(name, "; ".join(problems))
            if certificates:
                self._gauge.set(soonest_days_left(certificates), {"certificate": name})

    def _note(self, name: str, problem: str) -> None:
        if problem and self._problems.get(name) != problem:
            log.warning("cannot read the %s certificate to watch its expiry: %s", name, problem)
        self._problems[name] = problem

    async def run(self, stop: asyncio.Event, interval: float = CERTIFICATE_REFRESH) -> None:
        """Refresh every interval until stop is set, so the days go down as time passes."""

        async def refresh() -> None:
            self.refresh()

        await repeat_every(stop, interval, refresh, "refreshing the certificate expiry gauges")
