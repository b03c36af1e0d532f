"""The CPU time of what an Ironic benchmark runs on the same cores: its own process (the worker, a script, the
simulated machines' SSH servers), the agents it started, Ironic, the Temporal dev server and PostgreSQL."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, fields
from pathlib import Path

from bench.heartbeats import postgres_cpu_seconds, process_cpu_seconds
from foundation.procfs import children_of


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds of each process of the stack, so far or over a span."""

    here: float
    agents: float
    ironic: float
    temporal: float
    postgres: float

    def __sub__(self, before: CpuTimes) -> CpuTimes:
        return CpuTimes(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))


@dataclass(frozen=True)
class StackCpu:
    """Reads the CPU times of the stack's processes from /proc."""

    ironic_pid: int
    temporal_pid: int
    postgres_dir: Path

    @classmethod
    def of(cls, ironic_pid: int, postgres_dir: Path) -> StackCpu:
        """The meter of this process's stack: the Temporal dev server is its child."""
        (temporal,) = children_of(os.getpid(), mentioning="start-dev")
        return cls(ironic_pid, temporal, postgres_dir)

    def read(self) -> CpuTimes:
        """The CPU seconds of each so far; the agents' once they exited and were waited for."""
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return CpuTimes(
            here=own.ru_utime + own.ru_stime,
            agents=children.ru_utime + children.ru_stime,
            ironic=tree_cpu_seconds(self.ironic_pid),
            temporal=process_cpu_seconds(self.temporal_pid),
            postgres=postgres_cpu_seconds(self.postgres_dir) or 0.0,
        )


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of the process and of its children's trees: Ironic serves from a worker process it forks."""
    return process_cpu_seconds(pid) + sum(tree_cpu_seconds(child) for child in children_of(pid))
