"""`berth controlplane migrate`: a SQLite database written by a real control plane moved to a throwaway PostgreSQL
database by the command itself (a subprocess), then read back by a control plane on PostgreSQL: reservations,
events with their seqs, billing and the memory (calendar, quota) equal; new rows numbered after the copied ones;
the database refusing a double booking of a copied device. A target holding data is refused unchanged unless
--replace; bad URLs, a newer file and an overlap in the file are refused with what to do."""
from __future__ import annotations

import asyncio
import io
import os
import sqlite3
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from controlplane.api.app import create_app
from controlplane.commands import Create
from controlplane.domain.admission import CreateRequest
from controlplane.domain.clock import FakeClock
from controlplane.store import move
from controlplane.wiring import Config, ControlPlane
from tests import dbrows
from tests.controlplane.conftest import HOUR, T0, Api
from tests.controlplane.test_billing import make_active
from tests.pgcluster import pg_cluster  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]
TENANTS = ("acme", "globex", "initech")


@dataclass
class Source:
    path: Path
    now: int  # the fake clock's time when the source was written
    active: str  # a reservation bound on h1/h2 (billed, open)


@pytest.fixture
async def source(tmp_path, aiohttp_client, bootstrap_file) -> Source:
    """A SQLite database written through the HTTP API: reservations active, released (billed and ended),
    placed in the future, cancelled, a pending one, a draft awaiting confirmation, events, a quote."""
    clock = FakeClock(T0)
    path = tmp_path / "cp.db"
    client = await aiohttp_client(create_app(Config(db=f"sqlite:///{path}", bootstrap=bootstrap_file(), clock=clock,
                                                    synchronous="OFF", reconcile=False)))
    api = Api(client, clock)
    active = await make_active(api, key="active", gpuCount=2, durationHours=4)
    done = await make_active(api, key="done", gpuCount=1, durationHours=4)
    clock.advance(HOUR)
    await api.ok("release", "alice", {"reservationId": done["id"]})
    await api.ok("create", "alice", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 8,
                                     "start": T0 + 10 * HOUR, "end": T0 + 12 * HOUR, "idempotencyKey": "future"})
    status, doc = await api.create(key="later", start=T0 + 20 * HOUR, end=T0 + 21 * HOUR)
    await api.ok("cancel", "alice", {"reservationId": doc["reservation"]["id"]})
    status, doc = await api.create(key="full", gpuCount=8, start=T0 + 10 * HOUR, end=T0 + 11 * HOUR, nodeCount=2)
    assert status == 202 and doc["reservation"]["state"] == "pending", doc  # h1 and h2 are booked then by "future"
    status, doc = await api.create("agent", key="asks", gpuCount=4)
    assert doc["error"]["code"] == "CONFIRMATION_REQUIRED", doc
    status, doc = await api.call("quote", "alice", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1,
                                                    "durationHours": 2})
    assert status == 200, doc
    await api.create("carol", key="globex", poolId="globex-own")
    await api.settle()
    now = clock.compute_now()
    await client.close()
    return Source(path, now, active["id"])


@pytest.fixture
def target(pg_cluster):  # noqa: F811
    """A fresh database on the session's throwaway cluster (dropped after), as a DSN."""
    name = f"berth_{uuid.uuid4().hex[:12]}"
    yield pg_cluster.createdb(name)
    pg_cluster.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "berth", "controlplane", "migrate", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def moved(src: Source, dsn: str, *extra: str) -> subprocess.CompletedProcess:
    out = migrate("--from", f"sqlite:///{src.path}", "--to", dsn, *extra)
    assert 0 == out.returncode, out.stderr
    return out


def open_plane(db: str, now: int) -> ControlPlane:
    return ControlPlane(Config(db=db, clock=FakeClock(now), synchronous="OFF", reconcile=False)).open()


