"""The writer's memory: the booking calendar, the quota ledger, the pending queues, the timers.

Changed only by store jobs (on the event loop), so it always equals what the
database holds; rebuilt from the database at start and whenever a job or a
commit fails, and brought up to date reservation by reservation with what
other replicas wrote (apply) and with creates whose speculative commit did
not land (forget).
"""
from __future__ import annotations

import sys
from typing import Iterable

from controlplane.catalog import Catalog
from controlplane.domain import states
from controlplane.domain.calendar import Booking, Calendar
from controlplane.domain.model import Node, Reservation
from controlplane.domain.quota import QuotaLedger
from controlplane.domain.timers import CLEANING, RETRY_MS, Timers


class WriterState:
    def __init__(self) -> None:
        self.calendar = Calendar()
        self.ledger = QuotaLedger()
        # pool -> pending reservation ids, first admitted first, each with its key (queue_key): one sent back to
        # pending (a drain) takes its place again, and every replica and every rebuild keeps one order
        self.pending: dict[str, dict[str, QueueKey]] = {}
        self.spot: dict[str, dict[str, None]] = {}  # pool -> booked spot reservation ids, oldest first
        self.charged: dict[str, dict[str, Reservation]] = {}  # tenant -> its reservations holding a charge
        # tenant -> its released reservations whose devices pods still hold, billed until the window's end at the
        # latest (a kubernetes release): charged nothing, but what they may still bill counts against a budget
        self.held_billing: dict[str, dict[str, Reservation]] = {}
        self.timers = Timers()

    def add_nodes(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            self.calendar.add_node(node.pool_id, node.id, (u.id for u in node.units))

    def nodes_changed(self, nodes: Iterable[Node]) -> None:
        """Nodes as the catalog has them now (at a rebuild, or as another replica changed them): their devices in
        the calendar, a cleaning's deadline among the timers (one that is no longer the node's finds it so when
        due)."""
        self.add_nodes(nodes := list(nodes))
        for node in nodes:
            if node.cleaning is not None:
                self.timers.add(node.cleaning.deadline, CLEANING, node.id)

    def rebuild(self, catalog: Catalog, reservations: Iterable[Reservation], bookings: Iterable[Booking],
                now: int = 0) -> None:
        self.calendar = Calendar()
        self.ledger = QuotaLedger()
        self.pending = {}
        self.spot = {}
        self.charged = {}
        self.held_billing = {}
        self.timers = Timers()
        self.nodes_changed(catalog.nodes.values())
        for booking in bookings:
            self.calendar.add_node(booking.pool_id, booking.node_id, booking.units)
            self.calendar.book(booking)
        for res in reservations:
            self.track(res)
            if res.state in states.CHARGED:
                self.ledger.hold(res.tenant_id, res.charge)
        for pool_id, queue in self.pending.items():
            if queue:
                self.timers.retry_pool(pool_id, now + RETRY_MS)

    def replace(self, built: "WriterState") -> None:
        """Take `built`'s memory as this one's, at once (a rebuild made apart, while this one was still read)."""
        self.calendar, self.ledger, self.timers = built.calendar, built.ledger, built.timers
        self.pending, self.spot, self.charged = built.pending, built.spot, built.charged
        self.held_billing = built.held_billing

    def apply(self, changed: Iterable[Reservation], bookings: Iterable[Booking], now: int) -> None:
        """Reservations as other replicas left them (docs/scale-out.md): their bookings, charges and indexes
        replaced by what the database holds. Every old booking of theirs goes before any new one comes: another
        replica may have placed one of them where another one's booking ended (a pending reservation placed on the
        devices a cancel freed), whichever comes first."""
        changed = list(changed)
        for res in changed:
            self.calendar.remove(res.id)
        for booking in bookings:
            self.calendar.add_node(booking.pool_id, booking.node_id, booking.units)
            self.calendar.book(booking)
        for res in changed:
            old = self.charged.get(res.tenant_id, {}).get(res.id)
            if old is not None:
                self.ledger.refund(old.tenant_id, old.charge)
            if res.state in states.CHARGED:
                self.ledger.hold(res.tenant_id, res.charge)
            self.track(res)
            if res.state == states.PENDING:
                self.timers.retry_pool(res.pool_id, now + RETRY_MS)

    def forget(self, reservation_id: str) -> None:
        """A reservation the database does not hold after all (a create whose speculative commit did not land):
        out of the calendar, the ledger and the indexes. A timer of it left behind finds nothing when due."""
        self.calendar.remove(reservation_id)
        for held in self.charged.values():
            res = held.pop(reservation_id, None)
            if res is not None:
                self.ledger.refund(res.tenant_id, res.charge)
        for index in (*self.pending.values(), *self.spot.values(), *self.held_billing.values()):
            index.pop(reservation_id, None)
        self.timers.forget(reservation_id)

    def track(self, res: Reservation) -> None:
        """Keep the indexes (pending queue, spot set, timers) in step with the reservation's state."""
        queue = self.queue(res.pool_id)
        if res.state == states.PENDING:
            if res.id not in queue:
                key = queue_key(res)
                behind = bool(queue) and next(reversed(queue.values())) > key
                queue[res.id] = key
                if behind:  # older than the tail: to its place (the dict itself, which callers hold)
                    ordered = sorted(queue.items(), key=lambda item: item[1])
                    queue.clear()
                    queue.update(ordered)
        else:
            queue.pop(res.id, None)
        spot = self.spot.setdefault(res.pool_id, {})
        if res.spot and res.state in states.BOOKED:
            spot.setdefault(res.id, None)
        else:
            spot.pop(res.id, None)
        charged = self.charged.setdefault(res.tenant_id, {})
        if res.state in states.CHARGED:
            charged[res.id] = res  # as the last job that saved it left it, committed or not
        else:
            charged.pop(res.id, None)
        held = self.held_billing.setdefault(res.tenant_id, {})
        if res.state not in states.CHARGED and res.hold is not None and res.held_from is not None \
                and res.billing_end is None:
            held[res.id] = res
        else:
            held.pop(res.id, None)
        self.timers.schedule(res)

    def charged_of(self, tenant_id: str) -> list[Reservation]:
        """The tenant's reservations that hold a charge, including those admitted by jobs not yet committed."""
        return list(self.charged.get(tenant_id, {}).values())

    def held_billing_of(self, tenant_id: str) -> list[Reservation]:
        """The tenant's released reservations whose held devices still bill (see held_billing)."""
        return list(self.held_billing.get(tenant_id, {}).values())

    def queue(self, pool_id: str) -> dict[str, QueueKey]:
        return self.pending.setdefault(pool_id, {})

    def queue_position(self, res: Reservation) -> int:
        """Where a reservation is, or would be, in its pool's pending queue, from 1."""
        key = queue_key(res)
        return 1 + sum(1 for other in self.queue(res.pool_id).values() if other < key)


QueueKey = tuple[int, int]


def queue_key(res: Reservation) -> QueueKey:
    """The order of admission (its create operation's start: a draft refused and decided again later, or
    confirmed later, comes in then, behind what was queued meanwhile), and within one millisecond of creation (the
    store's seq; one not yet stored last). Kept in the reservation, so a rebuild and every replica have it."""
    op = res.create_operation()
    return (op.created_at if op is not None else res.created_at), res.seq or sys.maxsize
