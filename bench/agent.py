"""Benchmark: the agent executable on this machine, the one-file executable beside the zipapp it replaced.

Both are built by agent.build from the same sources: the self-contained one-file executable (PyInstaller, its
own interpreter inside), and the baseline, the zipapp run by this venv's Python: what the agent cost before, an
interpreter with protobuf and PyNaCl on the machine. Measured in the same run, on the same terms:

size          the file, and what it unpacks into $TMPDIR at every start (the one-file build's manifest; the
              zipapp unpacks nothing).
start         wall time from exec to exit of answering one takeover with heartbeats off, a fresh state directory
              and $TMPDIR each run: median, min and max of --runs.
peak RSS      of answering one takeover, summed over the agent's processes (the one-file executable runs as
              PyInstaller's bootloader and its interpreter, the zipapp as one process): each one's peak (VmHWM)
              sampled from /proc every few milliseconds until the agent exits, the largest one's taken from
              wait4 (ru_maxrss) if higher, in a small launcher (LAUNCHER says why). Median of --runs.
heartbeating  the daemon the takeover starts, heartbeating over TLS to a minimal server in this process that
              accepts every heartbeat and asks for the next after --interval seconds. After --settle seconds,
              the resident memory (VmRSS) of all its processes, summed; then their CPU (utime + stime, as
              /proc/PID/stat counts it, to the nanosecond) over --window seconds, per heartbeat and per second;
              then over --idle-window seconds in which the server asked for no heartbeat: the CPU between them.

The agents are found by a marker variable in their environment, and stopped at the end (SIGTERM, then SIGKILL).
Run:

    python -m bench.agent [--runs 10] [--interval 1] [--settle 10] [--window 30] [--idle-window 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from agent.build import build_agent_executable
from agent.reference import HEARTBEATS_VARIABLE, STATE_DIR_VARIABLE
from bench.heartbeats import status_mib
from foundation.executables import executable_target
from foundation.procfs import processes_with_variable
from foundation.tls import CertificateAuthority, subject_alternative_name
from proto import agent_api_pb2, agent_api_pb2_grpc, takeover_pb2

MARK_VARIABLE = "BENCH_AGENT_MARK"
# How often the processes of an answering agent are sampled for their peak memory.
SAMPLE_EVERY = 0.002
# The longest the daemon may take to send its first heartbeat, and the agents to go after SIGTERM.
FIRST_HEARTBEAT_WITHIN = 30.0
STOP_GRACE = 5.0
MIB = 1024 * 1024
# Runs the agent and writes the peak RSS of its largest process (wait4's ru_maxrss, KiB) on standard error. Read in
# this process it would be wrong: until exec a child shares the memory of the process that started it (vfork), and
# its ru_maxrss counts that one's peak, here this benchmark's own (over 100 MiB); from a bare interpreter, 8 MiB.
LAUNCHER = (
    "import os, sys\n"
    "pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "print(usage.ru_maxrss, file=sys.stderr)\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)
GOAL_START_SECONDS = 1.0
GOAL_HEARTBEATING_MIB = 50.0
GOAL_IDLE_MS_PER_SECOND = 0.5


@dataclass
class Figures:
    """What was measured of one agent executable; CPU in seconds."""

    size: int
    unpacked_kib: int | None
    starts: list[float]
    peaks_mib: list[float]
    heartbeating_mib: float = 0.0
    processes: int = 0
    busy_cpu: float = 0.0
    busy_window: float = 0.0
    heartbeats: int = 0
    idle_cpu: float = 0.0
    idle_window: float = 0.0


class AcceptingServer(agent_api_pb2_grpc.AgentCallbackServicer):
    """Accepts every heartbeat and asks for the next after interval (or what ask set for the machine); counts the
    heartbeats by machine id."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.asked: dict[str, float] = {}
        self.received: Counter[str] = Counter()

    def ask(self, machine_id: str, interval: float) -> None:
        self.asked[machine_id] = interval

    def _accept(self, request: agent_api_pb2.HeartbeatRequest) -> agent_api_pb2.HeartbeatResponse:
        self.received[request.machine_id] += 1
        next_in_ms = round(self.asked.get(request.machine_id, self.interval) * 1000)
        outcome = agent_api_pb2.HeartbeatResponse.Outcome.ACCEPTED
        return agent_api_pb2.HeartbeatResponse(outcome=outcome, next_heartbeat_in_ms=next_in_ms)

    async def Heartbeat(self, request: agent_api_pb2.HeartbeatRequest, context: Any) -> Any:
        return self._accept(request)

    async def Heartbeats(
        self, requests: AsyncIterator[agent_api_pb2.HeartbeatRequest], context: Any
    ) -> AsyncIterator[agent_api_pb2.HeartbeatResponse]:
        async for request in requests:
            yield self._accept(request)

    async def next_heartbeat(self, machine_id: str, within: float) -> None:
        """Wait for the machine's next heartbeat; SystemExit if none comes within that many seconds."""
        seen, deadline = self.received[machine_id], time.monotonic() + within
        while self.received[machine_id] == seen:
            if time.monotonic() > deadline:
                raise SystemExit(f"no heartbeat from the agent within {within:.0f} s")
            await asyncio.sleep(0.05)


