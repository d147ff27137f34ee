"""Operations: every mutation's long-running record, read and waited on (after Google AIP-151).

A create's operation runs until the reservation is active (succeeded) or
ends first (failed, with `failure.actor` provider or platform, or cancelled
by the customer); release, cancel and extend record theirs as succeeded
when they answer. Operations are kept as long as their reservation (at
least 24 hours after they end, as the seed asks). `wait` is bounded and
returns the operation, finished or not.
"""
from __future__ import annotations

import asyncio

from controlplane.domain.errors import not_found
from controlplane.domain.model import Operation, Principal, Reservation
from controlplane.store.port import Store
from controlplane.reservations import ReservationService, wake
from controlplane.transitions import Transitions

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class OperationService:
    def __init__(self, store: Store, moves: Transitions, reservations: ReservationService):
        self.store = store
        self.reservations = reservations
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self.closing = False
        moves.listeners.append(self._changed)

    def close(self) -> None:
        """Shutting down: every wait answers now, with the operation as it stands (a stop is not held up to a
        wait's 60 s: the client waits again on another replica, or on this one back)."""
        self.closing = True
        for waiting in self._waiters.values():
            wake(waiting)

    def _changed(self, res: Reservation) -> None:
        wake(self._waiters.pop(res.id, ()))

    async def get(self, principal: Principal, op_id: str) -> tuple[Operation, int]:
        """The operation, and its reservation's node count (a gang's operations are answered as a cluster's)."""
        op = self.store.operation(op_id)
        if op is None or op.tenant_id != principal.tenant_id:
            raise not_found("operation", op_id, field="operationId")
        answer = await self.reservations.get(principal, op.reservation_id)  # reading it is reading its reservation
        return op, answer.reservation.node_count

    async def wait(self, principal: Principal, op_id: str, timeout_ms: int) -> tuple[Operation, int]:
        op, node_count = await self.get(principal, op_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while op.status not in TERMINAL and not self.closing:
            left = deadline - loop.time()
            if left <= 0:
                break
            fut = loop.create_future()
            self._waiters.setdefault(op.reservation_id, []).append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                pass
            finally:
                waiting = self._waiters.get(op.reservation_id, [])
                if fut in waiting:
                    waiting.remove(fut)
            op = self.store.operation(op_id) or op
        return op, node_count
