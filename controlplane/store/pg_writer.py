"""The PostgreSQL engine's writer (store/postgres.py): groups of jobs, each committed once, across replicas.

Each group either takes the write lock first (`_locked`: BEGIN, the lock, what other replicas changed read into
the memory, the jobs, one statement, COMMIT) or, for creates while nothing suggests another replica writes, is run
on the memory before the commit before it has landed and committed by one compare-and-set statement
(`_speculate`, SPECULATED). A refresh brings the memory up to other replicas' commits without the lock; a memory
to be rebuilt whole is read in a snapshot on a thread of its own while the API's loop serves from the one in use.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from typing import Any, Awaitable, Callable, Collection, Iterable, NamedTuple

import asyncpg
import structlog

from controlplane.domain.clock import Clock
from controlplane.domain.errors import DomainError
from controlplane.store.groups import COMMIT_WAIT_S, Appends, resolve, run_hooks, unavailable
from controlplane.store.pg_connect import AWAY, WRITER, WRITER_COMMITS, WRITER_READS, Connector, Session
from controlplane.store.pg_sql import (BEGUN, CATALOG_CHANGED_SINCE, CHANGED_SINCE, CHANGES, COMMIT_GROUP,
                                       LIVE_BOOKINGS_OF, LOCKED, SPECULATED, TOKENS, WHOLE_READS, WRITER_SETTINGS,
                                       PgAppends)
from controlplane.store.pg_tx import PgTx, Unspeculative
from controlplane.store.port import OnChanged

log = structlog.get_logger("berth.store")

GROUP_MAX = 256
RETRIES = 3  # attempts of a group that lost a race before its callers hear PROVIDER_UNAVAILABLE
RACES = (asyncpg.ExclusionViolationError, asyncpg.UniqueViolationError, asyncpg.DeadlockDetectedError,
         asyncpg.SerializationError)
SPECULATION_PAUSE_S = 2.0  # after another replica wrote, or a speculation failed: groups take the lock first


class Found(NamedTuple):
    """What a group's BEGIN, or a snapshot, found: the database's generation, the last group that changed the
    catalog or the tokens, the last after which every replica rebuilds its memory whole (a migrate's copy), and
    the server run (Session.server)."""

    generation: int
    catalog: int
    rebuild: int
    server: Any


async def _begun(conn: asyncpg.Connection, reads: Iterable[str]) -> tuple[Any, dict[str, tuple[bytes, int] | None]]:
    """BEGUN's answer: the state row (generation, catalog generation, last seq, -, -, rebuild generation), and
    each of `reads` as (doc, seq), or None where no such reservation is."""
    state, rows = None, dict.fromkeys(reads)
    for row in await conn.fetch(BEGUN, list(rows)):
        if row[3] is None:
            state = row
        else:
            rows[row[3]] = (row[4], row[5])
    return state, rows


async def _snapshot(conn: asyncpg.Connection) -> tuple[Found, int]:
    """BEGIN a read-only snapshot on conn: what it shows, and the seq the next reservation gets, the one after its
    last (as a locked group's BEGIN reads it: a speculative group after a refresh takes its seqs from here)."""
    await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    state, _ = await _begun(conn, ())
    return Found(state[0], state[1], state[5], conn.server), state[2] + 1


def _changes_ahead(rows: list, known: int, now: int) -> dict[tuple, list]:
    """CHANGES' rows (the state row first) as the reads _fresh makes (PgTx._fetch answers them from it)."""
    by_kind: tuple[list, ...] = ([], [], [], [], [])
    for r in rows:
        by_kind[r[0]].append(r)
    state, generation = rows[0], rows[0][2]
    changed = [(r[11], r[2], r[7]) for r in by_kind[1]]
    ahead: dict[tuple, list] = {
        (CHANGED_SINCE, known, generation): changed,
        (LIVE_BOOKINGS_OF, now, tuple(row[2] for row in changed)):
            [(r[7], r[8], r[9], r[10], r[2], r[3], r[4], r[5], r[6]) for r in by_kind[2]]}
    if state[3] > known:  # the catalog or the tokens changed
        ahead[(CATALOG_CHANGED_SINCE, known, generation)] = [(r[7], r[8], r[11]) for r in by_kind[3]]
        ahead[(TOKENS,)] = [(r[7], r[8], r[9]) for r in by_kind[4]]
    return ahead


def _as_answer(fn: Callable, exc: BaseException) -> BaseException:
    """What a failed job's caller hears: its DomainError, or PROVIDER_UNAVAILABLE for a fault (logged)."""
    if isinstance(exc, DomainError):
        return exc
    log.exception("store job failed", job=getattr(fn, "__qualname__", repr(fn)))
    return unavailable("the control plane could not complete this request")


class Midway(Exception):
    """A job of a locked group failed after it changed the memory (a bug's path): its caller's answer. The group's
    transaction is rolled back and the memory rebuilt without the write lock (not in that transaction, while every
    replica's writes wait), and the group's other jobs run again."""

    def __init__(self, job: "Job", answer: BaseException):
        super().__init__(str(answer))
        self.job, self.answer = job, answer


class Job:
    """A job waiting for a group: append_only says it usually only reads `reads` and appends (a create), so it
    may be run speculatively (Writer._speculate); refresh, that it is no job but a request to bring the memory up
    to the database (Writer.refresh), met by any group that runs before it."""

    __slots__ = ("fn", "fut", "reads", "append_only", "refresh")

    def __init__(self, fn: Callable[[PgTx], Any], fut: asyncio.Future | None, reads: tuple[str, ...] = (),
                 append_only: bool = False, refresh: bool = False):
        self.fn, self.fut, self.reads, self.append_only, self.refresh = fn, fut, reads, append_only, refresh


def _nothing(tx: PgTx) -> None:
    """A refresh's job where it runs in a group: the group's BEGIN already brought the memory up."""


class Commit:
    """A speculative group's commit on its way: what it answers when it lands."""

    __slots__ = ("group", "answers", "hooks", "stamp", "touched", "future", "done")

    def __init__(self, group: list[Job], answers: list, hooks: list, stamp: int, touched: set[str]):
        self.group, self.answers, self.hooks, self.stamp, self.touched = group, answers, hooks, stamp, touched
        self.future: asyncio.Future | None = None
        self.done = False


class Writer:
    """One replica's writer: groups of jobs, each group one transaction under the write lock, answered after its
    COMMIT. While a group waits for the lock or commits, the API's loop goes on and new jobs queue."""

    def __init__(self, connector: Connector, on_reset: Callable[[PgTx], Callable[[], None]],
                 on_changed: OnChanged | None = None,
                 commit_wait_s: float = COMMIT_WAIT_S, clock: Callable[[], int] | None = None):
        self.connector = connector
        self._on_reset = on_reset
        self._on_changed = on_changed
        self._clock = clock or Clock().compute_now  # the domain's time in ms: what on_changed's bookings are read at
        # A refresh's reads made ahead in its snapshot, by (statement, *arguments): PgTx._fetch answers them
        self.read_ahead: dict[tuple, list] = {}
        self.conn: asyncpg.Connection | None = None
        self.generation: int | None = None  # the database's generation the memory equals (None: rebuild first)
        self._pending: list[Job] = []
        self._busy = False  # a _drive runs
        self._sync = threading.RLock()  # the memory and the writer's connection, against call_sync
        self._committing: Commit | None = None  # the speculative commit on its way
        self._wake: asyncio.Future | None = None  # an open speculative group waits on it (_while_committing)
        self._poisoned = False  # the memory holds a failed speculation's changes: repair or rebuild it first
        # The reservations speculative jobs changed in memory whose commit has not landed (a poisoned memory forgets
        # them), and whether the poison is only theirs: else (a job failed midway) the memory is rebuilt whole
        self.unlanded: set[str] = set()
        self._unrepairable = False
        self._speculate_after = 0.0  # monotonic time before which groups take the lock first
        # A speculative group's read and its commit, on the API's loop: one thread hop less each way, per round
        # trip, than the writer's connection (its locked path's jobs wait on it synchronously, so it has a thread)
        self.reader: Session | None = None
        self.sender: Session | None = None
        self._api_loop: asyncio.AbstractEventLoop | None = None
        self._hooks: list[Callable[[], None]] = []
        self._appends = PgAppends()
        self._touched: set[str] = set()  # of the open group's jobs that succeeded
        self._stamped: set[str] = set()  # of them, rows written with the group's generation (not bumped again)
        self.stamp = 0  # the generation the open group commits (read under the lock at each BEGIN, plus one)
        self.closing = False
        self._ahead: asyncio.Future | None = None  # on the database's loop: the next group's BEGIN and lock
        self.prefetched: dict[str, tuple[bytes, int] | None] = {}  # of the open group (PgTx.reservation)
        self.next_seq = 0  # the seq a reservation inserted next gets (read under the lock at each BEGIN)
        self._catalog_touched = False
        self.groups = 0
        self.jobs = 0
        self.retries = 0  # groups run again after a lost race
        self.reloads = 0  # memory brought up to the database because another replica wrote (or a speculation failed)
        self.rebuilds = 0  # of them, and at start: memory rebuilt whole, not only the reservations that changed
        self.speculated = 0  # groups committed by SPECULATED
        self.sent = 0  # the highest generation this replica's commits moved the database to, or are moving it to
        self.server: Any = None  # the server run the memory was read from (Session.server)
        self.group_committed: Callable[[int], None] = lambda jobs: None
        self.commit_wait_s = commit_wait_s  # a request's caller waits that long, then hears why (_expire)
        self.expired = 0  # callers answered PROVIDER_UNAVAILABLE because their commit took longer than that
        self._waiting: collections.deque[tuple[float, asyncio.Future]] = collections.deque()  # (deadline, caller)
        self._expiry: asyncio.TimerHandle | None = None

    # ---- on the database's thread -----------------------------------------------------------------
    async def _begin(self, reads: list[str] = ()) -> Found:
        """BEGIN, the write lock, and what the lock found; the reservations the group's jobs said they read first
        (`reads`), fetched together."""
        if not await self._ahead_taken():
            await self._connected()
            await self.conn.execute(LOCKED)
        # and one more: a statement after the lock's sees every write committed before it
        state, self.prefetched = await _begun(self.conn, reads)
        self.next_seq = state[2] + 1
        self.stamp = state[0] + 1
        return Found(state[0], state[1], state[5], self.conn.server)

    async def _begin_ahead(self, reads: list[str], known: int | None, now: int) -> tuple[Found, dict[tuple, list]]:
        """_begin, and where the database moved past `known` (the memory's generation), what _fresh reads then,
        read ahead at `now` in one more statement (CHANGES, in the locked transaction): one round trip on this
        thread rather than one hop of the API's loop per read."""
        found = await self._begin(reads)
        if known is None or found.generation == known or found.server != self.server:
            return found, {}
        return found, _changes_ahead(await self.conn.fetch(CHANGES, known, now), known, now)

    async def _connected(self) -> None:
        if self.conn is None or self.conn.is_closed():
            self.conn = None
            self.conn = await self.connector.connect(WRITER, **WRITER_SETTINGS)

    async def _ahead_taken(self) -> bool:
        """Whether the lock taken ahead (after the previous group's commit, while it was answered) is held now in an
        open transaction; a failed try leaves a connection made anew at the next use."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return False
        try:
            await ahead
            return True
        except Exception as exc:  # noqa: BLE001 - taken again the ordinary way
            log.info("the write lock taken ahead failed; taking it again", error=f"{type(exc).__name__}: {exc}")
            if self.conn is not None:
                self.conn.terminate()
            self.conn = None
            return False

    async def _drop_ahead(self) -> None:
        """Give the lock taken ahead back (before a read-only snapshot, or closing)."""
        if await self._ahead_taken():
            await self.conn.execute("ROLLBACK")

    async def _close(self) -> None:
        await self._drop_ahead()
        if self.conn is not None:
            await self.conn.close(timeout=5)

    async def _begin_snapshot(self) -> Found:
        """A read-only snapshot on the writer's connection (_snapshot), the lock taken ahead given back first."""
        await self._drop_ahead()
        await self._connected()
        found, self.next_seq = await _snapshot(self.conn)
        return found

    async def _commit(self, appends: Appends, wrote: bool, touched: set[str], catalog: bool) -> int:
        conn = self.conn
        assert conn is not None
        if wrote or appends:
            generation = await conn.fetchval(COMMIT_GROUP, catalog, list(touched), *appends.parameters())
        else:
            generation = await conn.fetchval("SELECT generation FROM replica_state WHERE id = 1")
        await conn.execute("COMMIT")
        head = self._pending[:1]  # (read on this thread: a copy)
        if head and not self.closing and not (head[0].append_only and self._may_speculate()):
            # Jobs wait for the next group: its BEGIN and lock go now, while this group is answered (a lock the
            # API's loop would otherwise ask for only after that, one round trip later). Another replica waiting
            # for the lock still gets it first: PostgreSQL grants it in the order asked.
            self._ahead = asyncio.ensure_future(conn.execute(LOCKED))
        return generation

    async def _rollback(self) -> None:
        if self.conn is not None and not self.conn.is_closed():
            try:
                await self.conn.execute("ROLLBACK")
            except Exception:  # noqa: BLE001 - a broken connection is replaced at the next group
                self.conn.terminate()
                self.conn = None

    # ---- on the API's loop ------------------------------------------------------------------------
    async def _speculation_read(self, reads: list[str]) -> tuple[int | None, dict[str, tuple[bytes, int] | None]]:
        """The generation and the reservations `reads`, in one snapshot (BEGUN without the lock), on a connection
        of their own (the previous group's commit may be on its way); no generation from another server run than
        the memory's."""
        self.reader = await self._speculative_conn(self.reader, WRITER_READS)
        state, rows = await _begun(self.reader, reads)
        return (state[0] if self.reader.server == self.server else None), rows

    async def _commit_speculated(self, expected: int, appends: "PgAppends", touched: set[str]) -> int | None:
        """SPECULATED outside any transaction: the new generation, or None when another replica wrote since
        `expected` or the connection reached another server run than the memory's (nothing written). Its own
        connection: the writer's may hold the lock taken ahead of a locked group only when no speculative commit
        is on its way (_speculable), so the two never wait for each other."""
        self.sender = await self._speculative_conn(self.sender, WRITER_COMMITS)
        if self.sender.server != self.server:
            return None
        return await self.sender.fetchval(SPECULATED, expected, list(touched), *appends.parameters())

    async def _speculative_conn(self, conn: Session | None, role: str) -> Session:
        """conn while it is open, else a new connection on this loop (the API's: _close_on_api_loop closes it)."""
        if conn is not None and not conn.is_closed():
            return conn
        self._api_loop = asyncio.get_running_loop()
        return await self.connector.connect(role, **WRITER_SETTINGS)

    def call(self, fn: Callable[[PgTx], Any], reads: Iterable[str] = (),
             append_only: bool = False, background: bool = False) -> "asyncio.Future[Any]":
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append(Job(fn, fut, tuple(reads), append_only))
        if not background:
            self._expect(loop, fut)
        self._start()
        return fut

    def _start(self) -> None:
        """A job came: an open group waiting for jobs goes on, and a writer not running starts."""
        self._wake_up()
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._drive())

    def _expect(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        """The caller waits for fut at most commit_wait_s (_expire). Callers are kept in the order they came, so
        the answered ones at the head leave at each call, and the head's deadline is the next to check."""
        waiting = self._waiting
        while waiting and waiting[0][1].done():
            waiting.popleft()
        waiting.append((loop.time() + self.commit_wait_s, fut))
        if self._expiry is None:
            self._expiry = loop.call_at(waiting[0][0], self._expire)

    def _expire(self) -> None:
        """Answer PROVIDER_UNAVAILABLE to the callers whose wait is over; their jobs go on (resolve() skips an
        answered caller), so what commits later is there for the retry with the same key to replay."""
        self._expiry = None
        waiting = self._waiting
        if not waiting:
            return
        loop = waiting[0][1].get_loop()
        now = loop.time()
        while waiting and (waiting[0][1].done() or waiting[0][0] <= now):
            fut = waiting.popleft()[1]
            if not fut.done():
                self.expired += 1
                fut.set_exception(unavailable(
                    f"the database has not committed this change within {self.commit_wait_s:g} s (a synchronous "
                    "standby it waits for may be away, or another replica holds the write lock); it may still "
                    "commit: retry with the same idempotency key"))
        if waiting:
            self._expiry = loop.call_at(waiting[0][0], self._expire)

    async def _drive(self) -> None:
        """Groups until no job waits. A group of jobs that only append (creates) is run speculatively when
        nothing suggests another replica writes: on the memory as this replica's last group left it, while that
        group's commit is still on its way, and committed by one statement that succeeds only if the database's
        generation is still the one the jobs were run on (SPECULATED). Any other group takes the write lock
        first and runs its jobs inside the transaction."""
        self._sync.acquire()
        try:
            while True:
                if not self._pending and self._in_flight():  # the next job to come joins the next group now
                    await self._woken()
                    continue
                if not self._pending:
                    await self._settle()
                    if not self._pending:
                        break
                if self.closing:
                    await self._settle()
                    group, self._pending = self._pending, []
                    await self._give_up(group, ConnectionError("the control plane is stopping"))
                    continue
                if self._pending[0].refresh:
                    n = next((i for i, job in enumerate(self._pending) if not job.refresh), len(self._pending))
                    jobs, self._pending = self._pending[:n], self._pending[n:]
                    await self._refresh(jobs)
                    continue
                speculated = self._speculable()
                if speculated:
                    try:
                        await self._speculate(speculated)
                    except Exception:  # noqa: BLE001 - a fault of this path: the ordinary one runs the jobs
                        log.exception("speculative group failed; running it under the lock")
                        self._spoil("fault")
                        self._redo(speculated)
                    continue
                await self._settle()
                group, self._pending = self._pending[:GROUP_MAX], self._pending[GROUP_MAX:]
                await self._locked(group)
        finally:
            self._busy = False
            self._sync.release()

    async def _on_db(self, coro: Awaitable[Any]) -> Any:
        return await asyncio.wrap_future(self.connector.submit(coro))

    async def _locked(self, group: list["Job"], attempt: int = 1) -> None:
        """One group in a transaction under the write lock: BEGIN and lock, the jobs, one statement, COMMIT."""
        reads = [r for job in group for r in job.reads]
        now = self._clock()
        try:
            found, ahead = await self._on_db(self._begin_ahead(reads, self.generation, now))
            if self._rebuilding(found):  # reading every live reservation: not while every replica's writes wait
                await self._on_db(self._rollback())
                await self._fresh_in_snapshot()
                # (and what committed meanwhile, read under the lock)
                found, ahead = await self._on_db(self._begin_ahead(reads, self.generation, now))
        except BaseException as exc:  # noqa: BLE001 - the database is away
            await self._give_up(group, exc)
            return
        try:
            self._fresh(found, ahead, now, closed=False)
            answers, wrote = self._run_jobs(group)
        except Midway as failed:
            await self._on_db(self._rollback())
            self._spoil("a job failed after changing the memory", repairable=False)
            resolve([(failed.job.fut, None, failed.answer)])
            self._redo([job for job in group if job is not failed.job])
            return
        except BaseException as exc:  # noqa: BLE001 - the database went away mid-group
            await self._on_db(self._rollback())
            self.generation = None
            await self._give_up(group, exc)
            return
        hooks, self._hooks = self._hooks, []
        appends = self._appends.take()
        if wrote or appends:  # its NOTIFY may come back before the COMMIT's answer: it is not another replica's
            self.sent = max(self.sent, self.stamp)
        try:
            generation = await self._on_db(self._commit(appends, wrote, *self._take_touched()))
        except BaseException as exc:  # noqa: BLE001
            await self._on_db(self._rollback())
            self.generation = None
            if isinstance(exc, RACES) and attempt < RETRIES:
                self.retries += 1
                log.info("lost a race with another replica; running the group again", error=type(exc).__name__,
                         attempt=attempt)
                await self._locked(group, attempt + 1)
                return
            await self._give_up(group, exc)
            return
        self.generation = generation
        self.sent = max(self.sent, generation)
        self._answered(len(answers))
        run_hooks(hooks)
        resolve(answers)

    async def _refresh(self, jobs: list["Job"]) -> None:
        """Bring the memory up to what other replicas committed, read in a snapshot without the write lock (a
        locked group would do it too, but hold up every replica that writes meanwhile, for each refresh of each
        replica that follows). Where reading what changed brings the memory up (reservations, catalog rows, tokens),
        the snapshot is the API loop's reading connection's, and what changed is read ahead in it and applied after
        (no thread hop, and the loop is not held while the database answers); else the writer's connection's, the
        memory rebuilt in it."""
        await self._settle()
        self.prefetched = {}  # (a group's reads: none here)
        try:
            if self._ahead is not None:
                await self._on_db(self._drop_ahead())  # the lock taken ahead, given back: this writes nothing
            ahead = await self._read_changes()
        except BaseException as exc:  # noqa: BLE001 - the database is away
            await self._give_up(jobs, exc)
            return
        if ahead is not None:
            try:
                self._fresh(*ahead)
                resolve([(job.fut, None, None) for job in jobs])
                return
            except Unspeculative:  # it asked for more than was read ahead: rebuilt below (_fresh forgot the memory)
                log.info("a refresh needed more than it read ahead; rebuilding the memory")
            except Exception:  # noqa: BLE001 - a fault applying them: rebuilt below, as above
                log.exception("applying another replica's changes failed; rebuilding the memory")
        try:
            await self._fresh_in_snapshot()
        except BaseException as exc:  # noqa: BLE001 - the database is away, or went away mid-read
            await self._give_up(jobs, exc)
            return
        resolve([(job.fut, None, None) for job in jobs])

    async def _fresh_in_snapshot(self) -> None:
        """Bring the memory up to the database in a read-only snapshot on the writer's connection, without the
        write lock: a whole rebuild reads every live reservation, and no replica's writes wait for that. Nor does
        the API's loop: the memory is read and built on a thread of its own (seconds at 100,000 live
        reservations), while the loop serves from the memory in use, and put in place on the loop. (Jobs wait
        meanwhile: this writer runs none until it is.)"""
        self.prefetched = {}  # (a group's reads: none here)
        found = await self._on_db(self._begin_snapshot())
        try:
            read = await asyncio.to_thread(self._read_whole) if self._rebuilding(found) else None
            self._fresh(found, read=read)
        finally:
            await self._on_db(self._rollback())

    async def _read_changes(self) -> tuple[Found, dict[tuple, list], int] | None:
        """What the database holds (as a snapshot gives it), and what _fresh reads where the memory need not be
        rebuilt, read ahead at a `now` (the reservations changed and their bookings live then; the catalog rows
        changed and the tokens): in one statement (CHANGES) on the API loop's reading connection, so one snapshot
        and one round trip. None where the memory is to be rebuilt."""
        known = self.generation
        if known is None:
            return None
        self.reader = conn = await self._speculative_conn(self.reader, WRITER_READS)
        now = self._clock()
        rows = await conn.fetch(CHANGES, known, now)
        state = rows[0]
        found = Found(state[2], state[3], state[4], conn.server)
        self.next_seq = state[5] + 1
        if self._changes_from(found) is None:
            return None
        return found, _changes_ahead(rows, known, now), now

    def refresh(self) -> "asyncio.Future[None]":
        """Bring the memory up to the database (another replica wrote); answered once it is."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(Job(_nothing, fut, refresh=True))
        self._start()
        return fut

    # speculation
    def _may_speculate(self) -> bool:
        return (not self.closing and not self._poisoned and self.generation is not None
                and time.monotonic() >= self._speculate_after)

    def _pause_speculation(self) -> None:
        self._speculate_after = time.monotonic() + SPECULATION_PAUSE_S

    def _speculable(self, reading: Collection[str] = (), limit: int = GROUP_MAX) -> list["Job"]:
        """The leading jobs a speculative group may take: append-only ones that read nothing the group still
        committing wrote, nor anything a job of the open group read (`reading`)."""
        if not self._may_speculate() or self._ahead is not None:
            return []
        busy = self._committing.touched if self._committing is not None else ()
        n = 0
        for job in self._pending[:limit]:
            if not job.append_only or any(r in busy or r in reading for r in job.reads):
                break
            n += 1
        taken, self._pending = self._pending[:n], self._pending[n:]
        return taken

    async def _speculate(self, group: list["Job"]) -> None:
        """Run the group's jobs on the memory, and those that arrive while the commit before it is still on its
        way, and send their commit when that one has landed (answered when this one lands, while the next group
        runs). Jobs are taken in batches, each read (its reservations) before it runs. A job that reads an
        existing reservation, asks the database for more (Unspeculative), or a commit that finds the generation
        moved: its jobs go back to be run under the lock, after the memory is rebuilt where jobs changed it."""
        committing = self._committing
        base = committing.stamp if committing is not None else self.generation
        # What a batch's read may find: the generation as the group began, or that of the commit on its way
        known = {self.generation, base}
        self.stamp = base + 1
        run: list[Job] = []
        reading: set[str] = set()
        answers: list[tuple[Any, Any, BaseException | None]] = []
        batch = group
        while batch:
            ran = await self._speculate_batch(batch, run, known, answers)
            if ran is None:  # the batch, and with it the open group, went back
                return
            run += batch[:ran]
            reading.update(r for job in batch[:ran] for r in job.reads)
            if ran < len(batch) or len(run) >= GROUP_MAX:
                break
            batch = await self._while_committing(committing, reading, GROUP_MAX - len(run))
        if not run:
            return
        touched, catalog = self._take_touched()
        assert not catalog  # a catalog write is a statement: Unspeculative
        hooks, self._hooks = self._hooks, []
        appends = self._appends.take()
        await self._settle()
        if self._poisoned:  # the group before failed: this one was run on memory that is being rebuilt
            self._redo(run)
            return
        commit = Commit(run, answers, hooks, self.stamp, reading | touched)
        self.sent = max(self.sent, self.stamp)
        commit.future = asyncio.ensure_future(self._commit_speculated(self.stamp - 1, appends, touched))
        commit.future.add_done_callback(lambda f: (self._landed(commit), self._wake_up()))
        self._committing = commit

    async def _speculate_batch(self, batch: list["Job"], run: list["Job"], known: set[int | None],
                               answers: list) -> int | None:
        """Read the batch's reservations and run its leading jobs that create (their answers join `answers`):
        how many ran; the others went back to run under the lock (from a replay, or from a job that needed the
        database before it changed the memory). None when the open group (`run` and the batch) went back whole:
        another replica wrote, or a job needed the database or failed after changing the memory."""
        try:
            generation, rows = await self._speculation_read([r for job in batch for r in job.reads])
        except BaseException as exc:  # noqa: BLE001 - the ordinary path reports what is wrong
            log.info("a speculative group's read failed; taking the lock", error=f"{type(exc).__name__}: {exc}")
            generation, rows = None, {}
        if generation is None or generation not in known:  # another replica wrote meanwhile, or a failover
            if run:  # the open group's commit would not land: its jobs were run on memory that is behind
                self._spoil("another replica wrote while a speculative group was open")
            self._redo(run + batch)
            return None
        fresh = 0
        for job in batch:  # a reservation that exists: a replay or a draft continued, run the ordinary way
            if any(rows.get(r) is not None for r in job.reads):
                break
            fresh += 1
        if fresh < len(batch):
            self._redo(batch[fresh:], pause=False)
        self.prefetched = rows
        for i, job in enumerate(batch[:fresh]):
            tx = PgTx(self, self._appends, speculative=True)
            try:
                value = job.fn(tx)
            except Unspeculative:
                if not tx.dirty:  # it asked before it changed anything (a create naming a quote): it, and the
                    self._redo(batch[i:fresh], pause=False)  # batch's rest, run under the lock; the group stands
                    return i
                self._spoil("a speculative job needed the database", repairable=False)
                self._redo(run + batch[:fresh])
                return None
            except BaseException as exc:  # noqa: BLE001 - as _run_jobs: every job gets an answer
                exc = _as_answer(job.fn, exc)
                if tx.dirty:  # its changes to the memory are undone by rebuilding it, so the group is run again
                    self._spoil("a speculative job failed after changing the memory", repairable=False)
                    self._redo(run + batch[:fresh])
                    return None
                answers.append((job.fut, None, exc))
                continue
            self._collect(tx)
            answers.append((job.fut, None, tx.refused) if tx.refused is not None else (job.fut, value, None))
        return fresh

    async def _while_committing(self, committing: "Commit | None", reading: Collection[str],
                                limit: int) -> list["Job"]:
        """The next batch for the open group: jobs that arrive before the commit on its way lands (the group is
        sent then); none once it has landed, or when the next job waiting must take the lock."""
        while self._in_flight(committing):
            batch = self._speculable(reading, limit)
            if batch or self._pending:
                return batch
            await self._woken()
        return []

    def _in_flight(self, commit: "Commit | None" = ...) -> bool:
        """Whether the speculative commit on its way (or `commit`) has yet to land, and the writer goes on."""
        commit = self._committing if commit is ... else commit
        return commit is not None and not commit.future.done() and not self.closing

    async def _woken(self) -> None:
        self._wake = asyncio.get_running_loop().create_future()
        await self._wake

    def _wake_up(self) -> None:
        """A job arrived, or the commit on its way landed: an open group waiting in _while_committing goes on."""
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _landed(self, commit: "Commit") -> None:
        """A speculative commit came back: answered at once when it landed; otherwise _settle runs it again.
        Called by the future's callback, and by _settle (which may find the future done before its callbacks
        ran): the first call answers."""
        fut = commit.future
        if commit.done or not fut.done() or fut.cancelled() or fut.exception() is not None or fut.result() is None:
            return
        self.generation = fut.result()
        commit.done = True
        self.speculated += 1
        self.unlanded -= commit.touched
        self._answered(len(commit.answers))
        run_hooks(commit.hooks)
        resolve(commit.answers)

    async def _settle(self) -> None:
        """Wait for the speculative commit in flight; one that did not land is run again under the lock (after
        the memory is rebuilt), or its callers hear PROVIDER_UNAVAILABLE when the database is away."""
        commit, self._committing = self._committing, None
        if commit is None:
            return
        try:
            await asyncio.shield(commit.future)
        except asyncio.CancelledError:
            if not commit.future.done():
                raise  # the writer's task is cancelled (the loop stops), not the commit: it lands or not by itself
        except BaseException:  # noqa: BLE001 - read from the future below
            pass
        self._landed(commit)
        if commit.done:
            return
        exc = None if commit.future.cancelled() else commit.future.exception()
        self._spoil("a speculative commit did not land" if exc is None else f"{type(exc).__name__}")
        if exc is None or isinstance(exc, RACES):  # the generation moved, or a constraint refused: a lost race
            self.retries += 1
            self._redo(commit.group)
        else:
            await self._give_up(commit.group, exc if isinstance(exc, BaseException) else ConnectionError("cancelled"))

    def _spoil(self, why: str, repairable: bool = True) -> None:
        """The memory holds changes the database will not: repair it at the next group (forget the unlanded
        reservations), or rebuild it whole where a job failed midway (not repairable), and take the lock first for
        a while."""
        log.info("speculation abandoned; the next group takes the write lock", reason=why)
        self._poisoned = True
        self._unrepairable = self._unrepairable or not repairable
        self._pause_speculation()
        self._drop_unwritten()

    def _redo(self, jobs: list["Job"], pause: bool = True) -> None:
        """These jobs again, first and under the lock."""
        if pause:
            self._pause_speculation()
        self._pending[:0] = [Job(job.fn, job.fut, job.reads, False) for job in jobs]

    async def _give_up(self, group: list["Job"], exc: BaseException) -> None:
        """The group could not be committed: the memory is rebuilt from what the database holds, as any whole
        rebuild (read off the API's loop, which never waits here for a connection to a database that is away; at
        the next group, if the database cannot be read now), then its callers hear PROVIDER_UNAVAILABLE."""
        log.error("store group failed", error=f"{type(exc).__name__}: {exc}")
        self._drop_unwritten()
        if not self.connector.closed and not self.closing:
            self.generation = None
            try:
                await self._fresh_in_snapshot()
            except Exception as failed:  # noqa: BLE001 - the next group rebuilds it (the generation is unknown)
                log.warning("could not rebuild the writer's memory now; the next group will", error=str(failed))
        err = unavailable(f"the database is unavailable ({type(exc).__name__}); retry with the same idempotency "
                          "key")
        self._answered(len(group))
        resolve([(job.fut, None, err) for job in group])

    def _reset_now(self) -> None:
        """The memory rebuilt whole now, in a snapshot without the write lock, outside any event loop (call_sync):
        as _fresh_in_snapshot, read on the caller's thread."""
        self.generation = None
        self.prefetched = {}  # (a group's reads: none here)
        try:
            found = self.connector.run(self._begin_snapshot())
            try:
                self._fresh(found)
            finally:
                self.connector.run(self._rollback())
        except Exception as exc:  # noqa: BLE001 - the next group rebuilds it (the generation is unknown)
            log.warning("could not rebuild the writer's memory now; the next group will", error=str(exc))

    def _answered(self, jobs: int) -> None:
        self.groups += 1
        self.jobs += jobs
        self.group_committed(jobs)

    def _drop_unwritten(self) -> None:
        """Forget the rows, hooks and changed reservations of jobs whose group will not commit."""
        self._appends = PgAppends()
        self._hooks = []
        self._take_touched()

    def _take_touched(self) -> tuple[set[str], bool]:
        """The reservations whose rows COMMIT_GROUP stamps (those the group changed but did not write), and whether
        the catalog changed."""
        touched, catalog = self._touched - self._stamped, self._catalog_touched
        self._touched, self._stamped, self._catalog_touched = set(), set(), False
        return touched, catalog

    def _changes_from(self, found: Found) -> int | None:
        """The memory's generation, where reading only the reservations and catalog rows changed since (and
        forgetting the unlanded reservations) brings it up to `found`; None where it must be rebuilt: a job failed
        midway, it is of an unknown generation or of another server run (a failover: the new primary's history may
        have lost the old one's last commits, and reused their generations), the database went back, or a
        migrate's copy replaced what it holds."""
        known = self.generation
        if (known is None or (self._poisoned and self._unrepairable) or found.server != self.server
                or found.generation < known or found.rebuild > known or self._on_changed is None):
            return None
        return known

    def _current(self, found: Found) -> bool:
        """Whether the memory is what the database that found `found` holds."""
        return found.generation == self.generation and found.server == self.server and not self._poisoned

    def _rebuilding(self, found: Found) -> bool:
        """Whether bringing the memory up to `found` rebuilds it whole (_fresh)."""
        return not self._current(found) and self._changes_from(found) is None

    def _fresh(self, found: Found, ahead: dict[tuple, list] | None = None,
               now: int | None = None, closed: bool = True, read: Callable[[], None] | None = None) -> None:
        """Inside the transaction that found `found`: bring the memory up to the database if it moved since this
        replica last saw it. With `ahead`, from what was read ahead at `now` (_read_changes, _begin_ahead); where
        that transaction is `closed` (_read_changes), a read not made ahead raises Unspeculative (and the memory
        is forgotten: rebuild it), else it reads in the transaction. A memory to be rebuilt whole is put in place
        by `read` where it was read already (_fresh_in_snapshot), else read now."""
        if self._current(found):
            return
        generation, server = found.generation, found.server
        if self.generation is not None and (generation != self.generation or server != self.server):
            self._pause_speculation()  # another replica writes, or another server answers
        known = self._changes_from(found)
        tx = PgTx(self, self._appends, speculative=ahead is not None and closed)
        self.server = server
        self.generation = generation  # what the hooks bring the memory to
        self.read_ahead = ahead or {}
        try:
            if known is None:
                (read or self._read_whole(tx))()
                self.rebuilds += 1
            else:
                dropped = self.unlanded if self._poisoned else ()
                catalog = tx.catalog_changed_since(known, generation) if found.catalog > known else None
                self._on_changed(tx, tx.changed_since(known, generation), self._clock() if now is None else now,
                                 dropped, catalog)
        except BaseException:
            self.generation = None
            raise
        finally:
            self.read_ahead = {}
        self._poisoned = self._unrepairable = False
        self.unlanded = set()
        self.reloads += 1

    def _read_whole(self, tx: PgTx | None = None) -> Callable[[], None]:
        """The memory read whole in the open transaction, which then reads whole tables: it plans each statement
        as usual (WHOLE_READS) instead of on the writer's cached index plans. Returned as the step that puts it
        in place (on_reset)."""
        tx = tx or PgTx(self, self._appends)
        tx._hop(lambda c: c.execute(WHOLE_READS), writes=False)
        return self._on_reset(tx)

    def _run_jobs(self, group) -> tuple[list, bool]:
        answers: list[tuple[Any, Any, BaseException | None]] = []
        wrote = False
        for job in group:
            fn, fut = job.fn, job.fut
            tx = PgTx(self, self._appends)
            try:
                value = fn(tx)
            except BaseException as exc:  # noqa: BLE001 - every job gets an answer
                if isinstance(exc, AWAY):
                    raise  # the database's state, not the job's fault: the group is given up (_give_up)
                if tx.dirty:  # the memory holds what the job did before it failed: the group is undone
                    raise Midway(job, _as_answer(fn, exc)) from exc
                if tx.saved:
                    self.connector.run(self.conn.execute("ROLLBACK TO SAVEPOINT job; RELEASE SAVEPOINT job"))
                elif isinstance(exc, asyncpg.PostgresError):
                    # A statement failed before the job's savepoint (a read): the whole transaction is aborted, and
                    # every later statement of the group would fail with it. Undone as a job failing midway is.
                    raise Midway(job, _as_answer(fn, exc)) from exc
                answers.append((fut, None, _as_answer(fn, exc)))
                continue
            # A job's savepoint is left open (no RELEASE, one hop less): the next job's own savepoint of the
            # same name is the one a ROLLBACK TO finds.
            wrote = wrote or tx.wrote
            self._collect(tx)
            answers.append((fut, None, tx.refused) if tx.refused is not None else (fut, value, None))
        return answers, wrote

    def _collect(self, tx: PgTx) -> None:
        """A job that succeeded: its rows, its changed reservations and its hooks join the group's."""
        self._touched |= tx.touched
        self._stamped |= tx.stamped
        self._catalog_touched = self._catalog_touched or tx.catalog_touched
        self._appends.extend(tx.appends)
        self._hooks.extend(tx.committed)

    def call_sync(self, fn: Callable[[PgTx], Any]) -> Any:
        """One job outside any event loop (start-up, tools), under the same lock; returns once committed."""
        for attempt in range(1, RETRIES + 1):
            with self._sync:
                try:
                    self._fresh(self.connector.run(self._begin()))
                    answers, wrote = self._run_jobs([Job(fn, None)])
                    hooks, self._hooks = self._hooks, []
                    self.generation = self.connector.run(self._commit(self._appends.take(), wrote,
                                                                      *self._take_touched()))
                except RACES:
                    self.connector.run(self._rollback())
                    self.generation = None
                    self._drop_unwritten()
                    if attempt == RETRIES:
                        raise
                    self.retries += 1
                    continue
                except BaseException as exc:
                    self.connector.run(self._rollback())
                    self.generation = None  # (the next group rebuilds the memory)
                    self._drop_unwritten()
                    if isinstance(exc, Midway):
                        self._reset_now()  # the memory as the database holds it, read without the write lock
                        raise exc.answer from exc.__cause__
                    raise
            run_hooks(hooks)
            _, value, error = answers[0]
            if error is not None:
                raise error
            return value
        raise AssertionError("unreachable")

    def close(self) -> None:
        """After the group in flight (if any) is answered; later calls answer PROVIDER_UNAVAILABLE."""
        self.closing = True
        got = self._sync.acquire(timeout=10)
        self._close_on_api_loop()
        if self.conn is not None:
            try:
                self.connector.run(self._close(), timeout=10)
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass
        if got:
            self._sync.release()

    def _close_on_api_loop(self) -> None:
        """Close the speculative path's connections on the loop they belong to (close runs on a worker thread,
        once no group is on its way); dropped at once where that loop is this thread's or gone."""
        loop, conns = self._api_loop, [c for c in (self.reader, self.sender) if c is not None and not c.is_closed()]
        self.reader = self.sender = None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for conn in conns:
            if loop is not None and here is not loop and loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(conn.close(timeout=5), loop).result(6)
                except Exception:  # noqa: BLE001 - closing a dead connection
                    loop.call_soon_threadsafe(conn.terminate)
                continue
            with contextlib.suppress(RuntimeError):  # its loop closed: the socket goes with the connection object
                conn.terminate()