def everything(cp: ControlPlane, ids: list[str]) -> dict:
    """What a control plane answers from its store and holds in memory, comparable across engines."""
    store = cp.store
    return {
        "reservations": {rid: store.reservation(rid) for rid in ids},
        "pages": {t: store.reservations_page(t, None, None, None, None, 1000) for t in TENANTS},
        "events": {t: store.events(t, None, 10_000) for t in TENANTS},
        "billing": {t: store.billing(t) for t in TENANTS},
        "confirmations": {t: store.confirmations(t, None, None, None, 100) for t in TENANTS},
        "tokens": cp.tokens.rows,
        "catalog": cp.catalog.current,
        "calendar": cp.state.calendar.by_reservation,
        "quota": {t: dict(c) for t, c in cp.state.ledger.used.items() if c},
        "pending": {p: list(q) for p, q in cp.state.pending.items() if q},
    }


def ids_of(path: Path) -> list[str]:
    return [r[0] for r in dbrows.rows(path, "SELECT id FROM reservations ORDER BY seq")]


def counts(dsn: str) -> dict[str, int]:
    return {t: dbrows.rows(dsn, f"SELECT count(*) FROM {t}")[0][0] for t in move.EMPTIED + ("replica_state",)} | {
        "generation": dbrows.rows(dsn, "SELECT generation FROM replica_state")[0][0]}


def create(key: str, **fields) -> Create:
    request = CreateRequest(**{"pool_id": "h100", "gpu_model": "H100_80GB", "gpu_count": 1, "duration_ms": HOUR,
                               **fields})
    return Create(request, key, key)


def test_a_moved_database_reads_back_the_same_on_postgresql(source, target):
    out = moved(source, target)
    sqlite_rows = {t.name: dbrows.rows(source.path, f"SELECT count(*) FROM {t.name}")[0][0] for t in move.TABLES}
    assert all(sqlite_rows[n] for n in ("reservations", "bookings", "events", "billing", "quotes", "confirmations"))
    for name, n in sqlite_rows.items():
        assert f"  {name:<18} {n:>10,}" in out.stdout.splitlines(), out.stdout
    assert "" == out.stderr  # not a terminal: no progress lines
    ids = ids_of(source.path)
    old = open_plane(f"sqlite:///{source.path}", source.now)
    try:
        expected = everything(old, ids)
    finally:
        old.close()
    new = open_plane(target, source.now)
    try:
        assert expected == everything(new, ids)
        assert 1 == dbrows.rows(target, "SELECT generation FROM replica_state")[0][0]  # raised once: replicas reload
        alice = new.catalog.current.principals["alice"]
        made = asyncio.run(new.reservations.create(alice, create("after-move", gpu_count=8, start=T0 + 10 * HOUR,
                                                           end=T0 + 11 * HOUR, duration_ms=None)))
        assert made.reservation.seq > max(r.seq for r in expected["reservations"].values())
        then = {(b.node_id, u) for bookings in expected["calendar"].values() for b in bookings for u in b.units
                if b.start < T0 + 11 * HOUR and b.end > T0 + 10 * HOUR}
        mine = {(b.node_id, u) for b in new.state.calendar.bookings_of(made.reservation.id) for u in b.units}
        assert (8, set()) == (len(mine), mine & then)  # placed beside the copied "future", not on it
        events = new.store.events("acme", None, 10_000)
        assert events[-1]["seq"] > expected["events"]["acme"][-1]["seq"]
    finally:
        new.close()
    # Underneath the memory, the database itself refuses a second booking of a copied device.
    node, unit, start, end = dbrows.rows(
        target, "SELECT b.node_id, u.unit, b.start_ms, b.end_ms FROM bookings b JOIN booked_units u ON "
        "u.booking_id = b.id WHERE b.reservation_id = ?", source.active)[0]
    with pytest.raises(asyncpg.ExclusionViolationError):
        dbrows.rows(target, "WITH b AS (INSERT INTO bookings (reservation_id, pool_id, node_id, start_ms, end_ms, "
                    "vcpu_milli, memory_mib, hugepages_1g) VALUES ('intruder', 'h100', ?, ?, ?, 0, 0, 0) RETURNING id)"
                    " INSERT INTO booked_units (booking_id, node_id, unit, during) SELECT id, ?, ?, "
                    "int8range(?, ?) FROM b", node, start, end, node, unit, start + 1, end + 1)


