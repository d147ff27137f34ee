"""What a booking with its devices costs PostgreSQL to insert: the schema of this release against schema 2 (the
devices keyed by two texts under the exclusion constraint, each row checked against its booking by a foreign
key), in one run on one throwaway cluster.

    python bench/booked_devices.py [--bookings 15000] [--group 12]

Both databases get the same bookings (one device each, on 1,000 nodes of 8 GPUs, one-hour windows one after
another), written in groups as the store writes them: one statement per group, the bookings and their devices
together. Printed: microseconds per booking for each schema, measured over the last third of the bookings (the
tables already hold the first two thirds), and their ratio. fsync is off: this measures the database's work, not
the disk. Needs root (the cluster runs as `nobody`) and PostgreSQL's binaries (apt-get install postgresql).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import asyncpg  # noqa: E402

from controlplane.store import pg_schema, pg_sql  # noqa: E402
from tests.pgcluster import ClusterError, throwaway_cluster  # noqa: E402

HOUR = 3_600_000
# The statement schema 2's writer used for a group's bookings and their devices (no device key).
SCHEMA_2_GROUP = (
    "WITH ab AS (INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
    " memory_mib, hugepages_1g) SELECT rid, pool, node, ARRAY(SELECT jsonb_array_elements_text(units::jsonb)),"
    " st, en, vcpu, mem, hp FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::int8[],"
    " $7::int8[], $8::int8[], $9::int8[]) AS s (rid, pool, node, units, st, en, vcpu, mem, hp)"
    " RETURNING id, node_id, units, start_ms, end_ms)"
    " INSERT INTO booked_units (booking_id, node_id, unit, during)"
    " SELECT ab.id, ab.node_id, u, int8range(ab.start_ms, ab.end_ms) FROM ab, unnest(ab.units) AS u")


def progress(msg: str) -> None:
    end = "\r" if sys.stderr.isatty() else "\n"
    print(f"{msg:<60}", end=end, file=sys.stderr, flush=True)


def bookings(count: int) -> list[tuple]:
    """One device each: node by node, GPU by GPU, then the next hour."""
    rows = []
    for i in range(count):
        slot, k = divmod(i, 8000)
        start = slot * 2 * HOUR
        rows.append((f"r-{i:08d}", "fleet", f"n{k // 8:04d}", json.dumps([f"gpu{k % 8}"]), start, start + HOUR,
                     0, 0, 0))
    return rows


async def schema_2(conn: asyncpg.Connection) -> None:
    await conn.execute("CREATE TABLE schema_version (version INT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL"
                       " DEFAULT now(), what TEXT NOT NULL)")
    for version, what, sql in pg_schema.MIGRATIONS[:2]:
        await conn.execute(sql)
        await conn.execute("INSERT INTO schema_version (version, what) VALUES ($1, $2)", version, what)


async def run(dsn: str, label: str, rows: list[tuple], group: int, prepare, write) -> float:
    """prepare(conn) makes the schema; write(conn, columns) writes one group: microseconds per booking over the
    last third."""
    conn = await asyncpg.connect(dsn, server_settings=pg_sql.WRITER_SETTINGS)
    try:
        await prepare(conn)
        timed_from = len(rows) - len(rows) // 3
        spent = 0.0
        for k in range(0, len(rows), group):
            columns = [list(c) for c in zip(*rows[k:k + group])]
            began = time.perf_counter()
            await write(conn, columns)
            if k >= timed_from:
                spent += time.perf_counter() - began
            if k % (group * 200) == 0:
                progress(f"{label}: {k:,}/{len(rows):,} bookings")
        return spent / (len(rows) - timed_from) * 1e6
    finally:
        await conn.close()


async def measure(cluster, count: int, group: int) -> dict[str, float]:
    rows = bookings(count)

    async def schema_2_write(conn, columns):
        await conn.execute(SCHEMA_2_GROUP, *columns)

    async def latest_write(conn, columns):  # the store's own rows and statement (APPENDED), bookings only
        appends = pg_sql.PgAppends()
        for rid, pool, node, units, start, end, vcpu, mem, hp in zip(*columns):
            appends.add(pg_sql.BookingRow, pg_sql.BookingRow(rid, pool, node, json.loads(units), start, end, vcpu,
                                                             mem, hp))
        await appends.write(conn)

    latest = f"schema {pg_schema.LATEST}"
    return {
        "schema 2": await run(cluster.createdb("schema2"), "schema 2", rows, group, schema_2, schema_2_write),
        latest: await run(cluster.createdb("latest"), latest, rows, group, pg_schema.migrate, latest_write),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bookings", type=int, default=15_000)
    parser.add_argument("--group", type=int, default=12)
    args = parser.parse_args()
    try:
        with throwaway_cluster(fsync=False) as cluster:
            figures = asyncio.run(measure(cluster, args.bookings, args.group))
    except ClusterError as exc:
        print(f"cannot make a throwaway PostgreSQL cluster: {exc}", file=sys.stderr)
        return 2
    progress("")
    old = figures["schema 2"]
    for label, us in figures.items():
        print(f"{label:10} {us:7.1f} us per booking with its device   {us / old:5.2f}x schema 2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
