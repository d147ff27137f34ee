"""Timers: when each live reservation next needs the reconciler, so a pass touches only what is due.

A min-heap of (due, kind, reservation id). An entry is not taken out when its
reservation changes, so scheduling is O(log n) and a pass costs O(due
entries), not O(live reservations); each reservation's wanted entries are
remembered, so a save that changes no timer pushes none, a stale entry is
dropped when it pops (the reconciler still checks each entry it gets against
the reservation as the database has it), and once stale entries are half the
heap it is rebuilt from the wanted ones: a
reservation renewed every few seconds, or thousands released long before
their windows' ends, would otherwise grow it until those ends (O(wanted)
memory, rebuilt in O(heap) about as often as it doubles).
"""
from __future__ import annotations

import heapq
from collections import Counter
from itertools import count

from controlplane.domain import states
from controlplane.domain.model import Reservation

START = "start"  # placed -> binding at the window's start
END = "end"  # placed, binding or active -> released at the window's end
LEASE = "lease"  # the lease deadline passed without a renewal
EXPIRE = "expire"  # a pending fixed window whose end passed
CONFIRMATION = "confirmation"  # an awaiting-confirmation draft older than the confirmation window
RETRY = "retry"  # a pool's pending reservations are tried again (the id is the pool's)
HOLD = "hold"  # a held kubernetes release reached its bookings' end: carry on, or end the hold
ENDING = "ending"  # a booked reservation's end is near: reservation.ending, once per end
CLEANING = "cleaning"  # a node's cleaning after a node binding is past its time (the id is the node's)

CONFIRMATION_WINDOW_MS = 30 * 60_000
RETRY_MS = 30_000
COMPACT_MIN = 256  # stale entries below which the heap is never rebuilt


class Timers:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str, str]] = []
        self._seq = count()
        self._retry_due: dict[str, int] = {}  # pool -> the retry already scheduled
        self._wanted: dict[str, set[tuple[int, str]]] = {}  # reservation -> its (due, kind) in the heap
        self._extra: Counter = Counter()  # (due, kind, id) given to add(): a node's cleaning, a timer set aside
        self._stale = 0  # entries in the heap that nothing wants any more

    def __len__(self) -> int:
        return len(self._heap)

    def _push(self, due: int, kind: str, ident: str) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), kind, ident))

    def add(self, due: int, kind: str, ident: str) -> None:
        """One timer, whatever is scheduled for `ident` besides."""
        self._extra[(due, kind, ident)] += 1
        self._push(due, kind, ident)

    def next_due(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: int, limit: int) -> list[tuple[int, str, str]]:
        out = []
        while self._heap and self._heap[0][0] <= now and len(out) < limit:
            due, _, kind, ident = heapq.heappop(self._heap)
            if kind == RETRY:
                if self._retry_due.get(ident) != due:
                    continue
                del self._retry_due[ident]
            elif not self._claim(due, kind, ident, self._wanted, self._extra):
                # its reservation changed or ended since: nothing to do (the reconciler would read it for nothing)
                self._stale = max(0, self._stale - 1)
                continue
            out.append((due, kind, ident))
        return out

    @staticmethod
    def _claim(due: int, kind: str, ident: str, wanted: dict[str, set[tuple[int, str]]], extra: Counter) -> bool:
        """Whether a (non-retry) entry is one still wanted, taken out of `wanted` or `extra` if so."""
        if extra.get((due, kind, ident)):
            extra[(due, kind, ident)] -= 1
            if not extra[(due, kind, ident)]:
                del extra[(due, kind, ident)]
            return True
        mine = wanted.get(ident)
        if mine is None or (due, kind) not in mine:
            return False
        mine.discard((due, kind))
        if not mine:
            del wanted[ident]
        return True

    def forget(self, ident: str) -> None:
        """A reservation memory no longer holds: its entries are stale."""
        self._stale += len(self._wanted.pop(ident, ()))
        self._compact_if_worth_it()

    def _compact_if_worth_it(self) -> None:
        if self._stale < COMPACT_MIN or self._stale * 2 < len(self._heap):
            return
        wanted = {ident: set(w) for ident, w in self._wanted.items()}  # copies: claimed as the heap is walked
        extra = Counter(self._extra)
        kept = [(due, seq, kind, ident) for due, seq, kind, ident in self._heap
                if (self._retry_due.get(ident) == due if kind == RETRY
                    else self._claim(due, kind, ident, wanted, extra))]
        heapq.heapify(kept)
        self._heap, self._stale = kept, 0

    def retry_pool(self, pool_id: str, due: int) -> None:
        """Schedule one retry of a pool's pending queue (an earlier one already scheduled wins)."""
        current = self._retry_due.get(pool_id)
        if current is not None and current <= due:
            return
        self._retry_due[pool_id] = due
        self._push(due, RETRY, pool_id)  # (not add(): _retry_due is what keeps a retry)

    def schedule(self, res: Reservation) -> None:
        """The timers a reservation needs in its current state: those it did not have are pushed, those it no
        longer needs become stale."""
        wanted = needed(res)
        had = self._wanted.get(res.id, set())
        for due, kind in wanted - had:
            self._push(due, kind, res.id)
        if wanted:
            self._wanted[res.id] = set(wanted)
        else:
            self._wanted.pop(res.id, None)
        if had - wanted:
            self._stale += len(had - wanted)
            self._compact_if_worth_it()


def needed(res: Reservation) -> frozenset[tuple[int, str]]:
    """The (due, kind) timers a reservation needs in its current state."""
    out: set[tuple[int, str]] = set()
    if res.hold is not None:
        out.add((res.hold.until, HOLD))
    if res.state in states.TERMINAL:
        return frozenset(out)
    if res.lease_deadline is not None and res.state in (states.PENDING, states.PLACED, states.BINDING, states.ACTIVE):
        out.add((res.lease_deadline, LEASE))
    if res.state == states.PLACED and res.start is not None:
        out.add((res.start, START))
    if res.state in states.BOOKED and res.end is not None:
        out.add((res.end, END))
        if res.ending_warning_ms and res.ending_warned != res.end:
            out.add((res.end - res.ending_warning_ms, ENDING))
    if res.state == states.PENDING and not res.asap and res.end is not None:
        out.add((res.end, EXPIRE))
    if res.state == states.AWAITING_CONFIRMATION:
        out.add((res.updated_at + CONFIRMATION_WINDOW_MS, CONFIRMATION))
    return frozenset(out)
