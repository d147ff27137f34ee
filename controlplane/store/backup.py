"""`berth controlplane backup` and `restore`: a consistent copy of a control plane's SQLite database, taken while
it serves, and that copy put back in its place.

SQLite's online backup copies the database as one read transaction sees it. The file is in WAL mode, so the
control plane's writer goes on meanwhile; what it commits after that snapshot is not in the copy. The copy is
written beside the target under a temporary name, switched to a single file (no -wal beside it), checked with
`PRAGMA integrity_check`, flushed to disk and renamed into place, so the target's name never holds half a copy.
The source is only read: not migrated, not checkpointed.

A restore refuses while any process has the database open (the control plane must be stopped). It keeps the
database it replaces, with its -wal and -shm, under a dated name, and carries that database's highest event and
reservation numbers into the restored one, so that events and reservations made from then on are numbered after
every one a client may have seen before the restore: an events cursor from before it skips nothing new.

PostgreSQL has tools of its own for both (pg_dump and pg_restore, or the base backups and WAL archive an HA
cluster keeps): docs/operations.md, "Backups".
"""
from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from controlplane.store import sqlite


class Refused(Exception):
    """Nothing was copied and nothing changed: a path, or what the source holds. The message says what to do."""


class Failed(Exception):
    """The copy did not complete; no file was left under the target's name."""


@dataclass(frozen=True)
class Copied:
    source: str
    target: str
    size_bytes: int
    schema_version: int
    reservations: int
    last_event_seq: int  # the highest event in the copy: what a tenant's cursor can have seen of it
    seconds: float

    def summary(self) -> str:
        return (f"backed up {self.source} to {self.target}: {self.size_bytes / (1 << 20):.1f} MiB, schema "
                f"{self.schema_version}, {self.reservations} reservations, events up to seq {self.last_event_seq}, "
                f"in {self.seconds:.1f} s")


def backup(source: str, target: str, replace: bool = False) -> Copied:
    """Copy the SQLite database at `source` to the file `target` (see the module's docstring)."""
    began = time.monotonic()
    src_path, dst_path = Path(source), Path(target)
    if not target or dst_path.is_dir():
        raise Refused(f"--to {target or repr(target)}: give the copy's file name, for example "
                      f"{dst_path / 'controlplane-copy.db' if target else '/var/backups/berth/controlplane.db'}")
    if src_path.is_dir():
        raise Refused(f"--db sqlite:///{source}: that is a directory; give the database file the control plane "
                      "serves (its --db, or BERTH_DB in its unit's environment)")
    if not src_path.is_file():
        raise Refused(f"--db sqlite:///{source}: no such file; give the database the control plane serves "
                      "(its --db, or BERTH_DB in its unit's environment)")
    if not dst_path.parent.is_dir():
        raise Refused(f"--to {target}: the directory {dst_path.parent} does not exist; make it first")
    if dst_path.exists():
        if dst_path.resolve() == src_path.resolve():
            raise Refused(f"--to {target}: that is the database itself; give another file")
        if not replace:
            raise Refused(f"--to {target}: the file exists; give a new name, or --replace to overwrite it")
    src, version = _open_berth_file(src_path, f"--db sqlite:///{source}")
    try:
        copied = _write_in_place(src, dst_path, f"the copy to {target} failed")
    finally:
        src.close()
    return Copied(source, target, dst_path.stat().st_size, version, copied.reservations, copied.last_event_seq,
                  time.monotonic() - began)


def _open_berth_file(path: Path, option: str) -> tuple[sqlite3.Connection, int]:
    """A read-only connection to the Berth database at `path`, and its schema version; Refused, naming `option`,
    where it is not one."""
    conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None, timeout=30)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise Refused(f"{option}: cannot read it as a SQLite database ({exc})") from None
    if version == 0:  # every Berth file has a version (store/sqlite.migrate)
        conn.close()
        raise Refused(f"{option}: not a Berth control-plane database (no Berth schema in it)")
    return conn, version


@dataclass(frozen=True)
class _Written:
    reservations: int
    last_event_seq: int
    next_event_seq: int


def _write_in_place(src: sqlite3.Connection, target: Path, failed: str, floors: dict[str, int] | None = None,
                    like: Path | None = None) -> _Written:
    """`src` written to `target` whole or not at all: under a temporary name beside it, then renamed (the
    directory's entry flushed too). The copy takes the owner and mode of the file `like`, or else the directory's
    owner. Failed (its message `failed`, then the error) leaves no file under either name."""
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        written = _copy(src, partial, floors or {})
        owner = like.stat() if like else target.parent.stat()  # the control plane's user must open it
        os.chown(partial, owner.st_uid, owner.st_gid)
        if like:
            os.chmod(partial, owner.st_mode & 0o7777)
        os.replace(partial, target)
    except (sqlite3.Error, OSError) as exc:
        for leftover in (partial, partial.with_name(partial.name + "-journal")):
            leftover.unlink(missing_ok=True)
        raise Failed(f"{failed} ({exc}); nothing was written under that name") from None
    _sync_directory(target.parent)
    return written


