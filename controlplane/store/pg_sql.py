"""The PostgreSQL writer's statements (store/pg_writer.py), and the rows a group appends in one of them
(`PgAppends`): each statement's text, with why it is shaped so beside it."""
from __future__ import annotations

import asyncpg
import msgspec

from controlplane.store.groups import Appends


WRITE_LOCK = 0x62657274_0002  # "bert" and 2: the advisory lock every replica's writer takes per group

# The writer's statements look rows up by key and append: planned once per connection, and never as a sequential
# scan, whatever the statistics said when the plan was made (a plan cached while a table was nearly empty would
# otherwise stay a sequential scan as the table grows). Planning each run cost PostgreSQL about a third of its
# CPU per create (pg_stat_statements). Rebuilding the memory whole reads whole tables: its transaction plans each
# statement as usual (WHOLE_READS).
WRITER_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off"}
WHOLE_READS = "SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL enable_seqscan = on"


LOCKED = f"BEGIN; SELECT pg_advisory_xact_lock({WRITE_LOCK:d})"  # a group's transaction and lock: one round trip
# What a group reads once it holds the lock: the generations and the next seq (the row without an id), and the
# reservations its jobs read.
BEGUN = ("SELECT generation, catalog_generation, (SELECT COALESCE(MAX(seq), 0) FROM reservations), NULL, NULL::bytea,"
         " rebuild_generation FROM replica_state WHERE id = 1"
         " UNION ALL SELECT NULL, NULL, NULL, id, doc, seq FROM reservations WHERE id = ANY($1::text[])")
# A booking's devices (from `ab`, the booking's RETURNING, and `u`, a device): each with its key, looked up here
# (the schema's trigger keys a device that has none yet).
INSERT_UNITS = (
    "INSERT INTO booked_units (booking_id, node_id, unit, unit_id, during)"
    " SELECT ab.id, ab.node_id, u, (SELECT k.id FROM unit_keys k WHERE k.node_id = ab.node_id AND k.unit = u),"
    " int8range(ab.start_ms, ab.end_ms)")
# One booking with its devices (controlplane/store/move.py copies bookings with it).
INSERT_BOOKING = (
    "WITH ab AS (INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
    " memory_mib, hugepages_1g) VALUES ($1, $2, $3, $4::text[], $5, $6, $7, $8, $9)"
    " RETURNING id, node_id, start_ms, end_ms)"
    f" {INSERT_UNITS} FROM ab, unnest($4::text[]) AS u")


# The rows a job appends, as a group's statement reads them: each kind's columns a JSON array of objects
# (json_to_recordset), and the documents (a reservation's, an event's data: any text, \u0000 included, which a
# JSON parameter cannot carry into PostgreSQL) beside it as bytes, zipped back by ROWS FROM. Column arrays cost
# asyncpg two type checks per value; this, two per document.
class ReservationRow(msgspec.Struct):
    seq: int
    id: str
    tenant_id: str
    principal_id: str
    pool_id: str
    state: str
    gen: int


class BookingRow(msgspec.Struct):
    reservation_id: str
    pool_id: str
    node_id: str
    units: list[str]
    start_ms: int
    end_ms: int
    vcpu_milli: int
    memory_mib: int
    hugepages_1g: int


class EventRow(msgspec.Struct):
    tenant_id: str
    reservation_id: str | None
    type: str
    at: int


class Span(msgspec.Struct):
    """Where a row's document lies in a group's blob (PgAppends.parameters): from byte o (1-based), l bytes."""
    o: int
    l: int  # noqa: E741 - the column's name in the statement


_ROWS = msgspec.json.Encoder()


def _appended(first: int, only_if: str = "") -> str:
    """Every appended row in one statement, as CTEs over the parameters PgAppends.parameters() gives (from $first
    on): the database plans and runs each insert once for the group, where an executemany runs it per row.
    only_if: a condition every insert waits for and needs (SPECULATED's compare-and-set: evaluated once, before
    any row, so events take their seq under the lock)."""
    rows, spans, bookings, event_rows, event_spans, blob = (f"${first + i}" for i in range(6))
    where = f" WHERE {only_if}" if only_if else ""
    spans_end = f"(o int4, l int4)) AS x{where})"  # the spans' columns, then the ends of ROWS FROM and of the CTE
    return (
        "ar AS (INSERT INTO reservations (seq, id, tenant_id, principal_id, pool_id, state, gen, doc)"
        f" SELECT x.seq, x.id, x.tenant_id, x.principal_id, x.pool_id, x.state, x.gen,"
        f" substring({blob}::bytea FROM x.o FOR x.l) FROM ROWS FROM (json_to_recordset({rows}::json) AS (seq int8,"
        f" id text, tenant_id text, principal_id text, pool_id text, state text, gen int8),"
        f" json_to_recordset({spans}::json) AS {spans_end},"
        " ab AS (INSERT INTO bookings (reservation_id, pool_id, node_id, units, start_ms, end_ms, vcpu_milli,"
        " memory_mib, hugepages_1g) SELECT b.reservation_id, b.pool_id, b.node_id,"
        " ARRAY(SELECT json_array_elements_text(b.units)), b.start_ms, b.end_ms, b.vcpu_milli, b.memory_mib,"
        f" b.hugepages_1g FROM json_to_recordset({bookings}::json) AS b (reservation_id text, pool_id text,"
        f" node_id text, units json, start_ms int8, end_ms int8, vcpu_milli int8, memory_mib int8, hugepages_1g int8)"
        f"{where} RETURNING id, node_id, units, start_ms, end_ms),"
        f" au AS ({INSERT_UNITS} FROM ab, unnest(ab.units) AS u),"
        " ae AS (INSERT INTO events (tenant_id, reservation_id, type, at, data)"
        f" SELECT x.tenant_id, x.reservation_id, x.type, x.at, substring({blob}::bytea FROM x.o FOR x.l)"
        f" FROM ROWS FROM (json_to_recordset({event_rows}::json) AS (tenant_id text, reservation_id text, type text,"
        f" at int8), json_to_recordset({event_spans}::json) AS {spans_end}")


