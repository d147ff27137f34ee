"""Timers: when each live reservation next needs the reconciler, so a pass touches only what is due.

A min-heap of (due, kind, reservation id). Entries are never removed when a
reservation changes; the reconciler checks each popped entry against the
reservation as it stands and skips the stale ones, so scheduling is O(log n)
and a pass costs O(due entries), not O(live reservations).
"""
from __future__ import annotations

import heapq
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


class Timers:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str, str]] = []
        self._seq = count()
        self._retry_due: dict[str, int] = {}  # pool -> the retry already scheduled

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, due: int, kind: str, ident: str) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), kind, ident))

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
            out.append((due, kind, ident))
        return out

    def retry_pool(self, pool_id: str, due: int) -> None:
        """Schedule one retry of a pool's pending queue (an earlier one already scheduled wins)."""
        current = self._retry_due.get(pool_id)
        if current is not None and current <= due:
            return
        self._retry_due[pool_id] = due
        self.add(due, RETRY, pool_id)

    def schedule(self, res: Reservation) -> None:
        """The timers a reservation needs in its current state."""
        if res.hold is not None:
            self.add(res.hold.until, HOLD, res.id)
        if res.state in states.TERMINAL:
            return
        if res.lease_deadline is not None and res.state in (states.PENDING, states.PLACED, states.BINDING, states.ACTIVE):
            self.add(res.lease_deadline, LEASE, res.id)
        if res.state == states.PLACED and res.start is not None:
            self.add(res.start, START, res.id)
        if res.state in states.BOOKED and res.end is not None:
            self.add(res.end, END, res.id)
            if res.ending_warning_ms and res.ending_warned != res.end:
                self.add(res.end - res.ending_warning_ms, ENDING, res.id)
        if res.state == states.PENDING and not res.asap and res.end is not None:
            self.add(res.end, EXPIRE, res.id)
        if res.state == states.AWAITING_CONFIRMATION:
            self.add(res.updated_at + CONFIRMATION_WINDOW_MS, CONFIRMATION, res.id)
