"""Billing: what each reservation bills, from confirmed readiness (active) to confirmed release.

A reservation starts billing when every node reported its devices bound and
stops when it is released, prorated to the second at the hourly price fixed
when it was created; a create that never became active bills nothing. Usage
is shown as lines per reservation and UTC day whose totals are exact sums
(a reservation's lines come to its whole billed time rounded once:
`line_amount`). Spend (what was billed so far) and exposure (what live
reservations, and released ones whose held devices still bill, may still
bill) are read against a tenant's budget.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from decimal import Decimal

from controlplane.domain import states
from controlplane.domain.clock import Clock
from controlplane.domain.model import Reservation
from controlplane.domain.pricing import charge, day_spans, exposure, line_amount, money
from controlplane.state import WriterState
from controlplane.store.port import Store


@dataclass(frozen=True, slots=True)
class UsageLine:
    reservation_id: str
    pool_id: str
    day: int  # UTC midnight, epoch ms
    start: int
    end: int
    seconds: int
    hourly_usd: Decimal
    amount_usd: Decimal
    running: bool  # still accruing
    held: bool = False  # time after a kubernetes release while pods still held the devices (billed, shown apart)

    @property
    def key(self) -> str:
        return f"{self.day}:{self.reservation_id}" + (":held" if self.held else "")

    def to_wire(self) -> dict:
        return {
            "reservationId": self.reservation_id, "poolId": self.pool_id,
            "day": time.strftime("%Y-%m-%d", time.gmtime(self.day / 1000)), "from": self.start, "to": self.end,
            "seconds": self.seconds, "hourlyUsd": money(self.hourly_usd), "amountUsd": money(self.amount_usd),
            "running": self.running, "held": self.held,
        }


def _split(start: int, stop: int, held_from: int | None) -> list[tuple[int, int, bool]]:
    """A billed span as (from, to, held) parts: before and after the release that started a hold."""
    if held_from is None or held_from >= stop:
        return [(start, stop, False)]
    if held_from <= start:
        return [(start, stop, True)]
    return [(start, held_from, False), (held_from, stop, True)]


class Billing:
    def __init__(self, store: Store, clock: Clock, state: WriterState):
        self.store = store
        self.clock = clock
        self.state = state

    def lines(self, tenant_id: str, reservation_id: str | None = None, since: int | None = None,
              until: int | None = None) -> list[UsageLine]:
        now = self.clock.compute_now()
        out: list[UsageLine] = []
        for rid, pool_id, hourly_text, start, end in self.store.billing(tenant_id, reservation_id):
            hourly = Decimal(hourly_text)
            stop = end if end is not None else now
            held_from = self._held_from(rid)
            for a0, b0, held in _split(start, stop, held_from):
                for day, a, b in day_spans(a0, b0):
                    if (since is not None and day < since) or (until is not None and day >= until):
                        continue
                    seconds = charge(hourly, a, b)[0]
                    out.append(UsageLine(rid, pool_id, day, a, b, seconds, hourly, line_amount(hourly, start, a, b),
                                         end is None and b == stop, held))
        out.sort(key=lambda line: (line.day, line.reservation_id, line.held))
        return out

    def _held_from(self, reservation_id: str) -> int | None:
        res = self.store.reservation(reservation_id)
        return res.held_from if res is not None else None

    def spent_usd(self, tenant_id: str) -> Decimal:
        return sum((line.amount_usd for line in self.lines(tenant_id)), Decimal(0))

    def exposure_usd(self, tenant_id: str) -> Decimal:
        """What the tenant's live reservations may still bill until their windows end, and its released ones whose
        devices pods still hold (a kubernetes release: billed until the window's end at the latest).

        Read from the writer's memory, so an admission sees every commitment
        admitted before it, committed or still in its group's transaction.
        """
        now = self.clock.compute_now()
        return sum((self.may_still_bill(res, now) for res in (*self.state.charged_of(tenant_id),
                                                               *self.state.held_billing_of(tenant_id))), Decimal(0))

    @staticmethod
    def may_still_bill(res: Reservation, now: int, end: int | None = None) -> Decimal:
        """What one reservation may bill from now until its window's end (`end`: the end an extend asks for), at
        most: the rest of a billing one as its lines will count it (so billed plus this is its whole window rounded
        once), and for one not billing yet every whole-second tick its window can touch from now."""
        end = res.end if end is None else end
        if res.state == states.PENDING and res.asap:
            return exposure(res.hourly_usd, res.duration_ms or 0)
        if end is None:
            return Decimal(0)
        if res.billing_start is not None:
            if res.billing_end is not None or now >= end:
                return Decimal(0)
            return line_amount(res.hourly_usd, res.billing_start, now, end)
        return exposure(res.hourly_usd, max(0, end - max(now, res.start or now)))
