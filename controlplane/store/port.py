"""The store port: what the services may ask of storage, as protocols. Every SQL statement lives behind it.

Two sides. `Store` is the store as a whole: reads of committed data (for
answers that need no transaction) and `call(job)`, which runs `job(tx)` in the
single writer's transaction and answers once that transaction is durably
committed. `Tx` is the open transaction a job gets: keyed reads that see the
job's own writes, the domain's writes as small methods, and the loaders the
writer's memory (calendar, quota ledger, queues) is rebuilt from.

A job answers with a plain value, or raises DomainError to roll back its own
writes. `tx.refuse(error)` keeps the job's writes and still answers the
caller with the refusal (a draft that stays so the same key can be retried).
An unexpected exception in a job rolls back that job only and answers
PROVIDER_UNAVAILABLE. Engines: store/sqlite.py (embedded, the default) and store/postgres.py (several
replicas on one database, docs/scale-out.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Collection, Iterable, Protocol, TypeVar

from controlplane.domain.calendar import Booking
from controlplane.domain.errors import DomainError
from controlplane.domain.model import Confirmation, Operation, Reservation

T = TypeVar("T")


class StoreError(Exception):
    """The database cannot be opened as it is (either engine); the message says what to do."""


@dataclass(frozen=True, slots=True)
class CatalogChanges:
    """What other writers changed of the catalog and the tokens: the catalog's rows they wrote (kind, id, the
    stored document; catalog rows are never deleted), and every token as it is now."""

    rows: list[tuple[str, str, bytes]]
    tokens: dict[str, tuple[str, str]]


# What brings a writer's memory up to other writers' changes: (tx, reservations, now, dropped, catalog), as
# Store.start describes
OnChanged = Callable[[Any, list[Reservation], int, Collection[str], CatalogChanges | None], None]


class Reads(Protocol):
    """Reads by key; on the Store they see committed data, on a Tx also the job's own writes."""

    def reservation(self, reservation_id: str) -> Reservation | None: ...

    def operation(self, operation_id: str) -> Operation | None: ...

    def confirmation(self, confirmation_id: str) -> Confirmation | None: ...

    def quote(self, quote_id: str) -> tuple[str, int, bytes] | None:
        """(tenant, expires at, document) of a stored quote."""


class Tx(Reads, Protocol):
    """One job's view of the writer's open transaction."""

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call fn on the event loop once this job's group is committed (never if it is not)."""

    def touch(self) -> None:
        """Say that this job is about to change the writer's memory (rebuilt from the database if the job fails)."""

    def refuse(self, error: DomainError) -> None:
        """Keep this job's writes and answer its caller with `error` once they are committed."""

    # reservations
    def save_reservation(self, res: Reservation) -> None:
        """Insert a reservation never stored (seq 0), else update it."""

    def move_if(self, res: Reservation, expected_state: str) -> bool:
        """Write the reservation only if its stored state is still expected_state; False if it moved meanwhile."""

    # bookings
    def insert_bookings(self, bookings: Iterable[Booking]) -> None: ...

    def end_bookings(self, reservation_id: str, at: int) -> None:
        """Bookings end at `at`; one not yet started ends where it starts (kept, empty, for history)."""

    def set_bookings_end(self, reservation_id: str, end: int) -> None:
        """Live bookings end at `end` (an extend, a carry-on); one ended where it started stays so."""

    # events, confirmations (a reservation's operations are saved with it)
    def event(self, tenant_id: str, reservation_id: str | None, type_: str, at: int, data: dict[str, Any]) -> None: ...

    def put_confirmation(self, conf: Confirmation) -> None: ...

    # billing and quotes
    def bill_from(self, res: Reservation, start: int) -> None: ...

    def bill_until(self, reservation_id: str, end: int) -> None: ...

    def put_quote(self, quote_id: str, tenant_id: str, expires_at: int, doc: bytes) -> None: ...

    # catalog and tokens
    def put_catalog(self, kind: str, ident: str, doc: bytes) -> None: ...

    def put_token(self, token_hash: str, kind: str, subject: str) -> None: ...

    def delete_tokens(self, kind: str, subject: str) -> None: ...

    # what the writer's memory is built from (at start, and after a failed job or commit)
    def live_reservations(self, now: int) -> list[Reservation]:
        """Reservations not in a terminal state, and released ones whose bookings still cover time after `now`
        (a kubernetes release hold)."""

    def live_bookings(self, now: int) -> list[Booking]:
        """Bookings of placed, binding and active reservations that still cover time, and of released ones that
        end after `now` (a kubernetes release hold)."""

    def catalog_docs(self, kind: str) -> list[bytes]: ...

    def tokens(self) -> dict[str, tuple[str, str]]:
        """token hash -> (kind, subject)."""


