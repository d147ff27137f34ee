"""Backups, with the real parts: `berth controlplane backup` copies a SQLite database while a control plane (a
subprocess) books into it from four clients, and `berth controlplane restore` puts that copy back once it is
stopped: a control plane on the restored file answers every create acknowledged before the copy began, and its
new events are numbered after every event the replaced database had. Both refuse what they cannot use, changing
nothing. On PostgreSQL, what docs/operations.md says to do (pg_dump, pg_restore into an empty database, the
events' sequence carried over) brings a replica back with its reservations and the exclusion constraint."""
from __future__ import annotations

import hashlib
import json
import resource
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from tests import dbrows
from tests.controlplane.conftest import TOKENS, bootstrap_doc, h100_node
from tests.pgcluster import USER, pg_cluster  # noqa: F401 (fixture)
from tests.serverproc import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
API = "/api/compute/reservations/"
EVENTS = "/api/compute/events/list"


@pytest.fixture
def bootstrap(tmp_path) -> Path:
    doc = bootstrap_doc()
    doc["nodes"].append(h100_node("x0"))
    acme = doc["tenants"][0]
    acme["budgetUsd"] = "1000000"
    acme["quota"]["gpu:H100_80GB"] = 100_000
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    return path


def berth(*args: str, max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    """The command in a subprocess; `max_file_bytes` caps the size of any file it writes (RLIMIT_FSIZE: a write
    past it fails with EFBIG, as on a full disk)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run([sys.executable, "-m", "berth", "controlplane", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, preexec_fn=cap if max_file_bytes else None)


def create_body(key: str, n: int) -> dict:
    """One GPU in the n-th hour from the next one: 24 creates fit each hour, so none waits for another."""
    start = (int(time.time()) // 3600 + 2 + n // 20) * 3_600_000
    return {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "start": start, "end": start + 3_600_000,
            "idempotencyKey": key}


class Clients:
    """Four threads creating one after another until stopped; what each create was answered, and when."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.acked: list[tuple[float, str, str]] = []  # (answered at, key, reservation id)
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(4)]

    def _run(self, who: int) -> None:
        n = 0
        while not self.stop.is_set():
            key = f"c{who}-{n}"
            status, doc = self.server.post(API + "create", TOKENS["alice"], create_body(key, 4 * n + who))
            with self.lock:
                self.statuses.append(status)
                if status == 202:
                    self.acked.append((time.monotonic(), key, doc["reservation"]["id"]))
            n += 1

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def sha(db: Path) -> str:
    """A digest of what the database holds (its schema and rows, not how its pages lie)."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return hashlib.sha256("\n".join(conn.iterdump()).encode()).hexdigest()


def events_seq(db: Path) -> int:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]


def test_a_copy_taken_while_clients_book_holds_what_was_acknowledged_and_restores_in_place(tmp_path, bootstrap):
    db, copy = tmp_path / "cp.db", tmp_path / "backups" / "cp-copy.db"
    copy.parent.mkdir()
    with ServerProcess(db, bootstrap) as server, Clients(server) as clients:
        while len(clients.acked) < 40:
            time.sleep(0.01)
        began = time.monotonic()
        done = berth("backup", "--db", f"sqlite:///{db}", "--to", str(copy))
        ended = time.monotonic()
        while sum(1 for at, _, _ in clients.acked if at > ended) < 40:
            time.sleep(0.01)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"backed up {db} to {copy}: ") and "reservations" in done.stdout
    assert set(clients.statuses) == {202}  # the control plane went on answering every create meanwhile
    before = [(key, rid) for at, key, rid in clients.acked if at < began]
    after = [(key, rid) for at, key, rid in clients.acked if at > ended]
    assert len(before) >= 40 and len(after) >= 40
    with closing(sqlite3.connect(copy)) as conn:  # one whole file: no -wal needed beside it
        assert ("delete",) == conn.execute("PRAGMA journal_mode").fetchone()
        assert [("ok",)] == conn.execute("PRAGMA integrity_check").fetchall()
    assert not copy.with_name(copy.name + "-wal").exists()
    replaced_max = events_seq(db)

    # the control plane is stopped (the with above); the copy goes back in the database's place
    restored = berth("restore", "--from", str(copy), "--db", f"sqlite:///{db}")
    assert restored.returncode == 0, restored.stderr
    kept_db, = (p for p in tmp_path.iterdir() if p.name.startswith("cp.db.replaced-")
                and not p.name.endswith(("-wal", "-shm")))
    assert f"kept as {kept_db}" in restored.stdout
    assert events_seq(kept_db) == replaced_max  # the replaced database, whole, with every event it had
    assert f"new events from seq {replaced_max + 1}" in restored.stdout

    with ServerProcess(db, bootstrap) as server:
        for key, rid in before:  # every create acknowledged before the copy began is there
            status, doc = server.post(API + "get", TOKENS["alice"], {"reservationId": rid})
            assert (status, doc["reservation"]["id"]) == (200, rid), doc
        lost = [rid for key, rid in after if server.post(API + "get", TOKENS["alice"], {"reservationId": rid})[0]
                == 404]
        assert lost == [rid for key, rid in after]  # what was booked after the copy is not: the docs say so
        status, doc = server.post(API + "create", TOKENS["alice"], create_body("after-restore", 9_000))
        assert status == 202, doc
        rid = doc["reservation"]["id"]
        # a cursor from before the restore skips none of the new events
        status, page = server.post(EVENTS, TOKENS["alice"], {"after": replaced_max})
        assert (200, [rid]) == (status, [e["reservationId"] for e in page["events"]]), page
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        seqs = [s for (s,) in conn.execute("SELECT seq FROM events WHERE reservation_id = ?", (rid,))]
    assert seqs and min(seqs) > replaced_max

    # without the replaced database (a lost disk: the copy restored where no database is), numbers from the
    # copy's last are given again, and a cursor past them is refused, naming where to list from
    elsewhere = tmp_path / "new-disk" / "cp.db"
    elsewhere.parent.mkdir()
    assert berth("restore", "--from", str(copy), "--db", f"sqlite:///{elsewhere}").returncode == 0
    copy_max = events_seq(copy)
    assert copy_max < replaced_max
    with ServerProcess(elsewhere, bootstrap) as server:
        status, doc = server.post(EVENTS, TOKENS["alice"], {"after": replaced_max, "waitMs": 1000})
        assert (400, "after", copy_max) == (status, doc["error"]["details"]["field"],
                                            doc["error"]["details"]["newest"]), doc
        status, page = server.post(EVENTS, TOKENS["alice"], {"after": copy_max})
        assert (200, []) == (status, page["events"])


def test_restore_refuses_while_a_control_plane_has_the_database_open(tmp_path, bootstrap):
    db, copy = tmp_path / "cp.db", tmp_path / "copy.db"
    with ServerProcess(db, bootstrap) as server:
        assert server.post(API + "create", TOKENS["alice"], create_body("one", 0))[0] == 202
        assert berth("backup", "--db", f"sqlite:///{db}", "--to", str(copy)).returncode == 0
        assert server.post(API + "create", TOKENS["alice"], create_body("two", 1))[0] == 202
        listing = sorted(p.name for p in tmp_path.iterdir())
        out = berth("restore", "--from", str(copy), "--db", f"sqlite:///{db}")
        assert out.returncode == 2
        assert "a process has the database open" in out.stderr and "stop it first" in out.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == listing  # nothing moved, nothing written
        status, doc = server.post(API + "list", TOKENS["alice"], {})
        assert status == 200 and len(doc["reservations"]) == 2  # and the serving one never noticed


def test_backup_and_restore_refuse_what_they_cannot_use_and_write_nothing(tmp_path, bootstrap):
    db, copy = tmp_path / "cp.db", tmp_path / "copy.db"
    with ServerProcess(db, bootstrap):
        pass
    not_berth = tmp_path / "other.db"
    with closing(sqlite3.connect(not_berth)) as conn:
        conn.execute("CREATE TABLE t (x)")
    text = tmp_path / "notes.txt"
    text.write_text("not a database")
    newer = tmp_path / "newer.db"
    assert berth("backup", "--db", f"sqlite:///{db}", "--to", str(newer)).returncode == 0
    with closing(sqlite3.connect(newer)) as conn:
        conn.execute("PRAGMA user_version = 99")
    cases = [
        (("backup", "--db", f"sqlite:///{tmp_path / 'missing.db'}", "--to", str(copy)), "no such file"),
        (("backup", "--db", f"sqlite:///{not_berth}", "--to", str(copy)), "not a Berth control-plane database"),
        (("backup", "--db", f"sqlite:///{text}", "--to", str(copy)), "cannot read it as a SQLite database"),
        (("backup", "--db", f"sqlite:///{db}", "--to", str(newer)), "the file exists; give a new name, or --replace"),
        (("backup", "--db", f"sqlite:///{db}", "--to", str(db)), "that is the database itself"),
        (("backup", "--db", f"sqlite:///{db}", "--to", str(tmp_path / "no" / "x.db")), "does not exist; make it"),
        (("backup", "--db", "postgresql://berth:secret@/berth", "--to", str(copy)), "pg_dump -Fc"),
        (("backup", "--db", "sqlite:///:memory:", "--to", str(copy)), "--db: an in-memory database"),
        (("restore", "--from", str(tmp_path / "missing.db"), "--db", f"sqlite:///{db}"), "--from"),
        (("restore", "--from", str(not_berth), "--db", f"sqlite:///{db}"), "not a Berth control-plane database"),
        (("restore", "--from", str(db), "--db", f"sqlite:///{db}"), "that is the database itself"),
        (("restore", "--from", str(newer), "--db", f"sqlite:///{db}"), "schema version 99, newer than this Berth"),
        (("restore", "--from", str(newer), "--db", "postgresql://berth@/berth"), "pg_restore into an empty"),
        # directories where a file is meant, and an empty --to (a shell variable unset): no traceback
        (("backup", "--db", f"sqlite:///{db}", "--to", ""), "--to '': give the copy's file name"),
        (("backup", "--db", f"sqlite:///{db}", "--to", str(tmp_path), "--replace"), "give the copy's file name"),
        (("backup", "--db", f"sqlite:///{tmp_path}", "--to", str(copy)), "that is a directory"),
        (("restore", "--from", str(tmp_path), "--db", f"sqlite:///{db}"), "--from " + f"{tmp_path}: that is a dir"),
        (("restore", "--from", str(newer), "--db", f"sqlite:///{tmp_path}"), "that is a directory; give the data"),
    ]
    listing = sorted(p.name for p in tmp_path.iterdir())
    for args, says in cases:
        out = berth(*args)
        assert (out.returncode, out.stdout) == (2, ""), (args, out)
        assert says in out.stderr and out.stderr.startswith(f"berth controlplane {args[0]}: "), (args, out.stderr)
        assert "secret" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    # --replace overwrites a copy, and a restore where no database is yet makes one, owned as its directory
    assert berth("backup", "--db", f"sqlite:///{db}", "--to", str(newer), "--replace").returncode == 0
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    os.chown(fresh, 65534, 65534)
    out = berth("restore", "--from", str(newer), "--db", f"sqlite:///{fresh / 'cp.db'}")
    assert out.returncode == 0, out.stderr
    assert "kept as" not in out.stdout and (fresh / "cp.db").stat().st_uid == 65534
    # a copy that cannot be written whole (the disk full) fails with exit 1 and leaves everything as it was
    cap = db.stat().st_size + 40_000  # the database (and the 32 KiB -shm a WAL reader maps) fit, a larger copy not
    large = tmp_path / "large.db"
    assert berth("backup", "--db", f"sqlite:///{db}", "--to", str(large)).returncode == 0
    with closing(sqlite3.connect(large)) as conn:
        conn.execute("INSERT INTO events (tenant_id, reservation_id, type, at, data) VALUES ('acme', NULL, "
                     "'padding', 0, zeroblob(200000))")
        conn.commit()
    held = (events_seq(db), sha(db))
    before_failing = sorted(p.name for p in tmp_path.iterdir())
    out = berth("backup", "--db", f"sqlite:///{large}", "--to", str(copy), max_file_bytes=cap)
    assert out.returncode == 1 and f"the copy to {copy} failed" in out.stderr, out
    assert sorted(p.name for p in tmp_path.iterdir()) == before_failing
    out = berth("restore", "--from", str(large), "--db", f"sqlite:///{db}", max_file_bytes=cap)
    assert out.returncode == 1 and out.stderr.rstrip().endswith("the database is as it was"), out
    # put back where it was, nothing else left (its emptied WAL is gone: SQLite removes it with its last connection)
    assert [n for n in sorted(p.name for p in tmp_path.iterdir()) if not n.endswith(("-wal", "-shm"))] == \
        [n for n in before_failing if not n.endswith(("-wal", "-shm"))]
    assert (events_seq(db), sha(db)) == held  # and it is the database it was
    for n in (1, 2):  # each restore keeps the database it replaced, within one second too
        assert berth("restore", "--from", str(newer), "--db", f"sqlite:///{fresh / 'cp.db'}").returncode == 0
        assert n == len([p for p in fresh.iterdir() if p.name.startswith("cp.db.replaced-")
                         and not p.name.endswith(("-wal", "-shm"))])


LAST_EVENT = "SELECT last_value FROM events_seq_seq"


def pg_tool(cluster, name: str, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([str(cluster.bin / name), "-h", str(cluster.socket_dir), "-p", str(cluster.port), "-U",
                          USER, *args], capture_output=True, text=True, timeout=120, user=USER)
    assert out.returncode == 0, out.stderr
    return out


def test_pg_dump_and_pg_restore_as_documented_bring_a_replica_back(pg_cluster, tmp_path, bootstrap):  # noqa: F811
    """As docs/operations.md says, with the replicas' own role (not the cluster's superuser, who runs the tools):
    the restored database and its tables are that role's, or the replicas cannot open it."""
    source, target, stray = (f"berth_{uuid.uuid4().hex[:12]}" for _ in range(3))
    role = f"berth_{uuid.uuid4().hex[:8]}"
    dump = Path(f"/tmp/{source}.dump")  # where the cluster's user may write
    pg_cluster.psql(f'CREATE ROLE "{role}" LOGIN')

    def owned_by_role(name: str) -> str:
        pg_cluster.psql(f'CREATE DATABASE "{name}" OWNER "{role}"')  # createdb -O ROLE
        return pg_cluster.dsn(name).replace(f"//{pg_cluster.user}@", f"//{role}@", 1)

    try:
        url = owned_by_role(source)
        with ServerProcess(url, bootstrap) as server:
            made = [server.post(API + "create", TOKENS["alice"], create_body(f"k{i}", i))[1]["reservation"]["id"]
                    for i in range(30)]
        pg_tool(pg_cluster, "pg_dump", "-Fc", "-f", str(dump), source)
        with ServerProcess(url, bootstrap) as server:  # booked after the dump: in the old database only
            assert server.post(API + "create", TOKENS["alice"], create_body("late", 31))[0] == 202
        # as docs/operations.md says: the old database's last event number, where it can still be read
        old_last = int(pg_cluster.psql(LAST_EVENT, source))
        # restored by the superuser without --role: every table is the superuser's, and the replica says what to do
        pg_cluster.createdb(stray)
        pg_tool(pg_cluster, "pg_restore", "--no-owner", "--exit-on-error", "-d", stray, str(dump))
        stray_url = pg_cluster.dsn(stray).replace(f"//{pg_cluster.user}@", f"//{role}@", 1)
        refused = berth("serve", "--listen", "127.0.0.1:0", "--db", stray_url, "--bootstrap", str(bootstrap))
        assert 2 == refused.returncode, refused.stderr
        assert "InsufficientPrivilegeError" in refused.stderr and "--role=" in refused.stderr, refused.stderr
        restored = owned_by_role(target)
        pg_tool(pg_cluster, "pg_restore", "--no-owner", f"--role={role}", "--exit-on-error", "-d", target, str(dump))
        assert int(pg_cluster.psql(LAST_EVENT, target)) < old_last  # the dump's own, before "late"
        with ServerProcess(restored, bootstrap) as server:  # before the setval: a cursor from the old database
            status, doc = server.post(EVENTS, TOKENS["alice"], {"after": old_last})  # is past the dump's numbers
            assert (400, "after", int(pg_cluster.psql(LAST_EVENT, target))) == \
                (status, doc["error"]["details"]["field"], doc["error"]["details"]["newest"]), doc
        pg_cluster.psql(f"SELECT setval(pg_get_serial_sequence('events', 'seq'), {old_last})", target)
        exclusions = "SELECT conname FROM pg_constraint WHERE contype = 'x' ORDER BY 1"
        assert pg_cluster.psql(exclusions, target) == pg_cluster.psql(exclusions, source) != ""
        with ServerProcess(restored, bootstrap) as server:
            for rid in made:
                assert server.post(API + "get", TOKENS["alice"], {"reservationId": rid})[0] == 200
            status, doc = server.post(API + "create", TOKENS["alice"], create_body("after", 40))
            assert status == 202, doc
            status, page = server.post(EVENTS, TOKENS["alice"], {"after": old_last})  # the old cursor: accepted
            assert (200, [doc["reservation"]["id"]]) == (status, sorted({e["reservationId"] for e in page["events"]}))
        seqs = dbrows.rows(restored, "SELECT seq FROM events WHERE reservation_id = ?", doc["reservation"]["id"])
        assert seqs and min(s for (s,) in seqs) > old_last
    finally:
        dump.unlink(missing_ok=True)
        for name in (source, target, stray):
            pg_cluster.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        pg_cluster.psql(f'DROP ROLE IF EXISTS "{role}"')
