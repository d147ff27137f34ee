"""Replicas: what several control planes on one database coordinate beside the store (docs/scale-out.md).

- **One leader** drives the timers (the reconciler) and declares silent
  nodes lost: the replica holding the session advisory lock LEADER_LOCK on
  a connection of its own. The others try for it every tick; when the
  leader dies (even by kill -9) its session ends, PostgreSQL frees the
  lock, and another replica leads within a tick or two. Every transition
  stays conditional on the state it leaves, so a short overlap of two
  leaders (a partition) moves nothing twice.
- **Hearing each other.** A replica that commits writes sends
  `NOTIFY berth_changes` (store/pg_writer.py); the others LISTEN and refresh
  their memory at once (store.refresh: a snapshot of what moved, read
  without the write lock, so a replica that follows never holds up the one
  that writes), so
  an agent's watch on replica A wakes within milliseconds of a create on
  replica B. After a lost listening connection a replica refreshes anyway.
- **Heartbeats heard anywhere.** An agent behind a load balancer beats on
  any replica; each records what it heard in `node_seen` about once a
  second, and the leader merges those before each check for lost nodes.

`Solo` is the one-replica case (SQLite): it always leads and shares nothing,
but keeps its agents' last heartbeats in the file too, so that after its
restart a node whose agent never speaks again still shows when it was last
heard from (an alert on its heartbeat age fires) before it is lost.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable

import asyncpg
import structlog

from controlplane.store.pg_connect import LEADER, LISTEN, UNREACHABLE
from controlplane.store.postgres import PgStore

log = structlog.get_logger("berth.replicas")

LEADER_LOCK = 0x62657274_0003  # "bert" and 3: held for the session by the replica that leads
CHANNEL = "berth_changes"
CATCH_UP_S = 2.0
# Between the starts of two catch-ups: anyone can send unknown tokens, and each catch-up waits for the speculative
# commit on its way and drops the lock taken ahead (store/pg_writer.py), so a flood of them costs the database and
# the writer at most 20 reads a second, however fast it comes; a token issued a moment ago waits at most this more.
CATCH_UP_SPACING_S = 0.05


class HeardHeartbeats:
    """The agents' heartbeats a control plane heard since it last wrote them to `node_seen` (the latest per node),
    and that write: a failed one keeps them for the next."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def heard(self, node_id: str, at_ms: int) -> None:
        if at_ms > self._seen.get(node_id, 0):
            self._seen[node_id] = at_ms

    async def record(self, store) -> None:
        seen, self._seen = self._seen, {}
        if not seen:
            return
        try:
            await store.record_seen(seen)
        except Exception as exc:  # noqa: BLE001 - kept for the next try (the database away, a full disk)
            for node_id, at in seen.items():
                self.heard(node_id, at)
            log.warning("could not record the nodes' heartbeats; trying again", error=str(exc))


class Solo:
    """One control plane on its own database: it leads, and there is nobody to hear or tell. What its agents'
    heartbeats said goes into the file every `record_s` (one small commit: a database of the whole fleet's
    heartbeats would commit on every one) and at a clean stop; read back once, by the first check for lost nodes
    after a start."""

    leading = True
    catch_ups = 0  # (metrics: nobody else writes, so nothing is ever caught up)

    def __init__(self, store=None, record_s: float = 10.0):
        self.store = store  # None: nothing recorded (a store without node_seen)
        self.record_s = record_s
        self._heartbeats = HeardHeartbeats()
        self._restored = False
        self._task: asyncio.Task | None = None

    def leads(self) -> bool:
        return True

    def heard(self, node_id: str, at_ms: int) -> None:
        if self.store is not None:
            self._heartbeats.heard(node_id, at_ms)

    async def heard_elsewhere(self) -> dict[str, int]:
        """Once, after a start: the heartbeats heard before it."""
        if self._restored or self.store is None:
            return {}
        self._restored = True
        try:
            return await self.store.last_seen()
        except Exception as exc:  # noqa: BLE001 - shown again once agents speak
            log.warning("could not read the nodes' last heartbeats", error=str(exc))
            return {}

    async def start(self, refresh: Callable[[], None], became_leader: Callable[[], None]) -> None:
        became_leader()  # alone on its database, it leads from the start
        if self.store is not None:
            self._task = asyncio.ensure_future(self._record_heartbeats())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
            await self._heartbeats.record(self.store)

    async def _record_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.record_s)
            await self._heartbeats.record(self.store)

    async def caught_up(self) -> None:
        """Nobody else writes: the memory has everything."""


