"""``shepherd sim`` / ``python -m simulator``: run the simulator until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from foundation.logs import configure_logging
from foundation.metrics import meter_of, metrics_runtime
from foundation.setting_values import SettingsError, check_listen_address
from foundation.settings import LOG_FORMATS
from simulator.server import Simulator
from simulator.state import Faults, SimulatorConfig


def build_parser() -> argparse.ArgumentParser:
    """The ``shepherd sim`` argument parser: slots, state dir, listen addresses, boot time and faults."""
    parser = argparse.ArgumentParser(prog="shepherd sim", description="Run the fleet simulator.")
    parser.add_argument("--machines", type=int, default=20, help="capacity slots (default 20)")
    parser.add_argument("--state-dir", type=Path, default=Path(".shepherd/sim"), help="where the fleet is kept")
    # Defaults are SimulatorConfig's and Faults', so the command and the class cannot disagree.
    parser.add_argument("--api-host", default=SimulatorConfig.api_host)
    parser.add_argument("--api-port", type=int, default=SimulatorConfig.api_port)
    parser.add_argument(
        "--ssh-host", default=SimulatorConfig.ssh_host, help="address the machines' SSH servers listen on"
    )
    parser.add_argument(
        "--boot-seconds", type=float, default=SimulatorConfig.boot_seconds, help="SSH downtime of a reboot"
    )
    parser.add_argument("--api-latency", type=float, default=Faults.api_latency, help="seconds added to every API call")
    parser.add_argument(
        "--api-error-rate", type=float, default=Faults.api_error_rate, help="fraction of API calls answered 503"
    )
    parser.add_argument(
        "--api-malformed-rate", type=float, default=Faults.api_malformed_rate, help="fraction answered with garbage"
    )
    parser.add_argument(
        "--ssh-refuse",
        action="append",
        default=[],
        metavar="ID",
        help="machine whose SSH refuses connections ('*' for all); repeatable",
    )
    parser.add_argument(
        "--exec-delay", type=float, default=Faults.exec_delay, help="seconds before an exec'd process starts"
    )
    parser.add_argument("--metrics-listen", default="", help="host:port to serve Prometheus /metrics on")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="log lines as text or json")
    return parser


def config_from(args: argparse.Namespace) -> SimulatorConfig:
    """The simulator's configuration from the parsed arguments; ValueError for a bad value."""
    faults = Faults(
        api_latency=args.api_latency,
        api_error_rate=args.api_error_rate,
        api_malformed_rate=args.api_malformed_rate,
        ssh_refuse=args.ssh_refuse,
        exec_delay=args.exec_delay,
    )
    return SimulatorConfig(
        machines=args.machines,
        state_dir=args.state_dir,
        api_host=args.api_host,
        api_port=args.api_port,
        ssh_host=args.ssh_host,
        boot_seconds=args.boot_seconds,
        faults=faults,
    ).check()


async def serve(config: SimulatorConfig, metrics_listen: str = "") -> None:
    """Run the simulator, and its /metrics where metrics_listen names an address, until SIGTERM or SIGINT."""
    runtime = metrics_runtime(metrics_listen, "simulator", setting="--metrics-listen")
    simulator = Simulator(config, meter_of(runtime))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await simulator.start()
    try:
        await stop.wait()
    finally:
        await simulator.stop()


def main(argv: list[str] | None = None) -> int:
    """``shepherd sim``: run the fleet simulator until stopped; 1 when it cannot start."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        if args.metrics_listen:
            check_listen_address("metrics_listen", args.metrics_listen)
    except SettingsError:
        parser.error(f"--metrics-listen must be host:port, got {args.metrics_listen!r}")
    configure_logging(args.log_format)
    try:
        asyncio.run(serve(config, args.metrics_listen))
    except OSError as error:
        print(f"shepherd sim: cannot start: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