def test_a_target_holding_data_is_refused_and_left_unchanged(source, target):
    moved(source, target)
    before = counts(target)
    out = migrate("--from", f"sqlite:///{source.path}", "--to", target)
    assert 2 == out.returncode
    assert f"--to {target} already holds data (" in out.stderr and "--replace" in out.stderr, out.stderr
    assert "empty database" in out.stderr
    assert before == counts(target)


def test_replace_empties_the_target_first_in_the_same_transaction(source, target):
    """And a replica running on the target meanwhile rebuilds its memory from the copied rows: the reservation
    only it had made is gone from it, the copied ones are in it."""
    moved(source, target)
    cp = open_plane(target, source.now)

    async def replaced_under_a_running_replica():
        alice = cp.catalog.current.principals["alice"]
        extra = (await cp.reservations.create(alice, create("only-on-postgresql"))).reservation.id
        assert extra in cp.state.calendar.by_reservation
        handed_out = (await asyncio.to_thread(dbrows.rows, target, "SELECT MAX(seq) FROM events"))[0][0]
        out = await asyncio.to_thread(moved, source, target, "--replace")
        rebuilds = cp.store.writer.rebuilds
        await cp.store.refresh()  # (as on the copy's NOTIFY)
        assert cp.store.writer.rebuilds == rebuilds + 1
        after = (await cp.reservations.create(alice, create("after-the-replace"))).reservation
        return extra, out, after, handed_out

    try:
        extra, out, after, handed_out = asyncio.run(replaced_under_a_running_replica())
        assert extra not in cp.state.calendar.by_reservation and source.active in cp.state.calendar.by_reservation
    finally:
        cp.close()
    # Event numbers the replicas handed out before the replace are not handed out again: a client holding a
    # cursor of them skipped the events that came after (api.md: a cursor at or below the highest number handed
    # out is always valid).
    new_events = dbrows.rows(target, "SELECT seq FROM events WHERE reservation_id = ?", after.id)
    assert new_events and min(seq for seq, in new_events) > handed_out, (new_events, handed_out)
    assert "moved sqlite:///" in out.stdout
    assert [] == dbrows.rows(target, "SELECT id FROM reservations WHERE id = ?", extra)
    assert ids_of(source.path) + [after.id] == [r[0] for r in dbrows.rows(target, "SELECT id FROM reservations"
                                                                                   " ORDER BY seq")]
    assert dbrows.rows(source.path, "SELECT seq, type FROM events ORDER BY seq") == dbrows.rows(
        target, f"SELECT seq, type FROM events WHERE seq <= {handed_out} ORDER BY seq")


