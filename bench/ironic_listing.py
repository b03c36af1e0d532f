"""Benchmark: a fleet pass's listing of an Ironic with many nodes, Shepherd's against openstacksdk's own.

Starts OpenStack Ironic standalone (SQLite, one process, as the tests run it) with --nodes fake-hardware nodes
made available, then times, taking turns, --rounds listings of each:

raw       openstacksdk's own listing, ``conn.baremetal.nodes(details=True)``: every node with every field, as
          openstacksdk's Node objects, as a script of an operator's would list them.
shepherd  ``IronicProvider.list_machines()``: what a fleet pass calls, one paged listing of the fields Shepherd
          reads, every node checked field by field, sorted into Shepherd's machines, capacity and the census of
          nodes left alone.

Both go through the same openstacksdk session to the same Ironic; Ironic's own time (API, SQLite) is in both.
Run:

    python -m bench.ironic_listing [--nodes 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.ironic_nodes import enroll_available, provider_options
from foundation.provider_instances import ProviderInstance
from foundation.settings import Settings
from providers.ironic import IronicProvider, from_settings
from tests.ironic_fixtures import Ironic, running_ironic


def cpu() -> float:
    """This process's CPU seconds so far."""
    return time.process_time()


async def measure(ironic: Ironic, rounds: int) -> dict[str, list[tuple[float, float, int]]]:
    """(wall seconds, CPU seconds, nodes seen) of each listing, by variant, the variants taking turns."""
    options = provider_options(ironic)
    provider = from_settings(ProviderInstance("bench", "ironic", options), Settings())
    assert isinstance(provider, IronicProvider)
    connection = provider.api.connection
    results: dict[str, list[tuple[float, float, int]]] = {"raw": [], "shepherd": []}

    def raw() -> int:
        return sum(1 for _ in connection.baremetal.nodes(details=True))

    # A first listing of each, untimed: the session's version discovery and Ironic's caches.
    await provider.list_machines()
    raw()
    for _ in range(rounds):
        started, used = time.perf_counter(), cpu()
        seen = await asyncio.to_thread(raw)
        results["raw"].append((time.perf_counter() - started, cpu() - used, seen))
        started, used = time.perf_counter(), cpu()
        machines = await provider.list_machines()
        seen = len(machines) + provider.left_alone.total()
        results["shepherd"].append((time.perf_counter() - started, cpu() - used, seen))
    await provider.close()
    return results


def report(results: dict[str, list[tuple[float, float, int]]], nodes: int) -> None:
    """Each variant's median time and CPU, and Shepherd's ratio to raw openstacksdk's, round by round."""
    print(f"listing {nodes:,} Ironic nodes, {len(results['raw'])} rounds taking turns (median, min-max):")
    for name, runs in results.items():
        walls, cpus = [w for w, _, _ in runs], [c for _, c, _ in runs]
        print(
            f"  {name:9} {statistics.median(walls) * 1000:8.0f} ms ({min(walls) * 1000:.0f}-{max(walls) * 1000:.0f}),"
            f" CPU of this process {statistics.median(cpus) * 1000:6.0f} ms, {runs[0][2]:,} nodes seen"
        )
    ratios = [s[0] / r[0] for s, r in zip(results["shepherd"], results["raw"], strict=True)]
    print(f"  shepherd / raw openstacksdk, round by round: {', '.join(f'{r:.2f}' for r in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ironic_listing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.nodes < 1 or args.rounds < 1:
        parser.error("--nodes and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-ironic-") as state, running_ironic(Path(state)) as ironic:
        started = time.perf_counter()
        enroll_available(ironic, args.nodes)
        print(f"{args.nodes:,} fake-hardware nodes available in {time.perf_counter() - started:.0f}s (untimed)")
        report(asyncio.run(measure(ironic, args.rounds)), args.nodes)


if __name__ == "__main__":
    main()