class Store(Reads, Protocol):
    """Committed reads, and the single writer."""

    groups: int  # writer groups committed (metrics)
    jobs: int  # jobs run
    engine: str  # "sqlite" or "postgresql" (metrics)
    schema_version: int  # the database's schema once opened: the migrations brought it there (metrics)

    async def state_counts(self) -> list[tuple[str, str, int]]:
        """(pool, state, reservations) of every pool and state that has any, read off the API's loop: a count over
        every reservation, ended ones included, takes seconds on a long history."""

    def start(self, on_reset: Callable[[Tx], Callable[[], None]], on_group: Callable[[int], None] | None = None,
              on_changed: OnChanged | None = None, clock: Callable[[], int] | None = None) -> None:
        """Start the writer; on_reset(tx) reads the writer's memory whole from the database, apart from the memory
        in use, and returns the step that puts it in place (an engine may read on a thread of its own, so the
        API's loop serves meanwhile, and puts it in place on that loop); on_group(jobs) hears
        each committed group's size; on_changed(tx, reservations, now, dropped, catalog) brings the memory up to
        date with what other writers (replicas on one database) changed: the reservations
        (tx.live_bookings_of(their ids, now) gives their bookings; an engine may have read them ahead, at a `now`
        from clock, the domain's time in ms), after forgetting `dropped`, reservations it ran jobs on whose
        commit did not land (an engine that runs jobs before the previous commit lands), and the catalog and
        tokens where they changed (else None); an engine with one writer never calls it."""

    def call(self, job: Callable[[Tx], T], reads: Iterable[str] = (), append_only: bool = False,
             background: bool = False) -> Awaitable[T]:
        """Run job(tx) in the writer's next group; the answer comes after the group's commit. reads: the
        reservations the job reads first (an engine across a network fetches a group's together). append_only:
        the job usually reads only those and appends rows (a create), so an engine may run it before the
        previous group has committed, and run it again the ordinary way if it does more. An engine whose commit
        can be held (PostgreSQL) answers a request's caller PROVIDER_UNAVAILABLE once it has waited its commit
        wait, and the job goes on; background: the platform's own work (the reconciler, a node's loss, a reset's
        outcome), which waits for its commit however long that takes."""

    def call_sync(self, job: Callable[[Tx], T]) -> T:
        """Run one job now, outside any event loop (start-up, tools); returns once committed."""

    def refresh(self) -> Awaitable[None]:
        """Bring the writer's memory up to what other writers committed (on_changed, or on_reset), after the jobs
        queued before; an engine with a write lock reads without it. With one writer there is nothing to read."""

    def database_error(self, exc: BaseException) -> bool:
        """Whether exc, raised inside a job, is the database's (unreachable, refusing, full), not the job's fault."""

    def close(self) -> None: ...

    # reads of committed data
    def reservations_page(self, tenant_id: str, principal_id: str | None, state: str | None, pool_id: str | None,
                          before_seq: int | None, limit: int) -> list[Reservation]:
        """The tenant's public reservations newest first, before `before_seq` (a page of list)."""

    def events(self, tenant_id: str, after: int | None, limit: int) -> list[dict]:
        """The stream's events after the cursor, oldest first; a cursor past events_numbered() is INVALID_INPUT."""

    def events_numbered(self) -> int:
        """The highest event number the database has handed out (0: none)."""

    def last_event(self, tenant_id: str) -> int | None:
        """The seq of the tenant's newest event (None: it has none)."""

    def confirmations(self, tenant_id: str, user_id: str | None, agent_id: str | None, status: str | None,
                      limit: int) -> list[Confirmation]: ...

    def billing(self, tenant_id: str, reservation_id: str | None = None) -> list[tuple[str, str, str, int, int | None]]:
        """(reservation, pool, hourly USD, start, end or None) of the tenant's billed reservations."""