APPENDED = f"WITH {_appended(1)} SELECT 1"
# A group's last statement: its appended rows, the group's generation, the reservations whose bookings alone it
# changed stamped with it (rows it wrote carry the stamp already), and the NOTIFY; then only COMMIT.
COMMIT_GROUP = (
    "WITH g AS (UPDATE replica_state SET generation = generation + 1, catalog_generation = CASE WHEN $1"
    " THEN generation + 1 ELSE catalog_generation END WHERE id = 1 RETURNING generation),"
    " st AS (UPDATE reservations SET gen = (SELECT generation FROM g) WHERE id = ANY($2::text[])),"
    f" n AS (SELECT pg_notify('berth_changes', generation::text) FROM g), {_appended(3)}"
    " SELECT g.generation FROM g, (SELECT count(*) FROM n) AS notified")
# A speculative group's whole commit (Writer._speculate), one statement outside any transaction: it moves the
# generation from the one its jobs were run on ($1), taking the write lock first (a group holding it is waited for),
# and writes the rows only if the generation was still that one; otherwise nothing, and no row comes back.
SPECULATED = (
    f"WITH g AS (UPDATE replica_state SET generation = generation + 1 WHERE id = 1 AND generation = $1"
    f" AND pg_advisory_xact_lock({WRITE_LOCK:d}) IS NOT NULL RETURNING generation),"
    " st AS (UPDATE reservations SET gen = (SELECT generation FROM g) WHERE id = ANY($2::text[])"
    " AND EXISTS (SELECT FROM g)),"
    f" n AS (SELECT pg_notify('berth_changes', generation::text) FROM g), {_appended(3, 'EXISTS (SELECT FROM g)')}"
    " SELECT g.generation FROM g, (SELECT count(*) FROM n) AS notified")
# What other replicas changed since the memory's generation. Both bounds: the writer's cached plan is made
# without the values, and an open range estimated at a third of the table becomes, past some 100,000
# reservations, a scan of all of them in seq order; a closed one is estimated small, and read by `gen`.
CHANGED_SINCE = "SELECT doc, seq, id FROM reservations WHERE gen > $1 AND gen <= $2 ORDER BY seq"
CATALOG_CHANGED_SINCE = "SELECT kind, id, doc FROM catalog WHERE gen > $1 AND gen <= $2 ORDER BY kind, id"
TOKENS = "SELECT hash, kind, subject FROM tokens"
# What the writer's memory is rebuilt from besides the bookings: live reservations (by their partial index), and the
# released ones still booked at $1 (found from their bookings: tests/controlplane/test_rebuild.py checks the plans).
LIVE_RESERVATIONS = "SELECT doc, seq FROM reservations WHERE state NOT IN ('released', 'cancelled') ORDER BY seq"
HELD_RESERVATIONS = ("SELECT r.doc, r.seq FROM reservations r WHERE r.state = 'released' AND EXISTS (SELECT 1 FROM"
                     " bookings b WHERE b.reservation_id = r.id AND b.end_ms > $1) ORDER BY r.seq")
# The bookings that still block someone at $1: of live reservations, and a released one's turnaround (the two
# halves of `bookings b JOIN reservations r`'s condition, at the parameter `now`), of only $2's reservations
# (bringing the memory up to other replicas' writes) or of every reservation (rebuilding it). The whole read takes
# the halves apart: as one OR, PostgreSQL joins every booking ever made to its reservation (1 s at a million);
# apart, it reads live reservations by their index and only the released ones' bookings that end after $1.
_LIVE_HALVES = ("r.state IN ('placed', 'binding', 'active')", "r.state = 'released' AND b.end_ms > {now}")
_LIVE = f"(({_LIVE_HALVES[0]}) OR ({_LIVE_HALVES[1]})) AND b.end_ms > b.start_ms"
_BOOKING = ("b.reservation_id, b.pool_id, b.node_id, b.units, b.start_ms, b.end_ms, b.vcpu_milli, b.memory_mib,"
            " b.hugepages_1g")