def _copy(src: sqlite3.Connection, partial: Path, floors: dict[str, int]) -> _Written:
    """The whole database in one backup step (one read snapshot), made a single checked file on disk, its tables'
    next numbers raised to at least `floors` (sqlite_sequence: table -> the highest number given out)."""
    partial.unlink(missing_ok=True)
    dst = sqlite3.connect(partial, isolation_level=None)
    try:
        src.backup(dst)  # pages=-1: one step, so one snapshot, whatever the writer commits meanwhile
        dst.execute("PRAGMA journal_mode=DELETE")  # one file; the control plane sets WAL again when it opens it
        for table, seq in floors.items():
            dst.execute("INSERT INTO sqlite_sequence (name, seq) SELECT ?, 0 WHERE NOT EXISTS "
                        "(SELECT 1 FROM sqlite_sequence WHERE name = ?)", (table, table))
            dst.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = ?", (seq, table))
        problems = [row[0] for row in dst.execute("PRAGMA integrity_check")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("integrity check of the copy: " + "; ".join(problems[:5]))
        written = _Written(
            dst.execute("SELECT count(*) FROM reservations").fetchone()[0],
            dst.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0],
            sqlite.events_numbered(dst) + 1)
    finally:
        dst.close()
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _sync_directory(path: Path) -> None:
    """The rename made durable: the directory's entry flushed too."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Restored:
    copy: str
    database: str
    kept: str | None  # where the database it replaced now lies
    reservations: int
    last_event_seq: int  # in the copy
    events_from: int  # the seq the next event takes

    def summary(self) -> str:
        kept = f"; the database it replaced is kept as {self.kept}" if self.kept else ""
        return (f"restored {self.copy} to {self.database}: {self.reservations} reservations, events up to seq "
                f"{self.last_event_seq}, new events from seq {self.events_from}{kept}")


def restore(copy: str, database: str, known_schema: int) -> Restored:
    """Put the copy `copy` (made by `backup`) in the place of the SQLite database `database`, which no process may
    have open; `known_schema` is the newest schema this Berth reads (a newer copy is refused)."""
    copy_path, db_path = Path(copy), Path(database)
    for option, path, what in (("--from", copy_path, "the copy's file"), ("--db sqlite:///", db_path,
                                                                          "the database file's path")):
        if path.is_dir():
            raise Refused(f"{option}{'' if option.endswith('/') else ' '}{path}: that is a directory; give {what}")
    if not copy_path.is_file():
        raise Refused(f"--from {copy}: no such file; give a copy `berth controlplane backup` wrote")
    if not db_path.parent.is_dir():
        raise Refused(f"--db sqlite:///{database}: the directory {db_path.parent} does not exist; make it first")
    if db_path.exists() and db_path.resolve() == copy_path.resolve():
        raise Refused(f"--from {copy}: that is the database itself; give the copy `berth controlplane backup` wrote")
    src, version = _open_berth_file(copy_path, f"--from {copy}")
    try:
        if version > known_schema:
            raise Refused(f"--from {copy}: schema version {version}, newer than this Berth knows ({known_schema}): "
                          "restore it with the Berth release that wrote it, or a newer one")
        before = _retire(db_path) if db_path.exists() else None
        try:
            copied = _write_in_place(src, db_path, f"the restore to {database} failed",
                                     floors=before[1] if before else {}, like=before[0] if before else None)
        except Failed as exc:
            if before:
                _move_with_wal(before[0], db_path)
            raise Failed(f"{exc}; the database is as it was" if before else str(exc)) from None
    finally:
        src.close()
    return Restored(copy, database, str(before[0]) if before else None, copied.reservations, copied.last_event_seq,
                    copied.next_event_seq)


def _retire(db_path: Path) -> tuple[Path, dict[str, int]]:
    """The database about to be replaced, made one whole file (its WAL checkpointed in) and moved aside with its
    -wal and -shm under a dated name; where it went, and its highest numbers (sqlite_sequence). Refused while
    any process has it open: in exclusive locking mode a write lock is granted only when no other connection
    holds the file, idle or not."""
    conn = sqlite3.connect(db_path, isolation_level=None, timeout=0)
    try:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        try:
            conn.execute("BEGIN EXCLUSIVE")
            conn.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise Refused(f"--db sqlite:///{db_path}: a process has the database open (a control plane "
                              "serving it?); stop it first (systemctl stop berth-controlplane), then restore") from None
            raise Refused(f"--db sqlite:///{db_path}: cannot open it ({exc})") from None
        except sqlite3.DatabaseError as exc:
            raise Refused(f"--db sqlite:///{db_path}: cannot read it as a SQLite database ({exc}); move it away "
                          "and restore again") from None
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            has_sequence = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone()
            floors = dict(conn.execute("SELECT name, seq FROM sqlite_sequence")) if has_sequence else {}
        except sqlite3.Error as exc:  # nothing moved yet
            raise Refused(f"--db sqlite:///{db_path}: cannot fold its WAL into it before moving it aside ({exc}); "
                          "the database is as it was") from None
    finally:
        conn.close()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kept = db_path.with_name(f"{db_path.name}.replaced-{stamp}")
    n = 1
    while kept.exists():  # a second restore within the second keeps the first one's too
        n += 1
        kept = db_path.with_name(f"{db_path.name}.replaced-{stamp}-{n}")
    _move_with_wal(db_path, kept)
    return kept, floors


def _move_with_wal(source: Path, target: Path) -> None:
    """A database renamed with its -wal and -shm, the database itself last (a crash midway leaves it where it
    was)."""
    for suffix in ("-wal", "-shm", ""):
        part = source.with_name(source.name + suffix)
        if part.exists():
            os.replace(part, target.with_name(target.name + suffix))
