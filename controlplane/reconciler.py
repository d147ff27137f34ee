"""The capacity.reservations reconciler: makes time move for reservations.

placed -> binding at the window's start; binding/active -> released at its
end; a held kubernetes release is carried on past its bookings' end, or its
hold ended (transitions.py); a lapsed lease releases (reason lease-lapsed); a pending fixed window
whose end passed is cancelled (reason expired); an awaiting-confirmation
draft lapses after 30 minutes; a pool's pending reservations are retried
every 30 seconds, and at once when capacity frees (`capacity_freed`: a release,
a cancel, a node back, the end of a window).

A pass is one store job over the timers that are due (domain/timers.py), so
its cost follows the number of changes, not the number of live
reservations; every transition is conditional on the state it leaves, so
two reconcilers at once never move a reservation twice. The loop wakes on
the earliest timer, on a tick, and when told (a fake clock moved, a node
reported). A timer whose handling raises a fault of its own (a defect; not
the database's, which fails the pass for a tick) is set aside for a minute
and named in the log, and the pass runs again without it, so one
reservation's fault never stops the others' windows.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import structlog

from controlplane import confirmations
from controlplane.domain import states
from controlplane.domain.clock import Clock
from controlplane.domain.model import Reservation
from controlplane.domain.timers import (CLEANING, CONFIRMATION, CONFIRMATION_WINDOW_MS, END, ENDING, EXPIRE, HOLD,
                                       LEASE, RETRY, START)
from controlplane.state import WriterState
from controlplane.store.groups import log_pass_failure
from controlplane.store.port import Store, Tx
from controlplane.transitions import Transitions

log = structlog.get_logger("berth.reconciler")

BATCH = 5000  # timers handled per pass; a longer backlog continues in the next pass at once
SET_ASIDE_MS = 60_000  # a timer whose handling failed is tried again after this; the others go on meanwhile


class Reconciler:
    def __init__(self, store: Store, clock: Clock, state: WriterState, moves: Transitions, tick_s: float = 1.0):
        self.store = store
        self.clock = clock
        self.state = state
        self.moves = moves
        self.tick_s = tick_s
        self._wake = asyncio.Event()
        self._background: set[asyncio.Future] = set()
        self.passes = 0
        self.transitions = 0
        self.failures = 0  # timers whose handling failed (each set aside, then tried again)
        self.set_aside: dict[tuple[str, str], int] = {}  # (kind, id) -> when it is tried again (domain time, ms)
        self._fault: tuple[str, str] | None = None  # the timer whose handling raised a fault of its own
        self.pass_took: Callable[[float], None] = lambda seconds: None  # each pass's duration, for /metrics
        # a node's cleaning past its time (controlplane/cleaning.py): True when that moved the node
        self.cleaning_overdue: Callable[[Tx, str, int], bool] = lambda tx, node_id, now: False
        self.leads: Callable[[], bool] = lambda: True  # of several replicas only the leader passes (replicas.py)

    def wake(self) -> None:
        """Something is due now (a window that already started): pass at once, not at the next tick."""
        self._wake.set()

    def capacity_freed(self, pool_id: str) -> None:
        """Freed capacity: try the pool's pending reservations now."""
        if not self.state.pending.get(pool_id):
            return
        self.background(self.store.call(lambda tx: self.moves.place_pending(tx, pool_id), background=True))

    def background(self, work) -> asyncio.Future:
        """Run work (a coroutine or future) beside the loop; drain() waits for it."""
        job = asyncio.ensure_future(work)
        self._background.add(job)
        job.add_done_callback(self._background.discard)
        return job

    async def drain(self) -> None:
        """Wait for the background work (placements started by capacity_freed, BMC resets) to finish."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def run_once(self) -> int:
        """One pass over what is due now; the number of reservations it moved."""
        started = time.perf_counter()
        try:
            moved, freed, more = await self.store.call(self._pass, background=True)
        except Exception:
            failed, self._fault = self._fault, None
            if failed is None:
                raise
            # One reservation's (or node's) fault must not stop every other window from starting and ending: its
            # timer waits, the rest go on in the next pass, at once.
            self.failures += 1
            self.set_aside[failed] = self.clock.compute_now() + SET_ASIDE_MS
            log.exception("reconciler: handling a timer failed; it is set aside and tried again, the others go on",
                          kind=failed[0], id=failed[1], retry_in_s=SET_ASIDE_MS // 1000)
            self._wake.set()
            return 0
        self.pass_took(time.perf_counter() - started)
        self.passes += 1
        self.transitions += moved
        for pool_id in freed:
            self.capacity_freed(pool_id)
        if more:
            self._wake.set()
        return moved

    async def settle(self, limit: int = 20) -> int:
        """Pass until nothing more is due (tests, after moving a fake clock)."""
        total = 0
        for _ in range(limit):
            failures = self.failures
            moved = await self.run_once()
            total += moved
            nxt = self.state.timers.next_due()
            if self.failures == failures and (nxt is None or nxt > self.clock.compute_now()):
                break  # (after a timer was set aside, the others are due again once the memory is rebuilt)
        return total

    async def run(self) -> None:
        while True:
            self._wake.clear()  # before the pass: a wake during it is kept for the next
            try:
                if self.leads():
                    await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad pass
                log_pass_failure(log, "reconciler pass", exc)
                failed = True  # not one timer's fault (a commit): the next try after a tick, not in a hot loop
            else:
                failed = False
            if failed:  # a failed commit rebuilds the memory, which wakes this loop: a tick first, not a hot loop
                await asyncio.sleep(self.tick_s)
                continue
            # A replica that does not lead takes no timer off the heap: its due ones would wake it at once, for ever
            nxt = self.state.timers.next_due() if self.leads() else None
            delay = self.tick_s
            if nxt is not None:
                delay = max(0.0, min(delay, (nxt - self.clock.compute_now()) / 1000))
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    # ---- the pass (a store job) ------------------------------------------------------
    def _pass(self, tx: Tx) -> tuple[int, set[str], bool]:
        now = self.clock.compute_now()
        due = self.state.timers.pop_due(now, BATCH)
        if due:
            tx.touch()  # popping timers changes memory
        moved = 0
        freed: set[str] = set()
        retry_pools: list[str] = []
        for _, kind, ident in due:
            again = self.set_aside.get((kind, ident))
            if again is not None:
                if again > now:
                    self.state.timers.add(again, kind, ident)  # its turn comes then
                    continue
                del self.set_aside[(kind, ident)]
            if kind == RETRY:
                retry_pools.append(ident)
                continue
            moved += self._blamed(kind, ident, lambda: self._timer(tx, kind, ident, now, freed))
        for pool_id in retry_pools:
            moved += self._blamed(RETRY, pool_id, lambda: len(self.moves.place_pending(tx, pool_id)))
        nxt = self.state.timers.next_due()
        return moved, freed, nxt is not None and nxt <= now

    def _blamed(self, kind: str, ident: str, handle: Callable[[], int]) -> int:
        """handle(); when it raises a fault of its own (not the database's: that is no one timer's), the timer is
        named for run_once to set aside."""
        try:
            return handle()
        except Exception as exc:
            if not self.store.database_error(exc):
                self._fault = (kind, ident)
            raise

    def _timer(self, tx: Tx, kind: str, ident: str, now: int, freed: set[str]) -> int:
        """One due timer of a reservation (or, CLEANING, of a node): the reservations it moved (0 or 1)."""
        if kind == CLEANING:
            return int(self.cleaning_overdue(tx, ident, now))
        res = tx.reservation(ident)
        if res is None or (res.state in states.TERMINAL and res.hold is None):
            return 0
        if kind == HOLD:
            if res.hold is None or res.hold.until > now:
                return 0
            pool_id = self.moves.carry_on(tx, res, now)
            if pool_id is not None:
                freed.add(pool_id)
            return 1
        if res.state in states.TERMINAL or not self._handle(tx, kind, res, now):
            return 0
        if res.state in states.TERMINAL:
            freed.add(res.pool_id)
        return 1

    def _handle(self, tx: Tx, kind: str, res: Reservation, now: int) -> bool:
        if kind == LEASE:
            if res.lease_deadline is not None and res.lease_deadline <= now and res.state in states.BOOKED:
                self.moves.end(tx, res, now, "lease-lapsed", actor="customer")
                return True
            return False
        if kind == START:
            if res.state == states.PLACED and res.start is not None and res.start <= now:
                if res.end is not None and res.end <= now:
                    return self._end_window(tx, res, now)
                return self.moves.start_binding(tx, res, now)
            return False
        if kind == END:
            if res.state in states.BOOKED and res.end is not None and res.end <= now:
                return self._end_window(tx, res, now)
            return False
        if kind == ENDING:
            return self._warn_ending(tx, res, now)
        if kind == EXPIRE:
            if res.state == states.PENDING and not res.asap and res.end is not None and res.end <= now:
                self.moves.end(tx, res, now, "expired", actor="provider")
                return True
            return False
        if kind == CONFIRMATION:
            if res.state == states.AWAITING_CONFIRMATION and res.updated_at + CONFIRMATION_WINDOW_MS <= now:
                confirmations.lapse(tx, self.moves, res, now, "expired")
                return True
            return False
        return False

    def _warn_ending(self, tx: Tx, res: Reservation, now: int) -> bool:
        """reservation.ending, once per end, while the end is within the pool's warning time and not yet reached
        (a timer for an end since moved by an extension is stale: the new end has its own)."""
        end = res.end
        if (res.state not in (states.BINDING, states.ACTIVE) or end is None or not res.ending_warning_ms
                or res.ending_warned == end
                or not end - res.ending_warning_ms <= now < end):
            return False
        res.ending_warned = end
        self.moves.save(tx, res)
        self.moves.event(tx, res, "reservation.ending", now, end=end, secondsLeft=(end - now) // 1000)
        return False  # no state moved

    def _end_window(self, tx: Tx, res: Reservation, now: int) -> bool:
        # A window that ends before its devices were reported bound fails the create: the platform's doing.
        actor = "customer" if res.state == states.ACTIVE else "platform"
        self.moves.end(tx, res, now, "ended", actor=actor)
        return True

