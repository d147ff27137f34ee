"""Moving a control plane's SQLite database to PostgreSQL (`berth controlplane migrate`), as plain functions.

This module owns the copy only: which rows go where, in one PostgreSQL
transaction, and what is refused. The engines own everything else, and the
copy uses their definitions: the SQLite file is first brought to the SQLite
engine's current schema by its own `sqlite.migrate` (a file of a newer Berth is
refused with the engine's message), the target by `pg_schema.migrate` (inside
the copy's transaction, so a failed copy leaves no schema either); booked
devices are written with the PostgreSQL engine's own `INSERT_BOOKING`, so a
booking gets its `units` array and one `booked_units` row per device under the
exclusion constraint exactly as a replica would write it.

- **All or nothing.** Every row is written in one transaction that first takes
  the engine's write lock (a running replica waits, and cannot interleave);
  any failure rolls it back and leaves the target as it was.
- **Nothing overwritten by accident.** A target that holds reservations,
  events or catalog rows is refused unless `replace` is given; then it is
  emptied in that same transaction.
- **Cursors and ids survive.** Reservations and events keep their `seq` (list
  and events cursors a client holds stay valid); each BIGSERIAL sequence is
  set past the largest seq the SQLite file ever gave, so a new row never
  reuses one.
- **Running replicas notice.** `replica_state.generation` (and its rebuild
  generation) is raised and `NOTIFY berth_changes` sent, so a replica
  already on the target rebuilds its whole memory from the copied rows.
- **The source is not written meanwhile.** The SQLite side is read inside
  `BEGIN IMMEDIATE`: a control plane still running on it cannot commit while
  the copy reads (it waits, and its writes after the copy are not moved: stop
  it first). Nothing is written to the file beyond the engine's own schema
  migration.
"""
from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Callable, TextIO

import asyncpg

from common.logs import redact_url
from controlplane.replicas import CHANNEL
from controlplane.store import pg_connect, pg_schema, pg_sql, sqlite
from controlplane.store.port import StoreError

BATCH = 2000  # rows per executemany: large enough to pipeline, small enough for steady progress


class Refused(Exception):
    """The move cannot start as asked (a source or target that cannot be used); nothing was changed."""


class Failed(Exception):
    """The copy could not be completed (the rows themselves, or the database); the target was not changed."""


def _units(text: str) -> list[str]:
    """A booking's units as the SQLite engine stores them (comma-joined text) to the array PostgreSQL keeps."""
    return text.split(",") if text else []


def _booking(row: tuple) -> tuple:
    return (row[0], row[1], row[2], _units(row[3]), *row[4:])


def _billing(row: tuple) -> tuple:
    return (*row[:3], Decimal(row[3]), *row[4:])  # SQLite keeps the hourly price as its decimal text


@dataclass(frozen=True)
class Table:
    """One table to copy: its columns (the same names on both sides), and where the rows need more than a plain
    INSERT of those columns, the PostgreSQL statement and the conversion of each SQLite row to its arguments."""

    name: str
    columns: tuple[str, ...]
    insert: str | None = None
    convert: Callable[[tuple], tuple] | None = None

    @property
    def select(self) -> str:
        return f"SELECT {', '.join(self.columns)} FROM {self.name} ORDER BY rowid"

    @property
    def statement(self) -> str:
        if self.insert is not None:
            return self.insert
        marks = ", ".join(f"${i}" for i in range(1, len(self.columns) + 1))
        return f"INSERT INTO {self.name} ({', '.join(self.columns)}) VALUES ({marks})"


TABLES: tuple[Table, ...] = (
    Table("catalog", ("kind", "id", "doc")),
    Table("tokens", ("hash", "kind", "subject")),
    Table("reservations", ("seq", "id", "tenant_id", "principal_id", "pool_id", "state", "doc")),
    # The engine's own statement: the booking row and one booked_units row per device, in one.
    Table("bookings", ("reservation_id", "pool_id", "node_id", "units", "start_ms", "end_ms", "vcpu_milli",
                       "memory_mib", "hugepages_1g"), insert=pg_sql.INSERT_BOOKING, convert=_booking),
    Table("operation_aliases", ("id", "reservation_id")),
    Table("events", ("seq", "tenant_id", "reservation_id", "type", "at", "data")),
    Table("confirmations", ("id", "tenant_id", "reservation_id", "agent_id", "user_id", "status", "created_at",
                            "doc")),
    Table("billing", ("reservation_id", "tenant_id", "pool_id", "hourly_usd", "start_ms", "end_ms"),
          convert=_billing),
    Table("quotes", ("id", "tenant_id", "expires_at", "doc")),
)
SERIALS = (("reservations", "seq"), ("events", "seq"), ("bookings", "id"))  # the target's BIGSERIAL columns
# A target holding any of these is refused without --replace (table -> how the refusal counts its rows).
GUARDED = {"reservations": "reservations", "events": "events", "catalog": "catalog rows"}
# Emptied before the copy (what a control plane's data is; schema_version and replica_state stay).
EMPTIED = ("catalog", "tokens", "reservations", "bookings", "booked_units", "operation_aliases", "events",
           "confirmations", "billing", "quotes", "node_seen")