_JOINED = " FROM bookings b JOIN reservations r ON r.id = b.reservation_id WHERE "
LIVE_BOOKINGS_OF = (f"SELECT {_BOOKING}{_JOINED}{_LIVE.format(now='$1')} AND b.reservation_id = ANY($2::text[])"
                    " ORDER BY b.id")
LIVE_BOOKINGS = " UNION ALL ".join(f"SELECT {_BOOKING}, b.id{_JOINED}{half.format(now='$1')} AND b.end_ms > b.start_ms"
                                   for half in _LIVE_HALVES) + " ORDER BY id"
# What a refresh reads, in one statement (one snapshot, one round trip), each row tagged with its kind: 0 the state
# row (as BEGUN's: generation, catalog generation, rebuild generation, last seq), 1 the reservations changed after
# $1 up to that generation (CHANGED_SINCE), 2 their bookings live at $2 (LIVE_BOOKINGS_OF), and where the catalog
# changed, 3 its rows changed (CATALOG_CHANGED_SINCE) and 4 every token (TOKENS). Columns: kind, order, five
# integers, three texts, an array of texts, a document (Writer._read_changes reshapes each kind's rows).
CHANGES = (
    "WITH s AS (SELECT generation, catalog_generation, rebuild_generation,"
    " (SELECT COALESCE(MAX(seq), 0) FROM reservations) AS last FROM replica_state WHERE id = 1),"
    " c AS (SELECT doc, seq, id FROM reservations WHERE gen > $1 AND gen <= (SELECT generation FROM s))"
    " SELECT 0, 0::bigint, generation, catalog_generation, rebuild_generation, last, NULL::bigint, NULL::text,"
    " NULL::text, NULL::text, NULL::text[], NULL::bytea FROM s"
    " UNION ALL SELECT 1, seq, seq, NULL, NULL, NULL, NULL, id, NULL, NULL, NULL, doc FROM c"
    " UNION ALL SELECT 2, b.id, b.start_ms, b.end_ms, b.vcpu_milli, b.memory_mib, b.hugepages_1g, b.reservation_id,"
    " b.pool_id, b.node_id, b.units, NULL FROM bookings b JOIN reservations r ON r.id = b.reservation_id"
    f" WHERE b.reservation_id IN (SELECT id FROM c) AND {_LIVE.format(now='$2')}"
    " UNION ALL SELECT 3, 0, NULL, NULL, NULL, NULL, NULL, kind, id, NULL, NULL, doc FROM catalog"
    " WHERE gen > $1 AND gen <= (SELECT generation FROM s)"
    " UNION ALL SELECT 4, 0, NULL, NULL, NULL, NULL, NULL, hash, kind, subject, NULL, NULL FROM tokens"
    " WHERE (SELECT catalog_generation FROM s) > $1"
    " ORDER BY 1, 2, 8, 9")


# A booking's end moves with its devices' ranges, in one statement (the exclusion constraint checks the new ranges).
# Of live bookings only: one ended where it started (a reservation moved off a node before its start) stays so
MOVE_END = (
    "WITH b AS (UPDATE bookings SET end_ms = {end} WHERE reservation_id = $1 AND end_ms > start_ms"
    " RETURNING id, start_ms, end_ms)"
    " UPDATE booked_units u SET during = int8range(b.start_ms, b.end_ms) FROM b WHERE u.booking_id = b.id")


class PgAppends(Appends):
    """Appends written through the asyncpg connection, all in one statement (APPENDED, or COMMIT_GROUP's), filed
    by their row's class: a BookingRow, or a ReservationRow or EventRow with its document's bytes."""

    __slots__ = ()

    def parameters(self) -> list:
        """The rows as APPENDED's six parameters: reservations and where each one's document lies in the blob,
        bookings, events and where each one's data lies, and the blob (every document and data, one after another).
        One bytea rather than an array of them: asyncpg checks each element of an array parameter in Python."""
        grouped = self.by_kind()
        assert set(grouped) <= {ReservationRow, BookingRow, EventRow}, set(grouped)
        reservations, events = grouped.get(ReservationRow, []), grouped.get(EventRow, [])
        docs = [doc for _, doc in reservations] + [data for _, data in events]
        spans, at = [], 1  # (substring counts from 1)
        for doc in docs:
            spans.append(Span(at, len(doc)))
            at += len(doc)
        split = len(reservations)
        return [_ROWS.encode([row for row, _ in reservations]).decode(), _ROWS.encode(spans[:split]).decode(),
                _ROWS.encode(grouped.get(BookingRow, [])).decode(),
                _ROWS.encode([row for row, _ in events]).decode(), _ROWS.encode(spans[split:]).decode(),
                b"".join(docs)]

    async def write(self, conn: asyncpg.Connection) -> None:
        await conn.execute(APPENDED, *self.parameters())
