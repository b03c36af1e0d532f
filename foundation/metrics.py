"""Prometheus metrics of every long-running Shepherd process.

One mechanism for all of them: the Temporal SDK's runtime serves ``/metrics``
on ``metrics_listen``, with the SDK's own worker metrics (``temporal_*``) and
Shepherd's (``shepherd_*``) side by side, so a worker has one endpoint, not
two. The heartbeat server and the simulator use a runtime of their own for the
same exporter, without ever connecting to Temporal.
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio.common import MetricCounter, MetricGauge, MetricGaugeFloat, MetricMeter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from foundation.settings import check_listen_address


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
    return runtime.metric_meter if runtime is not None else MetricMeter.noop


@dataclass(frozen=True)
class WorkerMetrics:
    """What the worker's activities and its fleet observer record."""

    takeovers: MetricCounter
    reboots: MetricCounter
    machines: MetricGauge
    heartbeat_age_max: MetricGaugeFloat
    machines_silent: MetricGauge
    recoveries_held: MetricGauge
    machines_stuck: MetricGauge

    @classmethod
    def on(cls, meter: MetricMeter) -> WorkerMetrics:
        return cls(
            takeovers=meter.create_counter(
                "shepherd_takeovers_total", "Agent takeovers over SSH, by outcome (ok or the failure kind)"
            ),
            reboots=meter.create_counter(
                "shepherd_recovery_reboots_total", "Recovery reboots through the provider, by cause and outcome"
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
        )
