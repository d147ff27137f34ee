"""The writer's memory: the booking calendar, the quota ledger and the pending queues.

Owned by the store's single writer thread and changed only from its jobs'
`after` hooks, so it always equals what the database holds; rebuilt from
the database at start and whenever a commit fails.
"""
from __future__ import annotations

from typing import Iterable

from controlplane.catalog import Catalog
from controlplane.domain.calendar import Booking, Calendar
from controlplane.domain.model import Node, Reservation
from controlplane.domain.quota import QuotaLedger
from controlplane.domain.share import Share
from controlplane.domain.states import CHARGED, PENDING
from controlplane.store.sqlite import BookingRow


class WriterState:
    def __init__(self) -> None:
        self.calendar = Calendar()
        self.ledger = QuotaLedger()
        self.pending: dict[str, dict[str, None]] = {}  # pool -> reservation ids, oldest first

    def add_nodes(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            self.calendar.add_node(node.pool_id, node.id, (u.id for u in node.units))

    def rebuild(self, catalog: Catalog, reservations: Iterable[Reservation], bookings: Iterable[BookingRow]) -> None:
        self.calendar = Calendar()
        self.ledger = QuotaLedger()
        self.pending = {}
        self.add_nodes(catalog.nodes.values())
        for row in bookings:
            if row.node_id not in catalog.nodes:
                continue
            self.calendar.add_node(row.pool_id, row.node_id, row.units)
            self.calendar.book(
                Booking(row.reservation_id, row.pool_id, row.node_id, row.units, row.start, row.end,
                        Share(row.vcpu_milli, row.memory_mib, row.hugepages_1g))
            )
        for res in reservations:
            if res.state in CHARGED:
                self.ledger.hold(res.tenant_id, res.charge)
            if res.state == PENDING:
                self.pending.setdefault(res.pool_id, {})[res.id] = None

    def queue(self, pool_id: str) -> dict[str, None]:
        return self.pending.setdefault(pool_id, {})
