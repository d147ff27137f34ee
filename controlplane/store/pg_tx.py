"""A job's view of the PostgreSQL writer's open transaction (port.Tx): each statement one hop to the database's
thread on the writer's connection, the rows a create appends kept for its group's one statement, and a speculative
job's reads answered from what its group read ahead (`Unspeculative` where it asks for more)."""
from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import asyncpg

from common.share import Share
from controlplane.domain.calendar import Booking
from controlplane.domain.model import Reservation
from controlplane.domain.states import TERMINAL
from controlplane.store import codec
from controlplane.store.groups import Appends, JobOutcome
from controlplane.store.pg_sql import (CATALOG_CHANGED_SINCE, CHANGED_SINCE, HELD_RESERVATIONS, LIVE_BOOKINGS,
                                       LIVE_BOOKINGS_OF, LIVE_RESERVATIONS, MOVE_END, TOKENS, BookingRow, EventRow,
                                       PgAppends, ReservationRow)
from controlplane.store.port import CatalogChanges
from controlplane.store.reads import Reads, numbered, reservation_of

if TYPE_CHECKING:
    from controlplane.store.pg_writer import Writer


def _booking(r) -> Booking:
    return Booking(r[0], r[1], r[2], tuple(r[3]), r[4], r[5], Share(r[6], r[7], r[8]))


class Unspeculative(BaseException):
    """A speculative job asked the database for more than its prefetched reads (Writer._speculate): the group is
    run again the ordinary way. A BaseException, so that no job's own error handling keeps it."""