def throwaway_tls() -> tuple[grpc.ServerCredentials, bytes]:
    """Server credentials for 127.0.0.1 from a CA made for this run, and that CA's certificate in DER."""
    now = datetime.now(UTC)
    valid_from, valid_until = now - timedelta(minutes=5), now + timedelta(days=1)
    authority = CertificateAuthority("bench.agent CA", valid_from, valid_until)
    certificate, key = authority.issue("127.0.0.1", valid_from, valid_until, subject_alternative_name("127.0.0.1"))
    ca_der = x509.load_pem_x509_certificate(authority.certificate_pem).public_bytes(Encoding.DER)
    return grpc.ssl_server_credentials([(key, certificate)]), ca_der


def takeover_init(machine_id: str, endpoint: str, ca_der: bytes) -> bytes:
    return takeover_pb2.TakeoverInit(
        machine_id=machine_id, endpoint=endpoint, ca_certificates=[ca_der]
    ).SerializeToString()


def launch(
    executable: Path, init: bytes, scratch: Path, mark: str, *, heartbeats: bool, launcher: bool = False
) -> subprocess.Popen[bytes]:
    """Start the agent with a fresh state directory and $TMPDIR under scratch, init written to its standard input;
    through the LAUNCHER when launcher is set."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    (run_dir / "state").mkdir()
    (run_dir / "tmp").mkdir()
    env = {
        **os.environ,
        STATE_DIR_VARIABLE: str(run_dir / "state"),
        "TMPDIR": str(run_dir / "tmp"),
        MARK_VARIABLE: mark,
    }
    env.pop(HEARTBEATS_VARIABLE, None)
    if not heartbeats:
        env[HEARTBEATS_VARIABLE] = "off"
    command = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(executable)] if launcher else [str(executable)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdin is not None
    process.stdin.write(init)
    process.stdin.close()
    return process


def answered(process: subprocess.Popen[bytes]) -> bytes:
    """What the exited agent wrote on standard error; SystemExit unless it exited 0 with a successful answer."""
    assert process.stdout is not None and process.stderr is not None
    with process.stdout, process.stderr:
        answer, errors = process.stdout.read(), process.stderr.read()
    response = takeover_pb2.TakeoverResponse.FromString(answer)
    if process.returncode != 0 or response.WhichOneof("result") != "success":
        raise SystemExit(f"the agent failed (status {process.returncode}): {response} {errors.decode()[-2000:]}")
    return errors


def marked(mark: str) -> list[int]:
    return processes_with_variable(f"{MARK_VARIABLE}={mark}".encode())


def start_seconds(executable: Path, init: bytes, scratch: Path) -> float:
    """Wall time from exec to exit of answering one takeover, heartbeats off."""
    started = time.perf_counter()
    process = launch(executable, init, scratch, uuid.uuid4().hex, heartbeats=False)
    process.wait()
    elapsed = time.perf_counter() - started
    answered(process)
    return elapsed


def peak_mib(executable: Path, init: bytes, scratch: Path) -> float:
    """Peak resident memory of answering one takeover, summed over the agent's processes (see the module's doc)."""
    mark = uuid.uuid4().hex
    process = launch(executable, init, scratch, mark, heartbeats=False, launcher=True)
    peaks: dict[int, float] = {}
    while process.poll() is None:
        for pid in marked(mark):
            # The last reading, not the largest: before exec a process may still show its parent's memory (the
            # launcher's, which vfork shares), and exec starts the peak anew.
            with contextlib.suppress(OSError):
                peaks[pid] = status_mib(pid, "VmHWM") or peaks.get(pid, 0.0)
        time.sleep(SAMPLE_EVERY)
    largest_kib = int(answered(process).split()[-1])
    peaks.pop(process.pid, None)  # the launcher
    sampled = sorted(peaks.values()) or [0.0]
    # The largest process's peak as wait4 tells it: sampling may have missed its last milliseconds.
    return sum(sampled[:-1]) + max(sampled[-1], largest_kib / 1024)


def stop_agents(marks: list[str]) -> None:
    """SIGTERM every process carrying one of the marks, SIGKILL those still there after STOP_GRACE."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + STOP_GRACE
        for pid in [pid for mark in marks for pid in marked(mark)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        while time.monotonic() < deadline and any(marked(mark) for mark in marks):
            time.sleep(0.05)


def cpu_seconds(pid: int) -> float:
    """The CPU time of a process, all its threads, exited ones too: utime + stime of /proc/PID/stat, to the
    nanosecond rather than the clock tick (10 ms), from the process's CPU-time clock (clock_getcpuclockid(3))."""
    return time.clock_gettime(((~pid) << 3) | 2)  # the kernel's clock id for CPUCLOCK_SCHED of process pid


async def cpu_over(pids: list[int], seconds: float) -> tuple[float, float]:
    """CPU seconds the processes used over the next that many seconds, and the seconds that really passed."""
    cpu, started = sum(map(cpu_seconds, pids)), time.monotonic()
    await asyncio.sleep(seconds)
    return sum(map(cpu_seconds, pids)) - cpu, time.monotonic() - started


async def heartbeating(
    executable: Path,
    figures: Figures,
    server: AcceptingServer,
    endpoint: str,
    ca_der: bytes,
    scratch: Path,
    marks: list[str],
    args: argparse.Namespace,
) -> None:
    """Take over with heartbeats on; read the daemon's memory after args.settle, its CPU over args.window of
    heartbeats, then over args.idle_window without one."""
    machine_id, mark = str(uuid.uuid4()), uuid.uuid4().hex
    marks.append(mark)
    process = launch(executable, takeover_init(machine_id, endpoint, ca_der), scratch, mark, heartbeats=True)
    await asyncio.to_thread(process.wait)
    answered(process)
    await server.next_heartbeat(machine_id, FIRST_HEARTBEAT_WITHIN)
    await asyncio.sleep(args.settle)
    pids = marked(mark)
    figures.processes = len(pids)
    figures.heartbeating_mib = sum(status_mib(pid, "VmRSS") for pid in pids)
    seen = server.received[machine_id]
    figures.busy_cpu, figures.busy_window = await cpu_over(pids, args.window)
    figures.heartbeats = server.received[machine_id] - seen
    # Between heartbeats: the next heartbeat's answer asks for the one after only once the idle window is over.
    server.ask(machine_id, args.idle_window + 60)
    await server.next_heartbeat(machine_id, args.interval + 10)
    await asyncio.sleep(0.5)  # the answer read, the agent asleep
    seen = server.received[machine_id]
    figures.idle_cpu, figures.idle_window = await cpu_over(pids, args.idle_window)
    if server.received[machine_id] != seen or set(marked(mark)) != set(pids):
        raise SystemExit(f"{executable.name}: a heartbeat came, or the daemon's processes changed, while idle")


async def measure_heartbeating(
    agents: dict[Path, Figures], tls: tuple[grpc.ServerCredentials, bytes], scratch: Path, args: argparse.Namespace
) -> None:
    server = grpc.aio.server()
    accepting = AcceptingServer(args.interval)
    agent_api_pb2_grpc.add_AgentCallbackServicer_to_server(accepting, server)
    credentials, ca_der = tls
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    marks: list[str] = []
    try:
        for executable, figures in agents.items():
            await heartbeating(executable, figures, accepting, f"127.0.0.1:{port}", ca_der, scratch, marks, args)
            stop_agents(marks)
    finally:
        stop_agents(marks)
        await server.stop(grace=None)


def measure(executable: Path, ca_der: bytes, scratch: Path, runs: int) -> Figures:
    """Size, start times and peak memory of answering a takeover, heartbeats off."""
    data = executable.read_bytes()
    init = takeover_init(str(uuid.uuid4()), "127.0.0.1:9", ca_der)
    starts = [start_seconds(executable, init, scratch) for _ in range(runs)]
    peaks = [peak_mib(executable, init, scratch) for _ in range(runs)]
    for leftover in scratch.iterdir():
        shutil.rmtree(leftover)
    return Figures(len(data), executable_target(data).unpacked_kib, starts, peaks)


def report(onefile: Figures, baseline: Figures, args: argparse.Namespace) -> None:
    def spread(values: list[float], unit: str, digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    def processes(figures: Figures) -> str:
        return f"{figures.heartbeating_mib:.1f} MiB ({figures.processes} process{'es' * (figures.processes > 1)})"

    def idle_ms(figures: Figures) -> float:
        """CPU milliseconds a second between heartbeats."""
        return figures.idle_cpu * 1000 / figures.idle_window

    def per_heartbeat_ms(figures: Figures) -> float:
        """CPU milliseconds a heartbeat, beyond what the agent spends between heartbeats."""
        beyond_idle = figures.busy_cpu * 1000 - idle_ms(figures) * figures.busy_window
        return beyond_idle / max(figures.heartbeats, 1)

    def busy_ms(figures: Figures) -> float:
        return figures.busy_cpu * 1000 / figures.busy_window

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    every = f"a heartbeat every {args.interval:g} s"
    # What, the one-file figure, the zipapp's, the values whose ratio is shown (none for 0), the goal.
    rows: list[tuple[str, str, str, float, float, str]] = [
        (
            "file size",
            f"{onefile.size / MIB:.1f} MiB",
            f"{baseline.size / 1024:.1f} KiB",
            onefile.size,
            baseline.size,
            "",
        ),
        ("unpacked into $TMPDIR at every start", f"{(onefile.unpacked_kib or 0) / 1024:.1f} MiB", "nothing", 0, 0, ""),
        (
            "start: median (min-max)",
            spread(onefile.starts, "s", 3),
            spread(baseline.starts, "s", 3),
            statistics.median(onefile.starts),
            statistics.median(baseline.starts),
            f"< {GOAL_START_SECONDS:g} s: {met(max(onefile.starts) < GOAL_START_SECONDS)}",
        ),
        (
            "peak RSS answering: median (min-max)",
            spread(onefile.peaks_mib, "MiB", 1),
            spread(baseline.peaks_mib, "MiB", 1),
            statistics.median(onefile.peaks_mib),
            statistics.median(baseline.peaks_mib),
            "",
        ),
        (
            f"RSS heartbeating, after {args.settle:g} s",
            processes(onefile),
            processes(baseline),
            onefile.heartbeating_mib,
            baseline.heartbeating_mib,
            f"< {GOAL_HEARTBEATING_MIB:g} MiB: {met(onefile.heartbeating_mib < GOAL_HEARTBEATING_MIB)}",
        ),
        (
            f"CPU a second, {every}",
            f"{busy_ms(onefile):.2f} ms ({onefile.heartbeats} heartbeats)",
            f"{busy_ms(baseline):.2f} ms ({baseline.heartbeats} heartbeats)",
            busy_ms(onefile),
            busy_ms(baseline),
            "",
        ),
        (
            "CPU a heartbeat, beyond the idle CPU",
            f"{per_heartbeat_ms(onefile):.2f} ms",
            f"{per_heartbeat_ms(baseline):.2f} ms",
            per_heartbeat_ms(onefile),
            per_heartbeat_ms(baseline),
            "",
        ),
        (
            "CPU a second between heartbeats",
            f"{idle_ms(onefile):.2f} ms",
            f"{idle_ms(baseline):.2f} ms",
            idle_ms(onefile),
            idle_ms(baseline),
            f"~0 (< {GOAL_IDLE_MS_PER_SECOND:g} ms): {met(idle_ms(onefile) < GOAL_IDLE_MS_PER_SECOND)}",
        ),
    ]
    print(
        f"the agent on this machine ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end,"
        f" {args.runs} runs); ratio: one-file / zipapp"
    )
    print(f"  {'':<38} {'one-file':<28} {'zipapp (baseline)':<28} {'ratio':>7}   goal (one-file)")
    for what, mine, theirs, mine_value, their_value, goal in rows:
        ratio = f"{mine_value / their_value:,.2f}" if their_value else "-"
        print(f"  {what:<38} {mine:<28} {theirs:<28} {ratio:>7}   {goal}")
    print(
        f"  (CPU over {args.window:g} s of {every} and {args.idle_window:g} s without one; peak RSS sampled every"
        f" {SAMPLE_EVERY * 1000:g} ms, the largest process's from wait4)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10, help="takeovers answered for the start and peak figures")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between heartbeats, as the server asks")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of heartbeating before memory is read")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of heartbeats over which CPU is counted")
    parser.add_argument("--idle-window", type=float, default=30.0, help="seconds without one over which CPU is counted")
    args = parser.parse_args()
    if args.runs < 1 or min(args.interval, args.window, args.idle_window) <= 0 or args.settle < 0:
        parser.error("--runs must be at least 1, --settle at least 0, the other durations above 0")
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp_name:
        tmp = Path(tmp_name)
        scratch = tmp / "runs"
        scratch.mkdir()
        onefile = build_agent_executable(tmp / "agent")
        zipapp = build_agent_executable(tmp / "agent.pyz", zipapp_python=sys.executable)
        tls = throwaway_tls()
        agents = {path: measure(path, tls[1], scratch, args.runs) for path in (onefile, zipapp)}
        asyncio.run(measure_heartbeating(agents, tls, scratch, args))
    report(agents[onefile], agents[zipapp], args)


if __name__ == "__main__":
    main()
