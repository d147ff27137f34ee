"""What a control plane reads to rebuild its memory whole (at start, after a failover or a job that failed midway)
beside a history of ended reservations: the time of the store's own rebuild statements against one read of every
reservation, in the same run, on SQLite and on PostgreSQL.

Reservations are never deleted, so a database grows by every reservation ever made. The rebuild reads the live
ones by their index and the released ones still booked from their bookings (controlplane/store/sqlite.py,
pg_sql.py); before, its plans read every reservation, and a start grew with the history. The rows are written
as the store keeps them (the ended ones with documents of --doc-bytes; their documents are never decoded by the
rebuild, so the live ones' decoding, the same with or without history, is left out).

    python bench/rebuild.py                  # 1,000,000 ended reservations, 1,000 live, 3 rounds
    python bench/rebuild.py --ended 100000

Prints, per engine, each statement's median time, their sum, one full read of the reservations table (the
baseline: what reading the history costs) and the ratio of the two. Nothing here is a target the bench fails on.
"""
from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.store import pg_schema, pg_sql, sqlite as sqlite_store  # noqa: E402
from tests.pgcluster import ClusterError, throwaway_cluster  # noqa: E402

NOW = 10**13  # every ended booking ended before it; the live ones run past it
STATEMENTS = ("LIVE_RESERVATIONS", "HELD_RESERVATIONS", "LIVE_BOOKINGS")
WHOLE = "SELECT count(*), sum(length(doc)) FROM reservations"  # reads every row and its document


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _timed(run, rounds: int) -> float:
    """Median milliseconds of `rounds` runs after one warm-up (the pages in the OS's cache, as on a host that has
    run the database: a cold start reads them from disk, slower still)."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def sqlite_figures(ended: int, live: int, doc: bytes, rounds: int, where: Path) -> dict[str, float]:
    conn = sqlite3.connect(where / "history.db")
    conn.executescript(sqlite_store.SCHEMA)
    reservations = "INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc) VALUES (?, 'acme', 'alice', 'h100', ?, ?)"
    bookings = ("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli, memory_mib,"
                " hugepages_1g) VALUES (?, 'h100', 'h1', 'g0', ?, ?, 0, 0, 0)")
    with conn:
        batch = 100_000
        for first in range(0, ended, batch):
            ids = range(first, min(first + batch, ended))
            conn.executemany(reservations, ((f"old-{i}", "released", doc) for i in ids))
            conn.executemany(bookings, ((f"old-{i}", i, i + 1) for i in ids))
            progress(f"sqlite: {min(first + batch, ended):,} of {ended:,} ended reservations written")
        conn.executemany(reservations, ((f"live-{i}", "active", doc) for i in range(live)))
        conn.executemany(bookings, ((f"live-{i}", NOW - 1, NOW + 1) for i in range(live)))
    figures = {}
    for name in STATEMENTS:
        sql = getattr(sqlite_store, name)
        args = (NOW,) if "?" in sql else ()
        figures[name] = _timed(lambda: conn.execute(sql, args).fetchall(), rounds)
    figures["whole"] = _timed(lambda: conn.execute(WHOLE).fetchall(), rounds)
    conn.close()
    return figures


def postgresql_figures(dsn: str, ended: int, live: int, doc: bytes, rounds: int) -> dict[str, float]:
    import asyncpg

    loop = asyncio.new_event_loop()  # one connection, driven statement by statement: timed as SQLite's are
    run = loop.run_until_complete
    conn = run(asyncpg.connect(dsn))
    try:
        run(pg_schema.migrate(conn))
        progress(f"postgresql: writing {ended:,} ended reservations")
        run(conn.execute("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc) SELECT 'old-' || i,"
                         " 'acme', 'alice', 'h100', 'released', $2 FROM generate_series(1, $1) i", ended, doc))
        run(conn.execute("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
                         " memory_mib, hugepages_1g) SELECT 'old-' || i, 'h100', 'h1', '{g0}', i, i + 1, 0, 0, 0"
                         " FROM generate_series(1, $1) i", ended))
        run(conn.execute("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc) SELECT 'live-' || i,"
                         " 'acme', 'alice', 'h100', 'active', $2 FROM generate_series(1, $1) i", live, doc))
        run(conn.execute("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
                         " memory_mib, hugepages_1g) SELECT 'live-' || i, 'h100', 'h1', '{g0}', $2, $3, 0, 0, 0"
                         " FROM generate_series(1, $1) i", live, NOW - 1, NOW + 1))
        run(conn.execute("VACUUM ANALYZE"))
        figures = {}
        for name in STATEMENTS:
            sql = getattr(pg_sql, name)
            args = (NOW,) if "$1" in sql else ()
            figures[name] = _timed(lambda: run(conn.fetch(sql, *args)), rounds)
        figures["whole"] = _timed(lambda: run(conn.fetch(WHOLE)), rounds)
        return figures
    finally:
        run(conn.close())
        loop.close()


def show(engine: str, figures: dict[str, float]) -> float:
    rebuild = sum(figures[name] for name in STATEMENTS)
    parts = ", ".join(f"{name.lower()} {figures[name]:,.1f}" for name in STATEMENTS)
    print(f"{engine:<11} rebuild reads {rebuild:9,.1f} ms ({parts}); every reservation read once "
          f"{figures['whole']:9,.1f} ms")
    return rebuild / figures["whole"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ended", type=int, default=1_000_000, help="released reservations whose bookings ended")
    parser.add_argument("--live", type=int, default=1_000, help="active reservations")
    parser.add_argument("--doc-bytes", type=int, default=1_500, help="size of each stored document")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    doc = b"x" * args.doc_bytes
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="berth-bench-rebuild-") as where:
        ratios["sqlite"] = show("sqlite", sqlite_figures(args.ended, args.live, doc, args.rounds, Path(where)))
    try:
        with throwaway_cluster() as cluster:
            figures = postgresql_figures(cluster.createdb("rebuild"), args.ended, args.live, doc, args.rounds)
        ratios["postgresql"] = show("postgresql", figures)
    except ClusterError as exc:
        print(f"postgresql  not measured: {exc}")
    print(f"rebuild reads / every reservation read once, with {args.ended:,} ended and {args.live:,} live: "
          + ", ".join(f"{engine} {ratio:.3f}x" for engine, ratio in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
