"""The SQLite store's schema migrations: a file of schema 1 (operations in their own table) opens as schema 2
with every operation inside its reservation and its old id still answering; a newer file is refused."""
from __future__ import annotations

import json
import sqlite3
import threading

import pytest

from controlplane.store import sqlite as sq
from controlplane.wiring import Config, ConfigError, ControlPlane

SCHEMA_1 = """
CREATE TABLE reservations (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant_id TEXT NOT NULL,
  principal_id TEXT NOT NULL, pool_id TEXT NOT NULL, state TEXT NOT NULL, doc BLOB NOT NULL);
CREATE TABLE operations (id TEXT PRIMARY KEY, reservation_id TEXT NOT NULL, tenant_id TEXT NOT NULL,
  status TEXT NOT NULL, updated_at INTEGER NOT NULL, doc BLOB NOT NULL);
CREATE INDEX operations_by_reservation ON operations (reservation_id);
PRAGMA user_version=1;
"""


def reservation_doc(rid: str, op_id: str) -> dict:
    return {"id": rid, "tenant_id": "acme", "principal_id": "alice", "idempotency_key": "k", "fingerprint": "f",
            "pool_id": "h100", "region": "eu", "state": "placed", "binding": "hold", "gpu_model": "H100_80GB",
            "sharing": "exclusive", "gpu_count": 1, "node_count": 1, "created_at": 1, "updated_at": 1,
            "operation_id": op_id}


def op_doc(op_id: str, rid: str, kind: str, at: int) -> dict:
    return {"id": op_id, "kind": kind, "reservation_id": rid, "tenant_id": "acme", "status": "succeeded",
            "created_at": at, "updated_at": at}


def test_a_schema_1_file_moves_its_operations_into_their_reservations(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA_1)
    rid = "rsv_" + "a" * 26
    conn.execute("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc) VALUES (?, ?, ?, ?, ?, ?)",
                 (rid, "acme", "alice", "h100", "placed", json.dumps(reservation_doc(rid, "op_old_extend"))))
    for op_id, kind, at in (("op_old_extend", "extend", 5), ("op_old_create", "create", 1)):
        conn.execute("INSERT INTO operations VALUES (?, ?, ?, ?, ?, ?)",
                     (op_id, rid, "acme", "succeeded", at, json.dumps(op_doc(op_id, rid, kind, at))))
    conn.commit()
    conn.close()

    store = sq.SqliteStore(str(path))
    try:
        res = store.reservation(rid)
        assert ["create", "extend"] == [op.kind for op in res.operations]
        assert "create" == store.operation("op_old_create").kind  # the old ids still answer
        assert "extend" == res.operation().kind  # the current operation is kept
        assert sq.SCHEMA_VERSION == store.conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "operations" not in tables
    finally:
        store.close()


def test_a_file_of_a_newer_schema_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "new.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={sq.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ConfigError, match="newer than this Berth knows"):
        ControlPlane(Config(db=f"sqlite:///{path}"))


def test_new_operation_ids_name_their_reservation():
    from controlplane.domain.ids import operation_id, operation_parts

    rid = "rsv_" + "b" * 26
    assert (rid, 3) == operation_parts(operation_id(rid, 3))
    for bad in ("op_", "rsv_x", "op_abc", "op_abc_x", "op__1"):
        assert operation_parts(bad) is None


async def test_a_group_whose_rows_cannot_be_written_fails_whole_and_memory_follows_the_database(api):
    """The group's appended rows are written just before its COMMIT: when that fails (here a trigger stands in for
    a full disk), every job of the group answers PROVIDER_UNAVAILABLE, nothing of it is stored, and the writer's
    memory (calendar, quota) is rebuilt from what is."""
    if api.engine == "sqlite":
        conn = sqlite3.connect(api.cp.store.path)
        conn.execute("CREATE TRIGGER refuse_events BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'disk full'); END")
        conn.commit()
        undo = ["DROP TRIGGER refuse_events"]
    else:
        conn = None
        api.rows("CREATE FUNCTION refuse_events() RETURNS trigger LANGUAGE plpgsql AS "
                 "$$ BEGIN RAISE EXCEPTION 'disk full'; END $$")
        api.rows("CREATE TRIGGER refuse_events BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION refuse_events()")
        undo = ["DROP TRIGGER refuse_events ON events", "DROP FUNCTION refuse_events()"]
    read_on: list[int] = []
    if conn is None:  # PostgreSQL: the memory is read off the API's loop, as every whole rebuild there
        writer = api.cp.store.writer
        reset = writer._on_reset
        writer._on_reset = lambda tx: (read_on.append(threading.get_ident()), reset(tx))[1]
    try:
        status, doc = await api.create(key="lost")
        assert (503, "PROVIDER_UNAVAILABLE") == (status, doc["error"]["code"])
        assert api.cp.store.reservation(doc["error"]["details"].get("reservationId") or "none") is None
        assert {} == api.cp.state.calendar.by_reservation and {} == dict(api.cp.state.ledger.usage("acme"))
        if conn is None:
            writer._on_reset = reset
            assert len(read_on) == 1 and read_on[0] != threading.get_ident()
    finally:
        for sql in undo:
            if conn is not None:
                conn.execute(sql)
                conn.commit()
            else:
                api.rows(sql)
        if conn is not None:
            conn.close()
    status, doc = await api.create(key="lost")  # the same key, now it can be written
    assert (202, "placed") == (status, doc["reservation"]["state"])


@pytest.mark.parametrize("state, index", [
    ("active", "reservations_live_by_tenant"), ("pending", "reservations_live_by_tenant"),
    ("released", "reservations_by_tenant"), (None, "reservations_by_tenant")])
def test_a_list_by_a_live_state_searches_the_tenants_live_rows_not_its_history(tmp_path, state, index):
    """`list {state: active}` walked the tenant's whole history back on SQLite (every ended reservation, newest
    first, for the few live ones: 192 ms at 190,000, on the API's loop): a live state now reads its own rows."""
    store = sq.SqliteStore(str(tmp_path / "cp.db"))
    try:
        traced: list[str] = []
        store.conn.set_trace_callback(traced.append)
        for principal in (None, "alice"):
            store.reservations_page("acme", principal, state, None, 10**6 if principal else None, 50)
        store.conn.set_trace_callback(None)
        lists = [sql for sql in traced if sql.startswith("SELECT doc, seq FROM reservations")]
        assert len(lists) == 2
        for sql in lists:
            plan = " ".join(row[-1] for row in store.conn.execute("EXPLAIN QUERY PLAN " + sql))
            assert f"USING INDEX {index} " in plan or (index == "reservations_by_tenant" and "INDEX reservations_by_"
                                                      in plan), (sql, plan)  # (or by its principal)
            assert "TEMP B-TREE" not in plan, plan  # no sort: newest first from the index
    finally:
        store.close()
