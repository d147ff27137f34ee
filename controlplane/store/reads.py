"""The reads both engines make, each statement written once: by key (`Reads`, which a writer's transaction and
the store share) and of committed data for answers (`CommittedReads`). Statements use `?` placeholders; an
engine says how it numbers them (`placeholders`: PostgreSQL's `$1, $2, ...`) and runs them with its own driver
(`_fetchrow`, `_fetch`). What only one engine reads stays in its module (store/sqlite.py, store/postgres.py)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

from controlplane.domain.errors import invalid
from controlplane.domain.ids import operation_parts
from controlplane.domain.model import Confirmation, Operation, Reservation
from controlplane.domain.states import TERMINAL
from controlplane.store import codec

# The live reservations' partial indexes' condition (store/sqlite.py, store/pg_schema.py), written the same way in a
# query that is to use them
LIVE = "state NOT IN ('released', 'cancelled')"


@lru_cache(maxsize=256)
def numbered(sql: str) -> str:
    """`?` placeholders as PostgreSQL's `$1, $2, ...` (the statements here hold no `?` of their own)."""
    parts = sql.split("?")
    return parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))


def as_is(sql: str) -> str:
    return sql


STATE_COUNTS = "SELECT pool_id, state, COUNT(*) FROM reservations GROUP BY pool_id, state ORDER BY pool_id, state"


def reservation_of(doc: bytes, seq: int) -> Reservation:
    res = codec.decode_reservation(doc)
    res.seq = seq
    return res


class Reads:
    """Reads by key (port.Reads). On a writer's transaction they see its own writes; on a store, committed data."""

    __slots__ = ()
    placeholders: Callable[[str], str] = staticmethod(as_is)

    def _fetchrow(self, sql: str, *args) -> Any:
        """The first row of one statement, or None (sql already in this engine's placeholders)."""
        raise NotImplementedError

    def _fetch(self, sql: str, *args) -> list:
        raise NotImplementedError

    def _row(self, sql: str, *args) -> Any:
        return self._fetchrow(self.placeholders(sql), *args)

    def _rows(self, sql: str, *args) -> list:
        return self._fetch(self.placeholders(sql), *args)

    def _prefetched(self, reservation_id: str) -> Any:
        """(doc, seq), None (no such reservation) or ... (not known: ask the database)."""
        return ...

    def reservation(self, reservation_id: str) -> Reservation | None:
        row = self._prefetched(reservation_id)
        if row is ...:
            row = self._row("SELECT doc, seq FROM reservations WHERE id = ?", reservation_id)
        return reservation_of(row[0], row[1]) if row else None

    def operation(self, op_id: str) -> Operation | None:
        """An operation lives in its reservation's document; its id names the reservation (ids.operation_parts)."""
        parts = operation_parts(op_id)
        rid = parts[0] if parts else None
        if rid is None or self.reservation(rid) is None:  # an id from SQLite's schema 1, kept by its migration
            row = self._row("SELECT reservation_id FROM operation_aliases WHERE id = ?", op_id)
            rid = row[0] if row else None
        res = self.reservation(rid) if rid else None
        return res.operation(op_id) if res else None

    def confirmation(self, conf_id: str) -> Confirmation | None:
        row = self._row("SELECT doc FROM confirmations WHERE id = ?", conf_id)
        return codec.decode_confirmation(row[0]) if row else None

    def quote(self, quote_id: str) -> tuple[str, int, bytes] | None:
        row = self._row("SELECT tenant_id, expires_at, doc FROM quotes WHERE id = ?", quote_id)
        return (row[0], row[1], row[2]) if row else None


class CommittedReads(Reads):
    """The store's reads of committed data for answers (lists, events, confirmations, billing, metrics)."""

    __slots__ = ()

    def reservations_page(self, tenant_id: str, principal_id: str | None, state: str | None, pool_id: str | None,
                          before_seq: int | None, limit: int) -> list[Reservation]:
        """The tenant's public reservations, newest first, below `before_seq`."""
        sql = ["SELECT doc, seq FROM reservations WHERE tenant_id = ? AND state NOT IN ('draft', 'awaiting-confirmation')"]
        args: list[Any] = [tenant_id]
        for column, value in (("principal_id", principal_id), ("state", state), ("pool_id", pool_id)):
            if value is not None:
                sql.append(f"AND {column} = ?")
                args.append(value)
        if state is not None and state not in TERMINAL:
            # the partial index's own condition, written out: SQLite uses an index on a subset of rows only when the
            # query states that subset, and without it walked the tenant's whole history back (every ended
            # reservation) for the few live ones, on the API's loop
            sql.append(f"AND {LIVE}")
        if before_seq is not None:
            sql.append("AND seq < ?")
            args.append(before_seq)
        sql.append("ORDER BY seq DESC LIMIT ?")
        args.append(limit)
        return [reservation_of(doc, seq) for doc, seq in self._rows(" ".join(sql), *args)]

    def last_event(self, tenant_id: str) -> int | None:
        return self._row("SELECT MAX(seq) FROM events WHERE tenant_id = ?", tenant_id)[0]

    def events(self, tenant_id: str, after: int | None, limit: int) -> list[dict]:
        """The stream's events after the cursor. A cursor past every number this database has handed out was
        not given by it (a restore of an older copy, or a failover that lost the last commits, numbers events
        again from below it): refused, since listing after it would skip the events numbered up to it."""
        rows = self._rows("SELECT seq, reservation_id, type, at, data FROM events WHERE tenant_id = ? AND seq > ?"
                          " ORDER BY seq LIMIT ?", tenant_id, after or 0, limit)
        if not rows and after:
            numbered = self.events_numbered()
            if after > numbered:
                raise invalid("after", f"is past the newest event this control plane has numbered ({numbered}): its "
                              "database was restored from an older copy or lost its last commits in a failover, and "
                              f"events from here on are numbered from {numbered + 1}; list again with after at or below "
                              f"{numbered} (details.newest)", newest=numbered)
        return [{"seq": seq, "reservationId": rid, "type": type_, "at": at, "data": codec.decode_as(data, dict)}
                for seq, rid, type_, at, data in rows]

    def events_numbered(self) -> int:
        """The highest event number the database has handed out (0: none), rolled back or deleted ones included."""
        raise NotImplementedError

    def confirmations(self, tenant_id: str, user_id: str | None, agent_id: str | None, status: str | None,
                      limit: int) -> list[Confirmation]:
        sql = "SELECT doc FROM confirmations WHERE tenant_id = ?"
        args: list[Any] = [tenant_id]
        if user_id is not None and agent_id is not None:
            sql += " AND (user_id = ? OR agent_id = ?)"
            args += [user_id, agent_id]
        if status is not None:
            sql += " AND status = ?"
            args.append(status)
        sql += " ORDER BY created_at DESC LIMIT ?"
        args.append(limit)
        return [codec.decode_confirmation(row[0]) for row in self._rows(sql, *args)]

    def billing(self, tenant_id: str, reservation_id: str | None = None) -> list[tuple[str, str, str, int, int | None]]:
        """(reservation, pool, hourly USD, start, end or None) of the tenant's billed reservations."""
        sql = "SELECT reservation_id, pool_id, hourly_usd, start_ms, end_ms FROM billing WHERE tenant_id = ?"
        args: list[Any] = [tenant_id]
        if reservation_id is not None:
            sql += " AND reservation_id = ?"
            args.append(reservation_id)
        rows = self._rows(sql + " ORDER BY start_ms, reservation_id", *args)
        return [(r[0], r[1], str(r[2]), r[3], r[4]) for r in rows]  # the price: TEXT, or NUMERIC
