"""The PostgreSQL engine of the store port (store/port.py): several replicas on one database, on asyncpg.

Each replica keeps the writer's memory (calendar, quota ledger, queues) as the
SQLite engine does, and the database keeps the replicas honest:

- **One writer at a time, across replicas.** A group of jobs runs in one
  transaction that first takes `pg_advisory_xact_lock(WRITE_LOCK)` and reads
  `replica_state.generation`. When the generation is not the one this replica
  last committed or read, another replica wrote meanwhile, and what it changed
  is read into the memory (inside the same locked transaction) before any job
  runs; so placement, quota and budgets are decided on exactly what is
  committed, by every replica (the catalog's rows too, and the tokens). A
  memory to be rebuilt whole (a failover) is rebuilt first in a snapshot
  without the lock. A group that wrote bumps the generation and
  sends `NOTIFY berth_changes` in its transaction; the other replicas hear it
  (controlplane/replicas.py) and refresh at once, so their watches answer
  within milliseconds. A generation counts only on the server run it was read
  from (Session): after a failover the memory is rebuilt whole.
- **The database refuses what the memory should never allow** (pg_schema.py):
  the exclusion constraint on booked devices, the unique reservation id of
  (tenant, principal, key). A group that meets one of those, a deadlock or a
  serialization failure (a lost race) is rolled back, the memory brought back
  to the database and the group run again (`retries` counts them); only after
  RETRIES attempts do its callers get PROVIDER_UNAVAILABLE.
- **Commit order is cursor order.** Events are inserted under the write lock,
  and the lock is released only after the commit is visible, so a later
  `seq` is never visible before an earlier one: listing after a cursor skips
  nothing.

asyncpg is asynchronous and the port is synchronous (jobs are plain code over
the writer's memory), so asyncpg runs on its own thread and event loop
(`Connector`); a statement waits there, while the lock wait and the COMMIT are
awaited without blocking the API's loop. A lost connection (a replica's
database failing over) answers PROVIDER_UNAVAILABLE with `actor: platform`
and is reconnected with backoff. A committed read a request makes on the
API's loop waits at most READ_ON_LOOP_S; one that gets no answer in that time
(a primary that stopped answering, a link dropping packets) marks the
database stalled, and until a probe off the loop hears it again, such reads
are answered PROVIDER_UNAVAILABLE at once instead of holding the loop; one
that meets a table locked whole gives up after READ_LOCK_TIMEOUT_MS, stalled
the same way until the same read gets through.

This module is the store itself: committed reads on a small pool, and the
writer started on them. The writer is pg_writer.py, a job's transaction
pg_tx.py, the writer's statements pg_sql.py, the connections pg_connect.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Awaitable, Callable, Iterable

import asyncpg

from controlplane.store import pg_schema
from controlplane.store.groups import COMMIT_WAIT_S, WriterFront, unavailable
from controlplane.store.pg_connect import (MIGRATE, READ_POOL, READS, SERVER_SETTINGS, AWAY, UNREACHABLE, Connector,
                                           cannot_connect)
from controlplane.store.pg_tx import PgTx
from controlplane.store.pg_writer import Writer
from controlplane.store.port import OnChanged, StoreError
from controlplane.store.reads import STATE_COUNTS, CommittedReads, numbered


READ_ON_LOOP_S = 5.0  # the longest a committed read on the API's loop may hold it (a healthy one takes ms)
# A committed read takes no lock a writer's statement holds (MVCC): only a table locked whole (a migration's ALTER,
# VACUUM FULL, TRUNCATE, an operator's LOCK TABLE) makes it wait, and on the API's loop it must not, for long.
READ_LOCK_TIMEOUT_MS = 100


_LOCKED = ("a table this read needs is locked whole (a migration, VACUUM FULL, TRUNCATE, an operator's LOCK "
           "TABLE); retry shortly")


class PgStore(WriterFront, CommittedReads):
    """The store port on a PostgreSQL database: committed reads on a small pool, and this replica's writer."""

    placeholders = staticmethod(numbered)  # the shared reads' statements (store/reads.py)
    engine = "postgresql"
    schema_version = 0  # until opened: then the version the migrations left

    def __init__(self, dsn: str, application: str = "berth-controlplane", commit_wait_s: float = COMMIT_WAIT_S):
        self.dsn = dsn
        self.commit_wait_s = commit_wait_s
        self.connector = Connector(dsn, application)
        self.stalled = False  # a read on the loop got no answer: the database may have stopped answering
        self._probe: concurrent.futures.Future | None = None
        self._probe_read: Callable[[asyncpg.Connection], Awaitable[Any]] | None = None  # what the probe reads
        try:
            self.connector.run(self._open(), timeout=60)
        except pg_schema.SchemaTooNew as exc:
            self.connector.close()
            raise StoreError(str(exc)) from None
        except (UNREACHABLE + (asyncpg.PostgresError,)) as exc:
            self.connector.close()
            raise StoreError(f"cannot open the database: {cannot_connect(exc, dsn)}") from None
        self.writer: Writer | None = None

    async def _open(self) -> None:
        conn = await self.connector.connect(MIGRATE)
        try:
            self.schema_version = await pg_schema.migrate(conn)
        finally:
            await conn.close()
        # min_size 0: the pool keeps no floor of connections, so it does not retry (and log) while the database is away
        self.pool = await asyncpg.create_pool(
            self.dsn, min_size=0, max_size=READ_POOL, statement_cache_size=256,
            server_settings={**SERVER_SETTINGS, "lock_timeout": str(READ_LOCK_TIMEOUT_MS),
                             "application_name": f"{self.connector.application} {READS}"})

    def start(self, on_reset: Callable[[PgTx], Callable[[], None]], on_group: Callable[[int], None] | None = None,
              on_changed: OnChanged | None = None,
              clock: Callable[[], int] | None = None) -> None:
        self.writer = Writer(self.connector, on_reset, on_changed, self.commit_wait_s, clock)
        if on_group is not None:
            self.writer.group_committed = on_group

    def call(self, job: Callable[[PgTx], Any], reads: Iterable[str] = (),
             append_only: bool = False, background: bool = False) -> "asyncio.Future[Any]":
        assert self.writer is not None, "start() the store first"
        return self.writer.call(job, reads, append_only, background)

    def refresh(self) -> "asyncio.Future[None]":
        assert self.writer is not None, "start() the store first"
        return self.writer.refresh()

    @property
    def generation(self) -> int | None:
        return self.writer.generation if self.writer else None

    @property
    def sent(self) -> int:
        """The highest generation this replica's own commits reached or are reaching (a NOTIFY of one of those is
        not another replica's)."""
        return self.writer.sent if self.writer else 0

    @staticmethod
    def database_error(exc: BaseException) -> bool:
        return isinstance(exc, (*UNREACHABLE, asyncpg.PostgresError))  # (REFUSING's are PostgresErrors too)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        try:
            self.connector.run(asyncio.wait_for(self.pool.close(), 10), timeout=15)
        except Exception:  # noqa: BLE001 - closing what is already gone
            pass
        self.connector.close()

    # ---- committed reads ------------------------------------------------------------------------------
    async def _on_pool(self, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        async with self.pool.acquire() as conn:
            return await fn(conn)

    def read(self, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        """fn(conn) on a pooled connection, waited for on the caller's thread (the API's loop) at most
        READ_ON_LOOP_S; the database unreachable, refusing or stalled -> PROVIDER_UNAVAILABLE (actor platform)."""
        if self.stalled:
            self._hear_again()
            raise unavailable(_LOCKED if self._probe_read is not None else "the database is not answering; retry "
                              "shortly")
        try:
            return self.connector.run(self._on_pool(fn), timeout=READ_ON_LOOP_S)
        except concurrent.futures.TimeoutError:
            self.stalled, self._probe_read = True, None
            self._hear_again()
            raise unavailable(f"the database did not answer within {READ_ON_LOOP_S:g} s; retry shortly") from None
        except asyncpg.LockNotAvailableError:
            # Stalled too, until the same read gets through: each read meanwhile would hold the loop for the wait.
            self.stalled, self._probe_read = True, fn
            self._hear_again()
            raise unavailable(_LOCKED) from None
        except AWAY as exc:
            raise unavailable(f"the database is unavailable ({type(exc).__name__}); retry shortly") from None

    def _hear_again(self) -> None:
        """While stalled: one probe at a time, off the API's loop; its answer ends the stall. The probe is the read
        that met a locked table (a bare SELECT 1 reads none, and gets through the lock), else SELECT 1: the
        database's answer is enough."""
        if self._probe is not None and not self._probe.done():
            return

        def heard(probe: concurrent.futures.Future) -> None:
            if not probe.cancelled() and probe.exception() is None:
                self.stalled = False

        self._probe = self.connector.submit(self._on_pool(self._probe_read or (lambda c: c.fetchval("SELECT 1"))))
        self._probe.add_done_callback(heard)

    async def read_async(self, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        """As read(), awaited: the API's loop goes on meanwhile."""
        try:
            return await asyncio.wrap_future(self.connector.submit(self._on_pool(fn)))
        except asyncpg.LockNotAvailableError:
            raise unavailable(_LOCKED) from None
        except AWAY as exc:
            raise unavailable(f"the database is unavailable ({type(exc).__name__}); retry shortly") from None

    def _fetchrow(self, sql: str, *args) -> Any:
        return self.read(lambda c: c.fetchrow(sql, *args))

    def _fetch(self, sql: str, *args) -> list:
        return self.read(lambda c: c.fetch(sql, *args))

    async def state_counts(self) -> list[tuple[str, str, int]]:
        return [tuple(r) for r in await self.read_async(lambda c: c.fetch(STATE_COUNTS))]

    def events_numbered(self) -> int:
        # a sequence is not transactional: this is every number taken, by any replica, committed or not yet
        return self._fetchrow("SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM events_seq_seq")[0]

    # ---- what replicas share beside the store (store/replicas.py) --------------------------------------
    async def record_seen(self, seen: dict[str, int]) -> None:
        """Record agents' last heartbeats (epoch ms), never moving one back."""
        await self.read_async(lambda c: c.executemany(
            "INSERT INTO node_seen (node_id, seen_at) VALUES ($1, $2) ON CONFLICT (node_id)"
            " DO UPDATE SET seen_at = GREATEST(node_seen.seen_at, excluded.seen_at)", list(seen.items())))

    async def last_seen(self) -> dict[str, int]:
        """The agents' last heartbeats every replica heard (epoch ms), read off the API's loop."""
        rows = await self.read_async(lambda c: c.fetch("SELECT node_id, seen_at FROM node_seen"))
        return {r[0]: r[1] for r in rows}