class Progress:
    """Rows done of the table being copied, rewritten in place on a terminal; nothing where the stream is not
    one (a log file gets the summary only)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()

    def show(self, table: str, done: int, total: int) -> None:
        if self.live:
            self.stream.write(f"\r{table:<18} {done:>10,} / {total:,} rows")
            self.stream.flush()

    def finish(self, table: str, total: int) -> None:
        if self.live:
            self.show(table, total, total)
            self.stream.write("\n")
            self.stream.flush()


def open_source(path: str) -> sqlite3.Connection:
    """The SQLite file at the engine's current schema, inside BEGIN IMMEDIATE (no other writer until the
    connection's transaction ends)."""
    if not Path(path).is_file():
        raise Refused(f"--from sqlite:///{path}: no such file; give the database a control plane served with "
                      "--db sqlite:///PATH")
    conn = None
    try:
        # Read-only first: a file that is not Berth's is refused as it was found (opening it the engine's way
        # would switch it to WAL, or give an empty file a header).
        with contextlib.closing(sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)) as peek:
            version = peek.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:  # every Berth file has a version (migrate)
            raise Refused(f"--from sqlite:///{path}: not a Berth control-plane database (no Berth schema in it); "
                          "give the file a control plane served with --db sqlite:///PATH")
        conn = sqlite.connect(path)
        sqlite.migrate(conn, path)
        conn.execute("BEGIN IMMEDIATE")
    except StoreError as exc:
        if conn is not None:
            conn.close()
        raise Refused(f"--from: {exc}") from None
    except sqlite3.Error as exc:
        if conn is not None:
            conn.close()
        if "locked" in str(exc):
            raise Refused(f"--from sqlite:///{path}: {exc}: a control plane is writing to it; stop it, then "
                          "migrate") from None
        raise Refused(f"--from sqlite:///{path}: cannot read it as a SQLite database ({exc}); give the file a "
                      "control plane served with --db sqlite:///PATH") from None
    except Refused:
        if conn is not None:
            conn.close()
        raise
    return conn


async def open_target(dsn: str) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(dsn, timeout=10)
    except (*pg_connect.UNREACHABLE, asyncpg.PostgresError, ValueError) as exc:
        if isinstance(exc, ValueError):  # asyncpg could not read the URL
            raise Refused(f"--to {redact_url(dsn)}: {exc}; give postgresql://USER@HOST[:PORT]/DB (or "
                          "postgresql://USER@/DB?host=/run/postgresql for a unix socket) of an existing database") \
                from None
        raise Refused(f"--to {redact_url(dsn)}: cannot connect: {pg_connect.cannot_connect(exc, dsn)}") from None


async def migrate_target(pg: asyncpg.Connection, shown_target: str) -> None:
    """The target at the PostgreSQL engine's current schema. Called inside the copy's transaction, each migration
    is a savepoint of it: a failed copy leaves no schema behind either. The migrations' lock is held to the copy's
    commit too (pg_schema.migrate's own is its session's, released when it returns): a replica starting meanwhile
    waits for the schema committed, not for tables it would then meet as another's uncommitted ones."""
    await pg.execute("SELECT pg_advisory_xact_lock($1)", pg_schema.MIGRATION_LOCK)
    try:
        await pg_schema.migrate(pg)
    except pg_schema.SchemaTooNew as exc:
        raise Refused(f"--to {shown_target}: {exc}") from None
    except asyncpg.PostgresError as exc:
        raise Refused(f"--to {shown_target}: cannot create the schema ({type(exc).__name__}: {exc}); the user "
                      "needs the right to create tables and the btree_gist extension (docs/scale-out.md)") from None


def overlaps(src: sqlite3.Connection, limit: int = 5) -> list[str]:
    """Pairs of the file's bookings that hold one device in overlapping windows (what PostgreSQL's exclusion
    constraint refuses), as sentences; at most `limit`."""
    latest: dict[tuple[str, str], tuple[int, str, int]] = {}  # device -> (end, reservation, start) reaching latest
    found: list[str] = []
    rows = src.execute("SELECT node_id, units, start_ms, end_ms, reservation_id FROM bookings WHERE end_ms > start_ms"
                       " ORDER BY start_ms, rowid")
    for node, units, start, end, rid in rows:
        for unit in _units(units):
            prev = latest.get((node, unit))
            if prev is not None and start < prev[0] and prev[1] != rid:
                found.append(f"node {node} unit {unit}: reservation {prev[1]} [{prev[2]}, {prev[0]}) and "
                             f"reservation {rid} [{start}, {end})")
                if len(found) == limit:
                    return found
            if prev is None or end > prev[0]:
                latest[(node, unit)] = (end, rid, start)
    return found


async def _copy_table(src: sqlite3.Connection, pg: asyncpg.Connection, table: Table, total: int,
                      progress: Progress) -> int:
    cursor = src.execute(table.select)
    done = 0
    progress.show(table.name, 0, total)
    while batch := cursor.fetchmany(BATCH):
        if table.convert is not None:
            batch = [table.convert(row) for row in batch]
        await pg.executemany(table.statement, batch)
        done += len(batch)
        progress.show(table.name, done, total)
    progress.finish(table.name, done)
    return done


