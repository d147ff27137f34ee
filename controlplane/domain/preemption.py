"""Preemption: which spot reservations must give way so that a request that is not spot fits.

Policy only, over the calendar: victims are taken out youngest first until
the request fits, then every victim whose return would still leave room is
put back, so no more spot work is preempted than the placement needs. The
calendar is left with the victims' bookings removed; the caller ends them.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from controlplane.domain.calendar import Calendar
from controlplane.domain.model import Node, Placement
from controlplane.domain.placement import Ask, place


def overlapping(calendar: Calendar, candidates: Iterable[str], start: int, end: int) -> list[str]:
    return [
        rid for rid in candidates
        if any(b.start < end and b.end > start for b in calendar.by_reservation.get(rid, ()))
    ]


def preempt_for(calendar: Calendar, pool_id: str, nodes: Mapping[str, Node], ask: Ask,
                spot_ids_oldest_first: Iterable[str]) -> tuple[list[Placement], list[str]] | None:
    """(placement, victims) if preempting spot work makes the ask fit, else None (calendar unchanged)."""
    candidates = overlapping(calendar, spot_ids_oldest_first, ask.start, ask.end)
    pool = calendar.pool(pool_id)
    removed: dict[str, list] = {}
    placement = None
    for rid in reversed(candidates):  # youngest first
        removed[rid] = calendar.remove(rid)
        placement = place(pool, nodes, ask)
        if placement is not None:
            break
    if placement is None:
        for bookings in removed.values():
            for b in bookings:
                calendar.book(b)
        return None
    for rid in list(removed):  # give back every victim the placement does not need
        for b in removed[rid]:
            calendar.book(b)
        if place(pool, nodes, ask) is None:
            calendar.remove(rid)
        else:
            del removed[rid]
    placement = place(pool, nodes, ask)
    assert placement is not None
    return placement, list(removed)


def preempt(calendar: Calendar, pool_id: str, nodes: Mapping[str, Node], ask: Ask,
            victims: Iterable[str]) -> list[Placement]:
    """Take the victims would_preempt found out of the calendar and place the ask: what preempt_for leaves, with
    no second search."""
    for rid in victims:
        calendar.remove(rid)
    placement = place(calendar.pool(pool_id), nodes, ask)
    assert placement is not None, "would_preempt found that these victims make the ask fit"
    return placement


def would_preempt(calendar: Calendar, pool_id: str, nodes: Mapping[str, Node], ask: Ask,
                  spot_ids_oldest_first: Iterable[str]) -> list[str] | None:
    """The victims preempt_for would take for the ask, with the calendar left as it was (a quote's dry run)."""
    ids = list(spot_ids_oldest_first)
    saved = {rid: calendar.bookings_of(rid) for rid in ids}
    found = preempt_for(calendar, pool_id, nodes, ask, ids)
    if found is None:
        return None
    for rid in found[1]:
        for b in saved[rid]:
            calendar.book(b)
    return found[1]