class PgTx(Reads, JobOutcome):
    """The writer's view of the open transaction (port.Tx), each statement on the writer's connection."""

    placeholders = staticmethod(numbered)  # the shared reads' statements (store/reads.py)

    def __init__(self, writer: "Writer", group: Appends, speculative: bool = False):
        super().__init__()
        self.w = writer
        self.speculative = speculative  # no transaction is open: any statement raises Unspeculative
        self.appends = PgAppends()  # this job's rows not yet written (dropped, unwritten, if it fails)
        self.group = group  # earlier jobs' rows not yet written
        self.saved = False  # this job's savepoint is open (at its first write that is not an append)
        self.wrote = False
        self.touched: set[str] = set()  # reservations this job changed (their rows get the group's generation)
        self.stamped: set[str] = set()  # of them, those whose rows this job wrote, with the generation already
        self.catalog_touched = False  # the catalog or tokens: other replicas read the rows changed, the tokens whole

    # statements: each one hop to the database's thread, which first writes the rows appended so far (earlier
    # jobs' before this job's savepoint, this job's inside it), so a job that only appends (a create) costs the
    # one read it makes, and its rows go in the group's one statement at its end.
    def _hop(self, statement: Callable[[asyncpg.Connection], Awaitable[Any]], writes: bool) -> Any:
        if self.speculative:
            raise Unspeculative()
        return self.w.connector.run(self._flushing(statement, writes))

    async def _flushing(self, statement, writes: bool) -> Any:
        conn = self.w.conn
        earlier = self.group.take()
        if earlier:
            await earlier.write(conn)
        mine = self.appends.take()
        if (mine or writes) and not self.saved:
            await conn.execute("SAVEPOINT job")
            self.saved = True
        if mine:
            await mine.write(conn)
        return await statement(conn)

    def _fetchrow(self, sql: str, *args) -> Any:
        return self._hop(lambda c: c.fetchrow(sql, *args), writes=False)

    def _prefetched(self, reservation_id: str) -> Any:
        return self.w.prefetched.get(reservation_id, ...)

    def _touch(self, reservation_id: str) -> None:
        self.touched.add(reservation_id)
        self.w.prefetched.pop(reservation_id, None)  # read back from the database from now on (own writes)
        if self.speculative:
            self.w.unlanded.add(reservation_id)

    def _fetch(self, sql: str, *args) -> list:
        ahead = self.w.read_ahead.get((sql, *args)) if self.w.read_ahead else None
        if ahead is not None:
            return ahead
        return self._hop(lambda c: c.fetch(sql, *args), writes=False)

    def _execute(self, sql: str, *args) -> str:
        self.wrote = True
        return self._hop(lambda c: c.execute(sql, *args), writes=True)

    def _append(self, kind: type, row: Any) -> None:
        self.wrote = True
        self.appends.add(kind, row)

    def flush(self) -> None:
        """Write every appended row now."""
        if self.group or self.appends:
            self._hop(lambda c: asyncio.sleep(0), writes=False)

    # reservations
    def save_reservation(self, res: Reservation) -> None:
        self._touch(res.id)
        self.stamped.add(res.id)
        if res.seq == 0:  # seqs are handed out under the write lock: list order is commit order
            res.seq = self.w.next_seq
            self.w.next_seq += 1
            self._append(ReservationRow, (ReservationRow(res.seq, res.id, res.tenant_id, res.principal_id, res.pool_id,
                                                         res.state, self.w.stamp), codec.encode(res)))
        else:
            self._execute("UPDATE reservations SET state = $1, doc = $2, gen = $4 WHERE id = $3",
                          res.state, codec.encode(res), res.id, self.w.stamp)

    def move_if(self, res: Reservation, expected_state: str) -> bool:
        status = self._execute("UPDATE reservations SET state = $1, doc = $2, gen = $5 WHERE id = $3 AND state = $4",
                               res.state, codec.encode(res), res.id, expected_state, self.w.stamp)
        moved = status == "UPDATE 1"
        if moved:
            self._touch(res.id)
            self.stamped.add(res.id)
        return moved

    # bookings
    def insert_bookings(self, bookings: Iterable[Booking]) -> None:
        for b in bookings:
            self._touch(b.reservation_id)
            self._append(BookingRow, BookingRow(b.reservation_id, b.pool_id, b.node_id, list(b.units), b.start, b.end,
                                                b.share.vcpu_milli, b.share.memory_mib, b.share.hugepages_1g))

    def end_bookings(self, reservation_id: str, at: int) -> None:
        self._touch(reservation_id)
        self.flush()
        self._execute(MOVE_END.format(end="GREATEST(start_ms, LEAST(end_ms, $2::bigint))"), reservation_id, at)

    def set_bookings_end(self, reservation_id: str, end: int) -> None:
        self._touch(reservation_id)
        self.flush()
        self._execute(MOVE_END.format(end="$2::bigint"), reservation_id, end)

    # events, confirmations
    def event(self, tenant_id: str, reservation_id: str | None, type_: str, at: int, data: dict[str, Any]) -> None:
        self._append(EventRow, (EventRow(tenant_id, reservation_id, type_, at), codec.encode(data)))

    def put_confirmation(self, conf) -> None:
        self._execute(
            "INSERT INTO confirmations (id, tenant_id, reservation_id, agent_id, user_id, status, created_at, doc)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
            " ON CONFLICT (id) DO UPDATE SET status = excluded.status, doc = excluded.doc",
            conf.id, conf.tenant_id, conf.reservation_id, conf.agent_id, conf.user_id, conf.status, conf.created_at,
            codec.encode(conf))

    # billing and quotes
    def bill_from(self, res: Reservation, start: int) -> None:
        self._execute(
            "INSERT INTO billing (reservation_id, tenant_id, pool_id, hourly_usd, start_ms, end_ms)"
            " VALUES ($1, $2, $3, $4, $5, NULL) ON CONFLICT (reservation_id) DO NOTHING",
            res.id, res.tenant_id, res.pool_id, Decimal(str(res.hourly_usd)), start)

    def bill_until(self, reservation_id: str, end: int) -> None:
        self._execute("UPDATE billing SET end_ms = $1 WHERE reservation_id = $2 AND end_ms IS NULL", end,
                      reservation_id)

    def put_quote(self, quote_id: str, tenant_id: str, expires_at: int, doc: bytes) -> None:
        self._execute("INSERT INTO quotes (id, tenant_id, expires_at, doc) VALUES ($1, $2, $3, $4)",
                      quote_id, tenant_id, expires_at, doc)
        self._execute("DELETE FROM quotes WHERE expires_at < $1", expires_at - 86_400_000)

    # catalog and tokens
    def put_catalog(self, kind: str, ident: str, doc: bytes) -> None:
        self.catalog_touched = True
        self._execute("INSERT INTO catalog (kind, id, doc) VALUES ($1, $2, $3)"
                      " ON CONFLICT (kind, id) DO UPDATE SET doc = excluded.doc", kind, ident, doc)

    def put_token(self, token_hash: str, kind: str, subject: str) -> None:
        self.catalog_touched = True
        self._execute("INSERT INTO tokens (hash, kind, subject) VALUES ($1, $2, $3) ON CONFLICT (hash)"
                      " DO UPDATE SET kind = excluded.kind, subject = excluded.subject", token_hash, kind, subject)

    def delete_tokens(self, kind: str, subject: str) -> None:
        self.catalog_touched = True
        self._execute("DELETE FROM tokens WHERE kind = $1 AND subject = $2", kind, subject)

    # what the writer's memory is built from
    def live_reservations(self, now: int) -> list[Reservation]:
        self.flush()
        rows = self._fetch(LIVE_RESERVATIONS)
        live = [res for res in (reservation_of(doc, seq) for doc, seq in rows) if res.state not in TERMINAL]
        held = self._fetch(HELD_RESERVATIONS, now)
        return live + [res for res in (reservation_of(doc, seq) for doc, seq in held) if res.hold is not None]

    def live_bookings(self, now: int) -> list[Booking]:
        self.flush()
        return [_booking(r) for r in self._fetch(LIVE_BOOKINGS, now)]

    def changed_since(self, known: int, current: int) -> list[Reservation]:
        """Reservations other replicas' groups changed after generation `known` (up to `current`, the one the lock
        found), oldest first."""
        return [reservation_of(row[0], row[1]) for row in self._fetch(CHANGED_SINCE, known, current)]

    def live_bookings_of(self, reservation_ids: list[str], now: int) -> list[Booking]:
        """live_bookings, of these reservations only."""
        return [_booking(r) for r in self._fetch(LIVE_BOOKINGS_OF, now, tuple(reservation_ids))]

    def catalog_docs(self, kind: str) -> list[bytes]:
        return [r[0] for r in self._fetch("SELECT doc FROM catalog WHERE kind = $1 ORDER BY id", kind)]

    def tokens(self) -> dict[str, tuple[str, str]]:
        return {r[0]: (r[1], r[2]) for r in self._fetch(TOKENS)}

    def catalog_changed_since(self, known: int, current: int) -> CatalogChanges:
        """The catalog's rows groups wrote after generation `known` (up to `current`), and every token."""
        rows = [(r[0], r[1], r[2]) for r in self._fetch(CATALOG_CHANGED_SINCE, known, current)]
        return CatalogChanges(rows, self.tokens())