@pytest.mark.parametrize("source_url, target_url, says", [
    ("postgresql://nobody@/x", "TARGET", "--from 'postgresql://nobody@/x': give the SQLite database as sqlite:///PATH"),
    ("sqlite:///", "TARGET", "--from: sqlite:/// needs a file path"),
    ("sqlite:///MISSING", "TARGET", "no such file; give the database a control plane served with --db"),
    ("sqlite:///NOTADB", "TARGET", "cannot read it as a SQLite database"),
    ("SOURCE", "sqlite:///x.db", "--to 'sqlite:///x.db': give the PostgreSQL database as postgresql://USER"),
    ("SOURCE", "postgresql://nobody:secret@/no_such_db?host=SOCKET",
     "cannot connect: InvalidCatalogNameError: database \"no_such_db\" does not exist; create the database first"),
    ("SOURCE", "postgresql://nobody@/x?host=SOCKET&password=secret&sslmode=bogus", "sslmode"),
    ("SOURCE", "postgresql://nobody:secret@127.0.0.1:notaport/x",
     "the port 'notaport' of host '127.0.0.1:notaport' is not a number from 1 to 65535"),
    ("SOURCE", "postgresql://nobody@127.0.0.1:99999/x", "the port '99999' of host '127.0.0.1:99999' is not a number"),
])
def test_a_wrong_url_exits_2_saying_what_to_give(source, target, pg_cluster, tmp_path,  # noqa: F811
                                                       source_url, target_url, says):
    (tmp_path / "not-a-db").write_text("plain text, not SQLite\n" * 100)
    values = {"SOURCE": f"sqlite:///{source.path}", "TARGET": target, "MISSING": str(tmp_path / "missing.db"),
              "NOTADB": str(tmp_path / "not-a-db"), "SOCKET": str(pg_cluster.socket_dir)}
    for key, value in values.items():
        source_url, target_url = source_url.replace(key, value), target_url.replace(key, value)
    out = migrate("--from", source_url, "--to", target_url)
    assert (2, "") == (out.returncode, out.stdout), out.stderr
    assert says in out.stderr
    assert "secret" not in out.stderr  # a password is never shown
    assert [(0,)] == dbrows.rows(target, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")  # untouched


def test_a_file_that_is_not_berths_is_refused_as_it_was_found(tmp_path, target):
    """Refused, nothing changed, the --from file included: it used to be switched to WAL (and an empty one given
    a header) before the check."""
    other = tmp_path / "other-app.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for path in (other, empty):
        before = path.read_bytes()
        out = migrate("--from", f"sqlite:///{path}", "--to", target)
        assert (2, True) == (out.returncode, "not a Berth control-plane database" in out.stderr), out.stderr
        assert (before, False) == (path.read_bytes(), Path(f"{path}-wal").exists())


def test_a_file_of_a_newer_berth_is_refused_with_the_engines_message(source, target):
    conn = sqlite3.connect(source.path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    out = migrate("--from", f"sqlite:///{source.path}", "--to", target)
    assert 2 == out.returncode
    assert "has schema version 99, newer than this Berth knows" in out.stderr, out.stderr


@pytest.mark.parametrize("replace", [False, True], ids=["empty target", "--replace"])
def test_an_overlap_in_the_file_is_named_and_the_target_left_unchanged(source, target, replace):
    if replace:
        moved(source, target)  # the target holds the file as it was, and --replace would empty it first
        before = counts(target)
    conn = sqlite3.connect(source.path)
    rid, node, units, start, end = conn.execute(
        "SELECT reservation_id, node_id, units, start_ms, end_ms FROM bookings WHERE reservation_id = ?",
        (source.active,)).fetchone()
    conn.execute("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli, "
                 "memory_mib, hugepages_1g) VALUES ('r-intruder', 'h100', ?, ?, ?, ?, 0, 0, 0)",
                 (node, units.split(",")[0], start + 1, end))
    conn.commit()
    conn.close()
    out = migrate("--from", f"sqlite:///{source.path}", "--to", target, *(["--replace"] if replace else []))
    assert 1 == out.returncode, out.stderr
    unit = units.split(",")[0]
    assert f"node {node} unit {unit}: reservation {rid} [{start}, {end}) and reservation r-intruder" in out.stderr
    assert "exclusion constraint" in out.stderr and "the target was not changed" in out.stderr
    if replace:
        assert before == counts(target)
    else:  # not even the schema is left
        assert [(0,)] == dbrows.rows(target, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")


def test_progress_is_shown_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, piped = Terminal(), io.StringIO()
    for stream in (shown, piped):
        progress = move.Progress(stream)
        progress.show("events", 0, 4500)
        progress.show("events", 2000, 4500)
        progress.finish("events", 4500)
    assert "" == piped.getvalue()
    assert shown.getvalue().endswith("\revents                  4,500 / 4,500 rows\n")
    assert "\revents                  2,000 / 4,500 rows" in shown.getvalue()


def test_a_running_writer_on_the_file_waits_for_the_copy(source, target):
    """The copy reads under BEGIN IMMEDIATE: a writer on the file cannot commit until it is done."""
    src = move.open_source(str(source.path))
    try:
        other = sqlite3.connect(source.path, timeout=0.1)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("INSERT INTO tokens (hash, kind, subject) VALUES ('h', 'k', 's')")
        other.close()
    finally:
        src.execute("ROLLBACK")
        src.close()
