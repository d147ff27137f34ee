"""The reservation state machine: the one table of allowed transitions.

draft and awaiting-confirmation are internal (get is NOT_FOUND, list skips
them); released and cancelled are terminal and never left.
"""
from __future__ import annotations

from controlplane.domain.model import Reservation

DRAFT = "draft"
AWAITING_CONFIRMATION = "awaiting-confirmation"
PENDING = "pending"
PLACED = "placed"
BINDING = "binding"
ACTIVE = "active"
RELEASED = "released"
CANCELLED = "cancelled"

INTERNAL = frozenset({DRAFT, AWAITING_CONFIRMATION})
TERMINAL = frozenset({RELEASED, CANCELLED})
# States that hold bookings in the calendar.
BOOKED = frozenset({PLACED, BINDING, ACTIVE})
# States whose quota charge counts.
CHARGED = frozenset({PENDING, PLACED, BINDING, ACTIVE})
PUBLIC_STATES = (PENDING, PLACED, BINDING, ACTIVE, RELEASED, CANCELLED)

TRANSITIONS: dict[str, frozenset[str]] = {
    DRAFT: frozenset({AWAITING_CONFIRMATION, PENDING, PLACED, CANCELLED}),
    AWAITING_CONFIRMATION: frozenset({DRAFT, PENDING, PLACED, CANCELLED}),
    PENDING: frozenset({PLACED, CANCELLED}),
    PLACED: frozenset({BINDING, RELEASED, CANCELLED, PENDING}),
    BINDING: frozenset({ACTIVE, RELEASED}),
    ACTIVE: frozenset({RELEASED}),
    RELEASED: frozenset(),
    CANCELLED: frozenset(),
}

# The event each entered state writes.
EVENT_OF_STATE = {
    AWAITING_CONFIRMATION: "reservation.awaiting-confirmation",
    PENDING: "reservation.pending",
    PLACED: "reservation.placed",
    BINDING: "reservation.binding",
    ACTIVE: "reservation.active",
    RELEASED: "reservation.released",
    CANCELLED: "reservation.cancelled",
}


class IllegalTransition(Exception):
    def __init__(self, reservation_id: str, from_state: str, to_state: str):
        super().__init__(f"reservation {reservation_id}: {from_state} -> {to_state} is not a transition")
        self.from_state = from_state
        self.to_state = to_state


def can_move(from_state: str, to_state: str) -> bool:
    return to_state in TRANSITIONS[from_state]


def move(reservation: Reservation, to_state: str, now: int, reason: str | None = None) -> str:
    """Move the reservation; returns the state it left. Terminal states take a reason."""
    old = reservation.state
    if not can_move(old, to_state):
        raise IllegalTransition(reservation.id, old, to_state)
    reservation.state = to_state
    reservation.updated_at = now
    if to_state in TERMINAL:
        reservation.reason = reason
        reservation.ended_at = now
    return old
