"""Benchmark: one reconcile decision over a 100,000-machine fleet, and whole fleet passes.

By default, measures plan_reconcile on listings of the given size, and BMDB's
listing of that many provided machines on a local PostgreSQL.

With --pass, runs fleet passes as production does, at growing fleet sizes, on
one PostgreSQL and one Temporal dev server: a static provider whose inventory
lists every machine, BMDB holding all of them (provided, agent started,
heartbeating), and a running MachineWorkflow for each, up to --running (the
most this machine holds; their task queue has no worker, so they only wait).
Where every machine has its workflow, a whole FleetWorkflow pass runs through
a worker (plan, ensure the workflows, watchdog). Beyond --running, the pass's
steps that do not depend on Temporal are timed at full size, and counting
and listing the running workflows are extrapolated from their measured
growth. Run:

    python -m bench.reconcile [--machines 100000]
    python -m bench.reconcile --pass [--sizes 1000,3000,10000,100000] [--running 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from bench.bmdb_rows import BenchMachine, insert_machines
from bench.fleet_pass import run_fleet_passes
from bmdb import migrate
from bmdb.local_postgres import LocalPostgres
from bmdb.store import BMDB, ProvidedMachine
from lifecycle.reconcile import plan_reconcile
from providers import Availability, ProviderMachine
from providers.sim import SimProvider


def listings(count: int) -> tuple[list[ProviderMachine], list[ProvidedMachine]]:
    ids = [f"node-{n:06d}" for n in range(1, count + 1)]
    managed = ids[: count - count // 10]
    provider = [ProviderMachine(i, Availability.KNOWN_USED, "10.0.0.1") for i in managed]
    provider += [ProviderMachine(i, Availability.KNOWN_UNUSED) for i in ids[len(managed) :]]
    bmdb = [ProvidedMachine(uuid.uuid4(), "sim", i, "provided") for i in managed]
    return provider, bmdb


def best_of(runs: int, action) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


async def bmdb_listing(url: str, bmdb_rows: list[ProvidedMachine]) -> float:
    insert_machines(url, [BenchMachine(row.machine_id, row.provider, row.provider_id) for row in bmdb_rows])
    db = BMDB(url)
    try:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            listed = await db.list_provided("sim")
            times.append(time.perf_counter() - start)
        assert len(listed) == len(bmdb_rows)
        return min(times)
    finally:
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reconcile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=100_000)
    parser.add_argument("--pass", dest="whole_pass", action="store_true", help="run whole fleet passes instead")
    parser.add_argument("--sizes", default="1000,3000,10000,100000", help="fleet sizes for --pass, growing")
    parser.add_argument("--running", type=int, default=10_000, help="running machine workflows at most (--pass)")
    args = parser.parse_args()
    if args.whole_pass:
        try:
            sizes = sorted({int(size) for size in args.sizes.split(",")})
        except ValueError:
            parser.error(f"--sizes must be whole numbers separated by commas, got {args.sizes!r}")
        if sizes[0] < 1 or args.running < 1:
            parser.error("--sizes and --running must be positive")
        run_fleet_passes(sizes, args.running)
        return
    provider, bmdb_rows = listings(args.machines)
    valid = SimProvider("http://unused").is_valid_id
    seconds = best_of(5, lambda: plan_reconcile(provider, bmdb_rows, max_machines=0, chunk_size=20, is_valid_id=valid))
    print(f"plan_reconcile, {args.machines} machines: {seconds * 1000:.0f} ms")
    with tempfile.TemporaryDirectory() as tmp, LocalPostgres(Path(tmp) / "pg") as url:
        migrate.upgrade(url)
        seconds = asyncio.run(bmdb_listing(url, bmdb_rows))
    print(f"BMDB list_provided, {len(bmdb_rows)} rows: {seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