async def _held(pg: asyncpg.Connection) -> dict[str, int]:
    return {name: await pg.fetchval(f"SELECT count(*) FROM {name}") for name in GUARDED}


async def _set_sequences(src: sqlite3.Connection, pg: asyncpg.Connection) -> None:
    """Each BIGSERIAL past the largest value copied, past what SQLite's AUTOINCREMENT ever handed out, and past
    what the target's own sequence handed out (--replace onto a database replicas served: clients hold cursors
    of its events and list pages): a seq is never given twice, even one whose row is gone."""
    given = dict(src.execute("SELECT name, seq FROM sqlite_sequence"))
    for table, column in SERIALS:
        sequence = await pg.fetchval("SELECT pg_get_serial_sequence($1, $2)", table, column)
        top = max(await pg.fetchval(f"SELECT COALESCE(MAX({column}), 0) FROM {table}"), given.get(table, 0),
                  await pg.fetchval("SELECT COALESCE(pg_sequence_last_value($1::regclass), 0)", sequence))
        if top:
            await pg.execute("SELECT setval($1, $2, true)", sequence, top)
        else:
            await pg.execute("SELECT setval($1, 1, false)", sequence)


async def copy_into(src: sqlite3.Connection, pg: asyncpg.Connection, shown_target: str, replace: bool,
               progress: Progress) -> dict[str, int]:
    """Every table of src into pg in one transaction; rows copied per table (and booked_units written)."""
    totals = {t.name: src.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0] for t in TABLES}
    rows: dict[str, int] = {}
    async with pg.transaction():
        await migrate_target(pg, shown_target)
        await pg.execute("SELECT pg_advisory_xact_lock($1)", pg_sql.WRITE_LOCK)  # replicas' writes wait
        held = await _held(pg)
        if any(held.values()) and not replace:
            what = ", ".join(f"{n} {GUARDED[name]}" for name, n in held.items() if n)
            raise Refused(f"--to {shown_target} already holds data ({what}): give an empty database (createdb), "
                          "or --replace to empty this one first, in the same transaction as the copy")
        await pg.execute(f"TRUNCATE {', '.join(EMPTIED)}")  # with nothing guarded held: leftovers (node_seen)
        for table in TABLES:
            try:
                rows[table.name] = await _copy_table(src, pg, table, totals[table.name], progress)
            except asyncpg.ExclusionViolationError as exc:
                pairs = overlaps(src) or [exc.detail or str(exc)]
                raise Failed("the SQLite file books one device twice in overlapping windows, which PostgreSQL's "
                             "exclusion constraint refuses (one booking per device at a time): "
                             + "; ".join(pairs) + ". End or cancel one of each pair on the SQLite control plane "
                             "(then stop it), and migrate again; the target was not changed") from None
            except asyncpg.PostgresError as exc:
                raise Failed(f"copying {table.name}: {type(exc).__name__}: {exc}; the target was not "
                             "changed") from None
        rows["booked_units"] = await pg.fetchval("SELECT count(*) FROM booked_units")
        await _set_sequences(src, pg)
        # A replica already on the target rebuilds its memory whole (the copied reservations carry no generation
        # of their own for it to catch up by, and --replace removed rows): the rebuild generation says so, and the
        # catalog's, to a replica of an earlier release.
        generation = await pg.fetchval(
            "UPDATE replica_state SET generation = generation + 1, catalog_generation = generation + 1,"
            " rebuild_generation = generation + 1 WHERE id = 1 RETURNING generation")
        await pg.execute("SELECT pg_notify($1, $2)", CHANNEL, str(generation))  # sent at commit, as a replica's
    return rows


def move(path: str, dsn: str, replace: bool = False, progress: Progress | None = None) -> dict[str, int]:
    """Copy the SQLite file at path into the PostgreSQL database dsn; rows per table. Raises Refused (nothing
    changed: fix the input) or Failed (the target was not changed)."""
    src = open_source(path)
    try:
        return asyncio.run(_move(src, dsn, replace, progress or Progress()))
    finally:
        if src.in_transaction:
            src.execute("ROLLBACK")  # nothing was written inside BEGIN IMMEDIATE: just let writers in again
        src.close()


async def _move(src: sqlite3.Connection, dsn: str, replace: bool, progress: Progress) -> dict[str, int]:
    pg = await open_target(dsn)
    try:
        return await copy_into(src, pg, redact_url(dsn), replace, progress)
    except (*pg_connect.UNREACHABLE, asyncpg.PostgresError) as exc:  # the connection lost midway, a failed commit
        raise Failed(f"--to {redact_url(dsn)}: {type(exc).__name__}: {exc}; the target was not changed (retry "
                     "once the database is reachable)") from None
    finally:
        await pg.close()


def summary(path: str, dsn: str, rows: dict[str, int]) -> str:
    """What was moved, a table a line."""
    lines = [f"moved sqlite:///{path} to {redact_url(dsn)}"]
    lines += [f"  {name:<18} {n:>10,}" for name, n in rows.items()]
    return "\n".join(lines)
