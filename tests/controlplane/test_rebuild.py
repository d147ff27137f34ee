"""The writer's memory rebuilt whole (ControlPlane._load) with the cyclic garbage collector paused: every object
a rebuild makes is kept, and with the collector's default thresholds (at start) rescanning the growing heap
doubled a rebuild's time. The collector is back as it was after, also when the rebuild fails. In the server's
process (Config.freeze_memory) what a rebuild made is frozen out of the collector's reach after, so the first young
collection does not scan all of it at once; not what a failed one made."""
from __future__ import annotations

import dataclasses
import gc
import sqlite3

import pytest

from controlplane import wiring
from controlplane.state import WriterState


async def test_the_memory_is_rebuilt_with_the_collector_paused_and_the_collector_is_back_after(api, monkeypatch):
    cp = api.cp
    seen, rebuild = [], WriterState.rebuild

    def watched(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return rebuild(self, *args, **kwargs)

    monkeypatch.setattr(WriterState, "rebuild", watched)
    assert gc.isenabled()
    await cp.store.call(cp._load)
    assert seen == [False] and gc.isenabled()


def test_the_collector_comes_back_after_a_failed_rebuild_and_one_that_was_off_stays_off():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with wiring.collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("the database went away mid-read")
    assert gc.isenabled()
    gc.disable()
    try:
        with wiring.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_in_the_servers_process_what_a_rebuild_made_is_frozen_out_of_the_collectors_reach(api, monkeypatch):
    cp = api.cp
    for key in ("a", "b", "c"):
        assert (await api.create(key=key))[0] == 202
    frozen = gc.get_freeze_count()
    await cp.store.call(cp._load)
    assert gc.get_freeze_count() == frozen  # (a process of many control planes, as the tests': off)
    monkeypatch.setattr(cp, "config", dataclasses.replace(cp.config, freeze_memory=True))
    try:
        await cp.store.call(cp._load)
        assert len(cp.state.calendar.by_reservation) == 3 and gc.get_freeze_count() > frozen
        young = gc.get_count()[0]
        assert young < 1000, young  # (what the rebuild made is not waiting for the first young collection)
    finally:
        gc.unfreeze()


def test_what_a_failed_rebuild_made_is_not_frozen():
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError):
        with wiring.collector_paused(freeze=True):
            made = [[i] for i in range(1000)]  # noqa: F841 - what a rebuild makes
            raise RuntimeError("the database went away mid-read")
    assert gc.get_freeze_count() == frozen


# -- what a rebuild reads: what is live, never the whole history ---------------------------------------------------

NOW = 10_000_000

# (id, state, bookings as (start, end)), and which bookings a rebuild at NOW keeps (indexes into each one's list)
ROWS = [
    ("r-active", "active", [(0, 5_000_000), (5_000_000, 20_000_000)], [0, 1]),  # a live one's ended booking too
    ("r-placed", "placed", [(20_000_000, 30_000_000)], [0]),
    ("r-binding", "binding", [(9_000_000, 12_000_000), (12_000_000, 12_000_000)], [0]),  # not an empty window
    ("r-turnaround", "released", [(0, 11_000_000)], [0]),  # released, its booking still runs
    ("r-ended", "released", [(0, 9_000_000)], []),
    ("r-cancelled", "cancelled", [(20_000_000, 30_000_000)], []),
    ("r-pending", "pending", [(20_000_000, 30_000_000)], []),
]


def _insert_history(api, rows, ended: int = 0) -> None:
    """Reservation and booking rows as the store keeps them (their documents are never decoded here), and `ended`
    released reservations whose bookings ended long ago; committed, whichever the engine."""
    if api.engine == "postgresql":
        for rid, state, bookings, _ in rows:
            api.rows("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc)"
                     " VALUES (?, 'acme', 'alice', 'h100', ?, ?)", rid, state, b"{}")
            for start, end in bookings:
                api.rows("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
                         " memory_mib, hugepages_1g) VALUES (?, 'h100', 'h1', ?, ?, ?, 0, 0, 0)", rid, ["g0"], start, end)
        if ended:
            api.rows("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc) SELECT 'old-' || i,"
                     f" 'acme', 'alice', 'h100', 'released', '\\x00' FROM generate_series(1, {ended}) i")
            api.rows("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
                     " memory_mib, hugepages_1g) SELECT 'old-' || i, 'h100', 'h1', '{g0}', i, i + 1, 0, 0, 0"
                     f" FROM generate_series(1, {ended}) i")
            api.rows("ANALYZE")
        return
    conn = sqlite3.connect(api.cp.config.db.removeprefix("sqlite:///"))
    try:
        with conn:
            for rid, state, bookings, _ in rows:
                conn.execute("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc)"
                             " VALUES (?, 'acme', 'alice', 'h100', ?, x'7b7d')", (rid, state))
                conn.executemany("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms,"
                                 " vcpu_milli, memory_mib, hugepages_1g) VALUES (?, 'h100', 'h1', 'g0', ?, ?, 0, 0, 0)",
                                 [(rid, start, end) for start, end in bookings])
            conn.executemany("INSERT INTO reservations (id, tenant_id, principal_id, pool_id, state, doc)"
                             " VALUES (?, 'acme', 'alice', 'h100', 'released', x'00')",
                             [(f"old-{i}",) for i in range(ended)])
            conn.executemany("INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms,"
                             " vcpu_milli, memory_mib, hugepages_1g) VALUES (?, 'h100', 'h1', 'g0', ?, ?, 0, 0, 0)",
                             [(f"old-{i}", i, i + 1) for i in range(ended)])
    finally:
        conn.close()


async def test_a_rebuild_keeps_the_bookings_of_live_reservations_and_of_released_ones_still_running(api):
    _insert_history(api, ROWS)
    got = await api.cp.store.call(lambda tx: tx.live_bookings(NOW))
    wanted = [(rid, bookings[i]) for rid, _, bookings, kept in ROWS for i in kept]
    ours = [(b.reservation_id, (b.start, b.end)) for b in got if not b.reservation_id.startswith("rsv_")]
    assert ours == wanted  # in the order they were booked


def _plan(api, sql: str, *args) -> str:
    explain = "EXPLAIN QUERY PLAN " if api.engine == "sqlite" else "EXPLAIN "
    column = 3 if api.engine == "sqlite" else 0
    return "\n".join(str(row[column]) for row in api.rows(explain + sql, *args))


async def test_a_rebuild_reads_no_reservation_of_the_history_that_ended(api):
    """Every reservation ever made stays in the database; a rebuild (at start) reads the live ones by their index
    and the released ones still booked from their bookings, so a start does not grow with the history (at a million
    ended reservations the whole-table plans took 2 s on PostgreSQL and 2-6 s on SQLite)."""
    from controlplane.store import pg_sql, sqlite as sqlite_store
    _insert_history(api, [], ended=20_000 if api.engine == "postgresql" else 0)
    sql = pg_sql if api.engine == "postgresql" else sqlite_store
    for name in ("LIVE_RESERVATIONS", "HELD_RESERVATIONS", "LIVE_BOOKINGS"):
        statement = getattr(sql, name)
        if api.engine == "postgresql":
            plan = _plan(api, statement.replace("$1", str(NOW)))
            assert "Seq Scan on reservations" not in plan, f"{name} reads every reservation:\n{plan}"
        else:
            plan = _plan(api, statement, *([NOW] if "?" in statement else []))
            whole = [line for line in plan.splitlines() if line in ("SCAN reservations", "SCAN r")]
            assert not whole, f"{name} reads every reservation:\n{plan}"
