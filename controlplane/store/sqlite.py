"""The SQLite engine of the store port (store/port.py): schema, committed reads, and one writer with group commit.

Every mutation is a job `fn(tx)` run by the writer inside one transaction
shared by all jobs that arrived while the previous group was committing
(group commit: one fsync for the whole group); each job has its own
savepoint, so a job that refuses rolls back alone. A job's caller is answered
only after the commit, so an acknowledged change survives a kill -9. A job
that changes the writer's in-memory state (calendar, quota ledger) marks its
Tx dirty first; if such a job fails, or a commit fails, the memory is rebuilt
from the database (as the transaction then stands), so memory and database
never disagree. Every SQL statement of the control plane is in this module.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import structlog

from common import pidlock
from common.share import Share
from controlplane.domain.calendar import Booking
from controlplane.domain.errors import DomainError
from controlplane.domain.model import Operation, Reservation
from controlplane.domain.states import TERMINAL
from controlplane.store import codec
from controlplane.store.groups import Appends, JobOutcome, WriterFront, resolve, run_hooks, unavailable
from controlplane.store.port import StoreError
from controlplane.store.reads import STATE_COUNTS, CommittedReads, Reads, reservation_of

log = structlog.get_logger("berth.store")

SCHEMA_VERSION = 2  # 1: operations in their own table; 2: operations inside their reservation's document
SCHEMA = """
CREATE TABLE IF NOT EXISTS catalog (
  kind TEXT NOT NULL, id TEXT NOT NULL, doc BLOB NOT NULL, PRIMARY KEY (kind, id)
);
CREATE TABLE IF NOT EXISTS tokens (
  hash TEXT PRIMARY KEY, kind TEXT NOT NULL, subject TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  tenant_id TEXT NOT NULL,
  principal_id TEXT NOT NULL,
  pool_id TEXT NOT NULL,
  state TEXT NOT NULL,
  doc BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_by_tenant ON reservations (tenant_id, seq);
CREATE INDEX IF NOT EXISTS reservations_by_principal ON reservations (tenant_id, principal_id, seq);
CREATE INDEX IF NOT EXISTS reservations_live ON reservations (state) WHERE state NOT IN ('released', 'cancelled');
CREATE INDEX IF NOT EXISTS reservations_live_by_tenant ON reservations (tenant_id, state, seq)
  WHERE state NOT IN ('released', 'cancelled');
CREATE TABLE IF NOT EXISTS bookings (
  id INTEGER PRIMARY KEY,
  reservation_id TEXT NOT NULL,
  pool_id TEXT NOT NULL,
  node_id TEXT NOT NULL,
  units TEXT NOT NULL,
  start_ms INTEGER NOT NULL,
  end_ms INTEGER NOT NULL,
  vcpu_milli INTEGER NOT NULL,
  memory_mib INTEGER NOT NULL,
  hugepages_1g INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS bookings_by_reservation ON bookings (reservation_id);
CREATE TABLE IF NOT EXISTS operation_aliases (
  id TEXT PRIMARY KEY, reservation_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  tenant_id TEXT NOT NULL,
  reservation_id TEXT,
  type TEXT NOT NULL,
  at INTEGER NOT NULL,
  data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_tenant ON events (tenant_id, seq);
CREATE TABLE IF NOT EXISTS confirmations (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  reservation_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  user_id TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  doc BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS confirmations_by_user ON confirmations (tenant_id, user_id, created_at);
CREATE INDEX IF NOT EXISTS confirmations_by_agent ON confirmations (tenant_id, agent_id, created_at);
CREATE TABLE IF NOT EXISTS billing (
  reservation_id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  pool_id TEXT NOT NULL,
  hourly_usd TEXT NOT NULL,
  start_ms INTEGER NOT NULL,
  end_ms INTEGER
);
CREATE INDEX IF NOT EXISTS billing_by_tenant ON billing (tenant_id, start_ms);
CREATE TABLE IF NOT EXISTS quotes (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  expires_at INTEGER NOT NULL,
  doc BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS node_seen (node_id TEXT PRIMARY KEY, seen_at INTEGER NOT NULL);
"""

GROUP_MAX = 256
# What the writer's memory is rebuilt from (at start, after a job that failed midway), read without going through
# every reservation ever made, so a start does not grow with the history: the live reservations by their partial
# index (sorted here: with ORDER BY seq SQLite reads the whole table in seq order, 0.6 s a million rows warm and
# seconds cold), and the released ones still booked by a scan of the bookings (rows of a few dozen bytes), each
# probing its reservation by id (CROSS JOIN keeps that order). tests/controlplane/test_rebuild.py checks the plans.
LIVE_RESERVATIONS = "SELECT doc, seq FROM reservations WHERE state NOT IN ('released', 'cancelled')"
HELD_RESERVATIONS = (
    "SELECT DISTINCT r.doc, r.seq FROM bookings b CROSS JOIN reservations r ON r.id = b.reservation_id"
    " WHERE b.end_ms > ? AND r.state = 'released' ORDER BY r.seq")
_BOOKING = ("b.reservation_id, b.pool_id, b.node_id, b.units, b.start_ms, b.end_ms, b.vcpu_milli, b.memory_mib,"
            " b.hugepages_1g, b.id")
# The bookings that still block someone at ?: of live reservations, and a released one's turnaround (the state
# named twice in the first half: the partial index serves only a condition that repeats its own).
LIVE_BOOKINGS = (
    f"SELECT {_BOOKING} FROM reservations r CROSS JOIN bookings b ON b.reservation_id = r.id"
    " WHERE r.state NOT IN ('released', 'cancelled') AND r.state IN ('placed', 'binding', 'active')"
    " AND b.end_ms > b.start_ms"
    f" UNION ALL SELECT {_BOOKING} FROM bookings b CROSS JOIN reservations r ON r.id = b.reservation_id"
    " WHERE b.end_ms > ? AND b.end_ms > b.start_ms AND r.state = 'released' ORDER BY 10")


def free_bytes(where: Path) -> int | None:
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def disk_full(path: str, error: str) -> str:
    where = Path(path).parent
    return (f"cannot open {path} ({error}): the file system holding it is full ({free_bytes(where) or 0} bytes "
            f"free): free space there (df -h {where}) and start again; the database itself is unchanged")


def cannot_open(path: str, exc: sqlite3.DatabaseError) -> str:
    """Why a database file could not be opened, and what to do: a full or failing disk is not a wrong file."""
    name = getattr(exc, "sqlite_errorname", "")
    where = Path(path).parent
    if name.startswith(("SQLITE_FULL", "SQLITE_IOERR")):
        free = free_bytes(where)
        if name.startswith("SQLITE_FULL") or (free is not None and free < 1 << 20):
            return disk_full(path, str(exc))
        return (f"cannot open {path} ({exc}): reading or writing it, or its -wal and -shm files beside it, failed: "
                f"check the disk holding {where} (dmesg) and start again")
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")):
        return (f"cannot open {path} ({exc}): the control plane's user must be able to write it and create "
                f"files beside it in {where}")
    return f"cannot open {path} as a SQLite database ({exc}): give the control plane's database file, or a new path " \
           "for a new one"


def connect(path: str, synchronous: str = "FULL") -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA cache_size=-65536")  # 64 MiB of pages: the indexes of a large calendar stay in memory
    return conn


def events_numbered(conn: sqlite3.Connection) -> int:
    """The highest event number the file has handed out (0: none): AUTOINCREMENT numbers the next one after both
    sqlite_sequence's and the table's highest."""
    return conn.execute("SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0),"
                        " coalesce((SELECT max(seq) FROM events), 0))").fetchone()[0]


class SqliteReads(Reads):
    """The shared reads (store/reads.py) on this side's connection: the writer's, or the committed-read one."""

    __slots__ = ()
    conn: sqlite3.Connection

    def _fetchrow(self, sql: str, *args) -> Any:
        return self.conn.execute(sql, args).fetchone()

    def _fetch(self, sql: str, *args) -> list:
        return self.conn.execute(sql, args).fetchall()


INSERT_BOOKING = ("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
                  " memory_mib, hugepages_1g) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
INSERT_EVENT = "INSERT INTO events (tenant_id, reservation_id, type, at, data) VALUES (?, ?, ?, ?, ?)"


class SqliteAppends(Appends):
    """Appends written through the sqlite3 connection."""

    __slots__ = ()

    def write(self, conn: sqlite3.Connection) -> None:
        for sql, rows in self.by_kind().items():
            conn.executemany(sql, rows)


class SqliteTx(SqliteReads, JobOutcome):
    """The writer's view of the open transaction (port.Tx): the domain's writes, as small methods."""

    __slots__ = ("conn", "appends", "group", "flushed", "saved")

    def __init__(self, conn: sqlite3.Connection, group: Appends | None = None):
        super().__init__()
        self.conn = conn
        self.appends = SqliteAppends()  # this job's appended rows (dropped if it fails)
        self.group = group if group is not None else SqliteAppends()  # earlier jobs' rows, not yet written
        self.flushed = SqliteAppends()  # earlier jobs' rows written during this job (written again if it fails)
        self.saved = False  # whether this job opened its savepoint (at its first write: a job that only reads or
        #                     refuses before writing costs no SAVEPOINT and RELEASE)

    def _writing(self) -> sqlite3.Connection:
        if not self.saved:
            self.conn.execute("SAVEPOINT job")
            self.saved = True
        return self.conn

    def flush(self) -> None:
        """Write every appended row now (before a statement that must see them)."""
        if self.group:
            earlier = self.group.take()
            earlier.write(self._writing())
            self.flushed.extend(earlier)
        if self.appends:
            self.appends.take().write(self._writing())

    # reservations
    def _insert_reservation(self, res: Reservation) -> None:
        cur = self._writing().execute(
            "INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc) VALUES (?, ?, ?, ?, ?, ?)",
            (res.id, res.tenant_id, res.principal_id, res.pool_id, res.state, codec.encode(res)),
        )
        res.seq = cur.lastrowid

    def save_reservation(self, res: Reservation) -> None:
        """Insert a reservation never stored (seq 0), else update it."""
        if res.seq == 0:
            self._insert_reservation(res)
        else:
            self._update_reservation(res)

    def _update_reservation(self, res: Reservation) -> None:
        self._writing().execute(
            "UPDATE reservations SET state = ?, doc = ? WHERE id = ?", (res.state, codec.encode(res), res.id)
        )

    def move_if(self, res: Reservation, expected_state: str) -> bool:
        """Write the reservation only if its stored state is still expected_state (a conditional transition)."""
        cur = self._writing().execute(
            "UPDATE reservations SET state = ?, doc = ? WHERE id = ? AND state = ?",
            (res.state, codec.encode(res), res.id, expected_state),
        )
        return cur.rowcount == 1

    # bookings
    def insert_bookings(self, bookings: Iterable[Booking]) -> None:
        for b in bookings:
            self.appends.add(INSERT_BOOKING, (b.reservation_id, b.pool_id, b.node_id, ",".join(b.units), b.start, b.end,
                                              b.share.vcpu_milli, b.share.memory_mib, b.share.hugepages_1g))

    def end_bookings(self, reservation_id: str, at: int) -> None:
        """Bookings end at `at`; one not yet started ends where it starts (kept, empty, for history)."""
        self._move_end("MAX(start_ms, MIN(end_ms, ?))", at, reservation_id)

    def set_bookings_end(self, reservation_id: str, end: int) -> None:
        self._move_end("?", end, reservation_id)

    def _move_end(self, end: str, at: int, reservation_id: str) -> None:
        """Of live bookings only: one ended where it started (a reservation moved off a node before its start)
        stays so."""
        self.flush()
        self._writing().execute(f"UPDATE bookings SET end_ms = {end} WHERE reservation_id = ? AND end_ms > start_ms",
                                (at, reservation_id))

    # events
    def event(self, tenant_id: str, reservation_id: str | None, type_: str, at: int, data: dict[str, Any]) -> None:
        self.appends.add(INSERT_EVENT, (tenant_id, reservation_id, type_, at, codec.encode(data)))

    # confirmations
    def put_confirmation(self, conf) -> None:
        self._writing().execute(
            "INSERT INTO confirmations (id, tenant_id, reservation_id, agent_id, user_id, status, created_at, doc)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET status = excluded.status, doc = excluded.doc",
            (conf.id, conf.tenant_id, conf.reservation_id, conf.agent_id, conf.user_id, conf.status, conf.created_at,
             codec.encode(conf)),
        )

    # billing and quotes
    def bill_from(self, res: Reservation, start: int) -> None:
        self._writing().execute(
            "INSERT INTO billing (reservation_id, tenant_id, pool_id, hourly_usd, start_ms, end_ms) VALUES (?, ?, ?, ?, ?, NULL)"
            " ON CONFLICT (reservation_id) DO NOTHING",
            (res.id, res.tenant_id, res.pool_id, str(res.hourly_usd), start),
        )

    def bill_until(self, reservation_id: str, end: int) -> None:
        self._writing().execute("UPDATE billing SET end_ms = ? WHERE reservation_id = ? AND end_ms IS NULL", (end, reservation_id))

    def put_quote(self, quote_id: str, tenant_id: str, expires_at: int, doc: bytes) -> None:
        self._writing().execute("INSERT INTO quotes (id, tenant_id, expires_at, doc) VALUES (?, ?, ?, ?)",
                          (quote_id, tenant_id, expires_at, doc))
        self._writing().execute("DELETE FROM quotes WHERE expires_at < ?", (expires_at - 86_400_000,))

    # catalog and tokens
    def record_seen(self, seen: dict[str, int]) -> None:
        """Agents' last heartbeats (epoch ms), never moving one back (replicas.Solo)."""
        self._writing().executemany(
            "INSERT INTO node_seen (node_id, seen_at) VALUES (?, ?) ON CONFLICT (node_id)"
            " DO UPDATE SET seen_at = MAX(seen_at, excluded.seen_at)", list(seen.items()))

    def put_catalog(self, kind: str, ident: str, doc: bytes) -> None:
        self._writing().execute(
            "INSERT INTO catalog (kind, id, doc) VALUES (?, ?, ?) ON CONFLICT (kind, id) DO UPDATE SET doc = excluded.doc",
            (kind, ident, doc),
        )

    def put_token(self, token_hash: str, kind: str, subject: str) -> None:
        self._writing().execute(
            "INSERT INTO tokens (hash, kind, subject) VALUES (?, ?, ?) ON CONFLICT (hash) DO UPDATE SET kind = excluded.kind, subject = excluded.subject",
            (token_hash, kind, subject),
        )

    def delete_tokens(self, kind: str, subject: str) -> None:
        self._writing().execute("DELETE FROM tokens WHERE kind = ? AND subject = ?", (kind, subject))

    # what the writer's memory is built from
    def live_reservations(self, now: int) -> list[Reservation]:
        rows = sorted(self.conn.execute(LIVE_RESERVATIONS), key=lambda row: row[1])
        live = [res for res in (reservation_of(doc, seq) for doc, seq in rows) if res.state not in TERMINAL]
        self.flush()
        held = self.conn.execute(HELD_RESERVATIONS, (now,))
        return live + [res for res in (reservation_of(doc, seq) for doc, seq in held) if res.hold is not None]

    def live_bookings(self, now: int) -> list[Booking]:
        self.flush()
        return [Booking(r[0], r[1], r[2], tuple(r[3].split(",")) if r[3] else (), r[4], r[5], Share(r[6], r[7], r[8]))
                for r in self.conn.execute(LIVE_BOOKINGS, (now,))]

    def catalog_docs(self, kind: str) -> list[bytes]:
        return [row[0] for row in self.conn.execute("SELECT doc FROM catalog WHERE kind = ? ORDER BY id", (kind,))]

    def tokens(self) -> dict[str, tuple[str, str]]:
        return {h: (k, s) for h, k, s in self.conn.execute("SELECT hash, kind, subject FROM tokens")}


class Writer:
    """The single writer: jobs run on the event loop in groups, each group committed by one fsync.

    While a group's COMMIT (the fsync) runs on the commit thread, new jobs
    queue; the next group runs them all in one transaction, each in its own
    savepoint, and commits once. Jobs run on the loop thread, so the
    writer's memory is only ever touched there, and only one group is open
    at a time. Answers are given after the commit.
    """

    def __init__(self, path: str, synchronous: str, on_reset: Callable[[SqliteTx], Callable[[], None]]):
        self._conn = connect(path, synchronous)
        self._on_reset = on_reset
        self._pending: list[tuple[Callable[[SqliteTx], Any], asyncio.Future]] = []
        self._busy = False
        self._commit_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="berth-store-commit")
        self._lock = threading.Lock()  # call_sync against a group run by the loop, and close against both
        self._closed = False
        self._hooks: list[Callable[[], None]] = []  # on_commit hooks of the open group
        self._appends = SqliteAppends()  # rows of the open group's jobs not yet written
        self.groups = 0  # committed
        self.jobs = 0
        self.rebuilds = 0  # the memory rebuilt from the file after a group's commit failed
        self.group_committed: Callable[[int], None] = lambda jobs: None  # each group's size, for /metrics

    def call(self, fn: Callable[[SqliteTx], Any]) -> "asyncio.Future[Any]":
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self._closed:
            fut.set_exception(unavailable("the control plane is stopping; retry on another one or shortly"))
            return fut
        self._pending.append((fn, fut))
        if not self._busy:
            self._busy = True
            loop.call_soon(self._start_group, loop)
        return fut

    def call_sync(self, fn: Callable[[SqliteTx], Any]) -> Any:
        """Run one job now, outside any event loop (start-up, tools); returns once committed."""
        with self._lock:
            if self._closed:
                raise unavailable("the control plane is stopping; retry on another one or shortly")
            self._conn.execute("BEGIN IMMEDIATE")
            answers = self._run_jobs([(fn, None)])
            hooks, self._hooks = self._hooks, []
            if self._commit(answers, self._appends.take()):
                run_hooks(hooks)
            else:
                self.rebuilds += 1
                self._reset()
        _, value, error = answers[0]
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """After the group in flight (it holds the lock: one connection is never used by two threads at once, which
        segfaulted a stop met mid-group); groups asked later are answered PROVIDER_UNAVAILABLE."""
        with self._lock:
            self._closed = True
            self._commit_thread.shutdown(wait=True)
            self._conn.close()

    def _start_group(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._closed:
            group, self._pending = self._pending, []
            resolve([(fut, None, unavailable("the control plane is stopping; retry on another one or shortly"))
                     for _, fut in group])
            self._busy = False
            return
        group, self._pending = self._pending[:GROUP_MAX], self._pending[GROUP_MAX:]
        if not group:
            self._busy = False
            return
        self._lock.acquire()
        if self._closed:  # closed while this waited for the lock
            self._lock.release()
            self._pending[:0] = group
            self._start_group(loop)
            return
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            answers = self._run_jobs(group)
        except BaseException:
            self._lock.release()
            raise
        # The group's appended rows are written here, on the loop (binding their values holds the GIL: on the commit
        # thread that would stall the loop more than it saves); the COMMIT, a wait on the disk, goes to the thread.
        try:
            self._appends.take().write(self._conn)
        except sqlite3.Error as exc:
            self._failed(answers, exc)
            done = loop.create_future()
            done.set_result(False)
            self._finish_group(loop, answers, done)
            return
        commit = loop.run_in_executor(self._commit_thread, self._commit, answers, SqliteAppends())
        commit.add_done_callback(lambda f: self._finish_group(loop, answers, f))

    def _finish_group(self, loop, answers, commit_future) -> None:
        hooks, self._hooks = self._hooks, []
        committed = False
        try:
            committed = commit_future.exception() is None and commit_future.result()
            if not committed:
                if commit_future.exception() is not None:  # the commit thread itself failed
                    err = unavailable(f"the store failed: {commit_future.exception()}")
                    answers = [(fut, None, err) for fut, _, _ in answers]
                self.rebuilds += 1
                self._reset()
        finally:
            self._lock.release()
        self.jobs += len(answers)
        if committed:  # a group rolled back is no transaction committed (berth_store_groups_total)
            self.groups += 1
            self.group_committed(len(answers))
        if committed:
            run_hooks(hooks)
        resolve(answers)
        if self._pending:
            loop.call_soon(self._start_group, loop)
        else:
            self._busy = False

    def _run_jobs(self, group) -> list[tuple[Any, Any, BaseException | None]]:
        conn = self._conn
        answers: list[tuple[Any, Any, BaseException | None]] = []
        for fn, fut in group:
            tx = SqliteTx(conn, self._appends)
            try:
                value = fn(tx)
            except BaseException as exc:  # noqa: BLE001 - every job gets an answer
                if tx.saved:
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                self._appends.extend(tx.flushed)  # earlier jobs' rows the rollback took with it
                if not isinstance(exc, DomainError):
                    log.exception("store job failed", job=getattr(fn, "__qualname__", repr(fn)))
                    exc = unavailable("the control plane could not complete this request")
                if tx.dirty:
                    self._on_reset(SqliteTx(conn, self._appends))()
                answers.append((fut, None, exc))
                continue
            if tx.saved:
                conn.execute("RELEASE job")
            self._appends.extend(tx.appends)
            self._hooks.extend(tx.committed)
            answers.append((fut, None, tx.refused) if tx.refused is not None else (fut, value, None))
        return answers

    def _commit(self, answers: list, appends: Appends) -> bool:
        """The appended rows still to write, and COMMIT; on failure roll back and fail the group's answers."""
        try:
            appends.write(self._conn)
            self._conn.execute("COMMIT")
            return True
        except sqlite3.Error as exc:
            self._failed(answers, exc)
            return False

    def _failed(self, answers: list, exc: sqlite3.Error) -> None:
        """The group cannot be committed: roll it back and fail its answers (the memory is rebuilt after)."""
        log.error("commit failed; rebuilding state from the database", error=str(exc))
        try:
            self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        err = unavailable(f"the store could not commit: {exc}")
        answers[:] = [(fut, None, err) for fut, _, _ in answers]

    def _reset(self) -> None:
        """Rebuild the writer's memory from the database, on the thread that owns the memory."""
        self._conn.execute("BEGIN")
        try:
            self._on_reset(SqliteTx(self._conn, self._appends))()
        finally:
            self._conn.execute("COMMIT")

def migrate(conn: sqlite3.Connection, path: str) -> None:
    """Bring the file to SCHEMA_VERSION; refuse a file written by a newer Berth.

    The tables are created if missing (every statement is IF NOT EXISTS); the
    data of an older version is then converted in one transaction, so a crash
    midway leaves the old version, converted again at the next start.
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path} has schema version {version}, newer than this Berth knows ({SCHEMA_VERSION}): "
                         "run the Berth release that wrote it, or a newer one")
    conn.executescript(SCHEMA)
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if version == 1:
            _fold_operations(conn)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if version:
        log.info("store migrated", path=path, from_version=version, to_version=SCHEMA_VERSION)


def _fold_operations(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2: each operation row into its reservation's document, its old id kept as an alias."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'operations'").fetchone():
        return
    by_res: dict[str, list[Operation]] = {}
    for rid, doc in conn.execute("SELECT reservation_id, doc FROM operations"):
        by_res.setdefault(rid, []).append(codec.decode_operation(doc))
    for rid, ops in by_res.items():
        row = conn.execute("SELECT doc, seq FROM reservations WHERE id = ?", (rid,)).fetchone()
        if row is None:
            continue
        res = reservation_of(*row)
        ops.sort(key=lambda op: (op.kind != "create", op.created_at))
        res.operations = ops
        conn.execute("UPDATE reservations SET doc = ? WHERE id = ?", (codec.encode(res), rid))
        conn.executemany("INSERT OR IGNORE INTO operation_aliases (id, reservation_id) VALUES (?, ?)",
                         [(op.id, rid) for op in ops])
    conn.execute("DROP TABLE operations")


def serving_lock(path: str) -> int:
    """One control plane per SQLite file: `PATH.lock` held (common/pidlock.py) for as long as the store is open,
    so a second `serve` on the file is refused instead of booking the same devices twice (each process would place
    from its own memory)."""
    try:
        return pidlock.hold(f"{path}.lock")
    except pidlock.Held as held:
        raise StoreError(f"{path} is served by another control plane (pid {held.holder}): one process serves a "
                         "SQLite database; stop that one first (systemctl stop berth-controlplane), or run several "
                         "replicas on PostgreSQL (docs/scale-out.md)") from None


class SqliteStore(WriterFront, SqliteReads, CommittedReads):
    """The store port on one SQLite file: reads on the caller's thread (a connection that sees committed data
    only) and the writer."""

    engine = "sqlite"
    schema_version = SCHEMA_VERSION  # opening brings the file there, or refuses it

    def __init__(self, path: str, synchronous: str = "FULL"):
        self.path = path
        self._lock: int | None = None
        if path != ":memory:":
            if Path(path).is_dir():
                raise StoreError(f"{path} is a directory: give the database file's path, for example "
                                 f"{Path(path) / 'controlplane.db'}")
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._lock = serving_lock(path)
            except OSError as exc:
                above = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
                if above is not None:  # mkdir says "File exists" of a file where a directory should be
                    raise StoreError(f"cannot use {path}: {above} is a file, not a directory: give a path in a "
                                     "directory the control plane's user may write") from None
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StoreError(disk_full(path, exc.strerror)) from None
                raise StoreError(f"cannot use {path} ({exc.strerror}): give a path in a directory the control "
                                 "plane's user may write") from None
        try:
            init = connect(path, synchronous)
            try:
                migrate(init, path)
            finally:
                init.close()
            self._synchronous = synchronous
            self.conn = connect(path, synchronous)
        except sqlite3.DatabaseError as exc:  # not a database, a damaged one, or a file that cannot be opened
            self._unlock()
            raise StoreError(cannot_open(path, exc)) from None
        except BaseException:
            self._unlock()
            raise
        self.writer: Writer | None = None

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the last descriptor releases the flock
            self._lock = None

    def start(self, on_reset: Callable[[SqliteTx], Callable[[], None]], on_group: Callable[[int], None] | None = None,
              on_changed: Callable | None = None, clock: Callable[[], int] | None = None) -> None:
        """on_changed is never called (nor clock): this writer is the file's only one."""
        self.writer = Writer(self.path, self._synchronous, on_reset)
        if on_group is not None:
            self.writer.group_committed = on_group

    def call(self, job: Callable[[SqliteTx], Any], reads: Iterable[str] = (),
             append_only: bool = False, background: bool = False) -> "asyncio.Future[Any]":
        """reads, append_only: unused (a read of the file costs no round trip; one group at a time is enough);
        background: unused (nothing holds a commit of this process's own file)."""
        assert self.writer is not None, "start() the store first"
        return self.writer.call(job)

    def refresh(self) -> "asyncio.Future[None]":
        """Nothing else writes this file: answered after the jobs queued before."""
        return self.call(lambda tx: None, background=True)

    def events_numbered(self) -> int:
        return events_numbered(self.conn)

    async def record_seen(self, seen: dict[str, int]) -> None:
        """Record agents' last heartbeats (epoch ms), never moving one back."""
        await self.call(lambda tx: tx.record_seen(seen))

    async def last_seen(self) -> dict[str, int]:
        """The agents' last heartbeats recorded (epoch ms): before this process started too."""
        return dict(self.conn.execute("SELECT node_id, seen_at FROM node_seen"))

    async def state_counts(self) -> list[tuple[str, str, int]]:
        if self.path == ":memory:":  # no other connection sees it (tests): a small one, read here
            return [tuple(r) for r in self.conn.execute(STATE_COUNTS)]
        return await asyncio.to_thread(self._state_counts_apart)

    def _state_counts_apart(self) -> list[tuple[str, str, int]]:
        """On a connection of its own, on a thread: sqlite3 lets the loop run while the scan does."""
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            conn.execute("PRAGMA query_only=ON")
            return [tuple(r) for r in conn.execute(STATE_COUNTS)]
        except sqlite3.Error as exc:
            raise unavailable(f"the database could not be read ({exc}); retry shortly") from None
        finally:
            conn.close()

    @staticmethod
    def database_error(exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.Error)  # a full disk, an I/O error, a lock held too long

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.conn.close()
        self._unlock()
