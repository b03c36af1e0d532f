"""Benchmark: one reconcile decision over a 100,000-machine fleet.

Measures plan_reconcile on listings of the given size, and BMDB's listing of
that many provided machines on a local PostgreSQL. Run:

    python -m bench.reconcile [--machines 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

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
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        with cursor.copy("COPY machines (machine_id) FROM STDIN") as copy:
            for row in bmdb_rows:
                copy.write_row((row.machine_id,))
        with cursor.copy("COPY machine_provided (machine_id, provider, provider_id, status) FROM STDIN") as copy:
            for row in bmdb_rows:
                copy.write_row((row.machine_id, row.provider, row.provider_id, row.status))
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--machines", type=int, default=100_000)
    args = parser.parse_args()
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