class Shared:
    """A replica among others on one PostgreSQL database. The leader's connection lives on the store's database
    thread (its session, which holds the lead, answers whatever the API's loop is doing); the listening one on the
    API's loop, where a NOTIFY is heard without a hop between threads (each woke the loop through its self-pipe:
    about a tenth of a following replica's CPU)."""

    def __init__(self, store: PgStore, tick_s: float = 1.0):
        self.store = store
        self.connector = store.connector
        self.tick_s = tick_s
        self.leading = False
        self._heartbeats = HeardHeartbeats()
        self._tasks: list = []
        self._stopping = False
        self._main: asyncio.AbstractEventLoop | None = None
        self._refresh: Callable[[], None] = lambda: None
        self._became_leader: Callable[[], None] = lambda: None
        self._tried: concurrent.futures.Future = concurrent.futures.Future()
        self.notices = 0  # NOTIFYs heard from other replicas' commits (metrics, tests)
        self.catch_ups = 0  # the memory brought up for a request that could not wait for the NOTIFY (metrics)
        self._next_catch_up: asyncio.Future | None = None  # the catch-up every request asking now waits for
        self._caught_up_at = float("-inf")  # (monotonic) when the last one began

    def leads(self) -> bool:
        return self.leading

    def heard(self, node_id: str, at_ms: int) -> None:
        self._heartbeats.heard(node_id, at_ms)

    async def heard_elsewhere(self) -> dict[str, int]:
        try:
            return await self.store.last_seen()
        except Exception:  # noqa: BLE001 - the database away: judge on what this replica heard itself
            return {}

    async def start(self, refresh: Callable[[], None], became_leader: Callable[[], None]) -> None:
        self._main = asyncio.get_running_loop()
        self._refresh, self._became_leader = refresh, became_leader
        self._tried = concurrent.futures.Future()  # the first try for the lead: a lone replica leads at once
        self._tasks = [self.connector.submit(self._lead()), asyncio.ensure_future(self._listen()),
                       asyncio.ensure_future(self._share_heartbeats())]
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._tried), self.tick_s * 5)
        except asyncio.TimeoutError:
            log.warning("no answer yet to the first try for the lead; serving, and trying on")

    async def stop(self) -> None:
        self._stopping = True
        if self._next_catch_up is not None:
            self._next_catch_up.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(asyncio.wrap_future(t) if not isinstance(t, asyncio.Future) else t
                               for t in self._tasks), return_exceptions=True)
        self.leading = False

    async def caught_up(self) -> None:
        """The memory brought up to what other replicas committed before now (a token one of them issued a moment
        ago, before its NOTIFY was heard here); at most CATCH_UP_S, and not at all while the database is away: the
        caller then judges on the memory as it is. Requests that ask together share one catch-up, which begins
        CATCH_UP_SPACING_S after the last one began at the earliest."""
        if self._next_catch_up is None:
            self._next_catch_up = asyncio.ensure_future(self._catch_up())
        try:
            await asyncio.wait_for(asyncio.shield(self._next_catch_up), CATCH_UP_S)
        except Exception as exc:  # noqa: BLE001 - the database away, or slow: what the memory holds decides
            log.info("could not catch up with the database", error=f"{type(exc).__name__}: {exc}")

    async def _catch_up(self) -> None:
        """The next catch-up: once the spacing since the last one is over, one refresh of the memory. It reads what
        committed before it begins, so it serves every request that asked until then (later ones wait for the
        next)."""
        await asyncio.sleep(self._caught_up_at + CATCH_UP_SPACING_S - time.monotonic())
        self._next_catch_up = None
        self._caught_up_at = time.monotonic()
        self.catch_ups += 1
        await self.store.refresh()

    def _to_main(self, fn: Callable[[], None]) -> None:
        if self._main is not None and not self._main.is_closed():
            self._main.call_soon_threadsafe(fn)

    # ---- on the database's thread -------------------------------------------------------------------
    async def _lead(self) -> None:
        conn: asyncpg.Connection | None = None
        try:
            while not self._stopping:
                try:
                    if conn is None or conn.is_closed():
                        self.leading = False
                        conn = await self.connector.connect(LEADER)
                    if not self.leading:
                        if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK):
                            self.leading = True
                            log.info("this replica leads: it drives the timers and watches for lost nodes")
                            self._to_main(self._became_leader)
                    else:
                        await conn.fetchval("SELECT 1", timeout=self.tick_s * 3)  # ours while the session lives
                except (UNREACHABLE + (asyncpg.PostgresError,)) as exc:
                    if self.leading:
                        log.warning("lost the leader's connection; another replica may lead now", error=str(exc))
                    self.leading = False
                    if conn is not None:
                        conn.terminate()
                    conn = None
                if not self._tried.done():
                    self._tried.set_result(self.leading)
                await asyncio.sleep(self.tick_s)
        finally:
            # Stopped (mostly cancelled in the sleep): the session goes at once, and the lead's lock with it, so a
            # replica started in its place leads on its first try instead of when this process exits.
            self.leading = False
            if conn is not None and not conn.is_closed():
                conn.terminate()

    # ---- on the API's loop ----------------------------------------------------------------------------
    async def _listen(self) -> None:
        conn: asyncpg.Connection | None = None
        lost = asyncio.Event()

        def notice(_conn, _pid, _channel, payload: str) -> None:
            self.notices += 1
            self._heard(int(payload) if payload.isdigit() else None)

        while not self._stopping:
            try:
                if conn is None or conn.is_closed():
                    lost.clear()
                    conn = await self.connector.connect(LISTEN)
                    conn.add_termination_listener(lambda _c: lost.set())
                    await conn.add_listener(CHANNEL, notice)
                    self._heard(None)  # what was committed while nobody listened
                try:
                    await asyncio.wait_for(lost.wait(), self.tick_s * 5)
                except asyncio.TimeoutError:
                    await conn.fetchval("SELECT 1", timeout=self.tick_s * 3)
            except asyncio.CancelledError:
                break
            except (UNREACHABLE + (asyncpg.PostgresError,)) as exc:
                log.warning("lost the listening connection; reconnecting", error=str(exc))
                if conn is not None:
                    conn.terminate()
                conn = None
                await asyncio.sleep(self.tick_s)
        if conn is not None and not conn.is_closed():
            await conn.close()

    def _heard(self, generation: int | None) -> None:
        known = self.store.generation
        if generation is not None and known is not None and generation <= max(known, self.store.sent):
            return  # our own commit (landed, or on its way), or one the memory already has
        self._refresh()

    async def _share_heartbeats(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.tick_s)
            await self._heartbeats.record(self.store)
