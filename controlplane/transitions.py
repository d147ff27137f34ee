"""Transitions: every change of a reservation inside a store job, with all that follows from it.

Placing (with spot preemption or the pool's queue), booking, starting,
activating and ending a reservation: each moves the state through the state
machine, writes the reservation conditionally on the state it left (so two
reconcilers never move one reservation twice), keeps the calendar, the
quota ledger, the queues and the timers in step, and writes the event and
the operation, all in the job's transaction. Listeners hear of a change
only once it is committed. The tenant methods (reservations.py) and the
reconciler (reconciler.py) both go through here.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Any, Callable

import structlog

from controlplane.catalog import Catalog, encode_item
from controlplane.domain import node_states, states
from controlplane.domain.calendar import Booking
from controlplane.domain.clock import Clock
from controlplane.domain.model import Failure, Hold, Node, Operation, Placement, Reservation
from controlplane.domain.placement import Ask, place
from controlplane.domain.preemption import preempt, would_preempt
from controlplane.domain.timers import RETRY_MS
from controlplane.state import QueueKey, WriterState
from controlplane.store.port import Tx

@dataclass(frozen=True, slots=True)
class Moved:
    """A placed reservation moved off a node (a drain, or the node's maintenance)."""

    reservation_id: str
    tenant_id: str
    from_nodes: tuple[str, ...]
    to_nodes: tuple[str, ...]


log = structlog.get_logger("berth.reservations")

WAKE_ATTEMPTS = 64  # pending reservations tried per wake or retry of a pool
CARRY_STEP_MS = 5 * 60_000  # a held kubernetes booking is carried on past its window in steps of this
CARRY_MAX_MS = 24 * 3_600_000  # and for this long at most
# why placed reservations move off a node: what happened to it, the Unschedulable reason where nothing else fits
MOVES_OFF = {"drain": ("was drained", "NodeDrained"), "maintenance": ("went to maintenance", "NodeMaintenance"),
             "lost": ("was lost", "NodeLost")}


class CatalogRef:
    """The current catalog; replaced whole when an operator changes it."""

    def __init__(self, catalog: Catalog):
        self.current = catalog


def ask_of(res: Reservation, start: int, end: int) -> Ask:
    """What placement must find for the window [start, end) and a node binding's turnaround after it."""
    return Ask(
        gpu_count=res.gpu_count, node_count=res.node_count, share=res.resources, start=start,
        end=end + res.turnaround_ms,
        sharing=res.sharing, mig_profile=res.mig_profile, whole_node=res.binding == "node",
    )


class Transitions:
    def __init__(self, clock: Clock, catalog: CatalogRef, state: WriterState):
        self.clock = clock
        self.catalog = catalog
        self.state = state
        self.listeners: list[Callable[[Reservation], None]] = []  # called after the commit

    # ---- writing -----------------------------------------------------------------
    def save(self, tx: Tx, res: Reservation, from_state: str | None = None) -> bool:
        """Write the reservation (only if it is still in from_state, when given); False if it moved meanwhile."""
        if from_state is not None and res.seq:
            if not tx.move_if(res, from_state):
                return False
        else:
            tx.save_reservation(res)
        tx.touch()
        self.state.track(res)
        if self.listeners:
            # The object itself, not a copy: a job's reservation is its own (every job reads fresh from the
            # store), so after the commit it stands as the job left it.
            tx.on_commit(lambda: self.notify(res))
        return True

    def notify(self, res: Reservation) -> None:
        """Tell the listeners (watches, long polls) that res stands as it is now."""
        for listener in list(self.listeners):
            listener(res)

    @staticmethod
    def event(tx: Tx, res: Reservation, type_: str, now: int, **data: Any) -> None:
        payload = {"state": res.state, "poolId": res.pool_id, **data}
        if res.reason and res.state in states.TERMINAL:
            payload.setdefault("reason", res.reason)
        tx.event(res.tenant_id, res.id, type_, now, payload)

    def placer_of(self, res: Reservation) -> str:
        pool = self.catalog.current.pools.get(res.pool_id)
        return pool.policy.placer if pool else "calendar"

    # ---- the calendar ------------------------------------------------------------
    @staticmethod
    def window(res: Reservation, now: int) -> tuple[int, int]:
        if res.asap:
            return now, now + (res.duration_ms or 0)
        return max(res.start or now, now), res.end or now

    def try_place(self, tx: Tx, res: Reservation, now: int, may_preempt: bool = False) -> list[str] | None:
        """Book the reservation in its window if it fits; the spot reservations it preempted, or None."""
        start, end = self.window(res, now)
        if end <= start:
            return None
        catalog = self.catalog.current
        ask = ask_of(res, start, end)
        placements = place(self.state.calendar.pool(res.pool_id), catalog.nodes, ask)
        victims: list[str] = []
        read: list[Reservation | None] = []
        if placements is None and may_preempt and not res.spot:
            # The victims found by a dry run and read before the calendar changes: a job that cannot read them
            # (a speculative one, store/pg_writer.py) then stops with the memory as it was.
            victims = would_preempt(self.state.calendar, res.pool_id, catalog.nodes, ask,
                                    self.state.spot.get(res.pool_id, ())) or []
            if victims:
                read = [tx.reservation(v) for v in victims]
                tx.touch()  # preemption takes victims out of the calendar
                placements = preempt(self.state.calendar, res.pool_id, catalog.nodes, ask, victims)
        if placements is None:
            return None
        for victim in read:
            if victim is not None and victim.state not in states.TERMINAL:
                self.end(tx, victim, now, "preempted", actor="provider", preempted_by=res.id)
        self.book(tx, res, placements, start, end, catalog)
        return victims

    def book(self, tx: Tx, res: Reservation, placements: list[Placement], start: int, end: int, catalog: Catalog) -> None:
        bookings = []
        for p in placements:  # a node binding's bookings run on through its turnaround (cleaning, unbilled)
            share = catalog.nodes[p.node_id].capacity if res.binding == "node" else res.resources
            bookings.append(Booking(res.id, res.pool_id, p.node_id, tuple(p.units), start, end + res.turnaround_ms,
                                    share))
        tx.insert_bookings(bookings)
        tx.touch()
        for b in bookings:
            self.state.calendar.book(b)
        res.placements = placements
        if res.binding == "node":
            res.resources = bookings[0].share
        if res.asap:
            res.start, res.end = start, end

    def unbook(self, tx: Tx, res: Reservation, now: int) -> None:
        tx.end_bookings(res.id, now)
        tx.touch()
        self.state.calendar.release(res.id, now)

    def keep_for_turnaround(self, tx: Tx, res: Reservation, until: int) -> None:
        """A handed-over node binding ended early: its bookings (all started) now end at `until`, the end of its
        turnaround, and stay in the calendar so that nobody books the node while it is cleaned."""
        tx.end_bookings(res.id, until)
        tx.touch()
        self.state.calendar.set_end(res.id, until)

    def set_end(self, tx: Tx, res: Reservation, new_end: int) -> None:
        """Move the end of the reservation's bookings to the window's new end (and its turnaround after it)."""
        tx.set_bookings_end(res.id, new_end + res.turnaround_ms)
        tx.touch()
        self.state.calendar.set_end(res.id, new_end + res.turnaround_ms)

    def room(self, res: Reservation, new_end: int) -> int:
        """The latest window end up to new_end that the reservation's devices and host shares can reach (a node
        binding's turnaround must fit after it)."""
        return self._room(res, new_end + res.turnaround_ms) - res.turnaround_ms

    def _room(self, res: Reservation, new_end: int) -> int:
        latest = self.state.calendar.latest_end(res.id, new_end)
        catalog = self.catalog.current
        for b in self.state.calendar.bookings_of(res.id):
            node = catalog.nodes.get(b.node_id)
            cal = self.state.calendar.pools[b.pool_id].nodes[b.node_id]
            if node is None or b.share.empty or cal.host_fits(b.end, latest, b.share, node.capacity):
                continue
            starts = sorted({h.start for h in cal.overlapping(b.end, latest) if b.end < h.start} | {latest})
            room = b.end
            for s in starts:
                if not cal.host_fits(b.end, s, b.share, node.capacity):
                    break
                room = s
            latest = min(latest, room)
        return latest

    # ---- moves ---------------------------------------------------------------------
    def place_or_queue(self, tx: Tx, res: Reservation, now: int) -> None:
        """A freshly admitted reservation (charge held): placed, or pending/queued; saved with its event."""
        old = res.state
        pool_lease = self.placer_of(res) == "pool-lease"
        # Preemption of spot work comes first under both placers (000); the pool-lease queue keeps its order:
        # a request arriving behind a queue waits in it.
        behind_queue = pool_lease and bool(self.state.queue(res.pool_id))
        victims = None if behind_queue else self.try_place(tx, res, now, may_preempt=True)
        if victims is not None:
            states.move(res, states.PLACED, now)
            self._placed(res, now)
            self.save(tx, res, old)
            self.event(tx, res, states.EVENT_OF_STATE[states.PLACED], now, **({"preempted": victims} if victims else {}))
            return
        states.move(res, states.PENDING, now)
        if pool_lease:
            position = self.state.queue_position(res)
            res.set_condition("Queued", "True", "WaitingForCapacity",
                              f"number {position} in pool {res.pool_id}'s queue; placed in order as capacity frees", now)
            event = "reservation.queued"
        else:
            res.set_condition("Unschedulable", "True", "NoFit",
                              f"no {res.gpu_count} x {res.gpu_model} fit in pool {res.pool_id} for the window; "
                              "retried every 30 s and when capacity frees", now)
            event = "reservation.pending"
        self.save(tx, res, old)
        self.state.timers.retry_pool(res.pool_id, now + RETRY_MS)
        self.event(tx, res, event, now)

    def _placed(self, res: Reservation, now: int) -> None:
        res.clear_condition("Unschedulable")
        res.clear_condition("Queued")
        if res.lease_seconds:
            res.lease_deadline = now + res.lease_seconds * 1000  # the lease runs from placement

    def place_pending(self, tx: Tx, pool_id: str, attempts: int = WAKE_ATTEMPTS) -> list[str]:
        """Try the pool's pending reservations oldest first; the ids placed.

        The calendar placer backfills (a later request that fits goes ahead);
        the pool-lease placer keeps its queue's order: nothing passes the head.
        """
        queue = self.state.queue(pool_id)
        now = self.clock.compute_now()
        placed: list[str] = []
        strict = False
        for rid in list(queue)[:attempts]:
            res = tx.reservation(rid)
            if res is None or res.state != states.PENDING:
                tx.touch()
                queue.pop(rid, None)
                continue
            strict = self.placer_of(res) == "pool-lease"
            victims = self.try_place(tx, res, now, may_preempt=True)
            if victims is None:
                if strict:
                    break
                continue
            states.move(res, states.PLACED, now)
            self._placed(res, now)
            self.save(tx, res, states.PENDING)
            self.event(tx, res, states.EVENT_OF_STATE[states.PLACED], now, **({"preempted": victims} if victims else {}))
            placed.append(rid)
        if strict:
            self._renumber(tx, queue, now)
        if queue:
            self.state.timers.retry_pool(pool_id, now + RETRY_MS)
        return placed

    def _renumber(self, tx: Tx, queue: dict[str, QueueKey], now: int) -> None:
        for position, rid in enumerate(list(queue)[:WAKE_ATTEMPTS], start=1):
            res = tx.reservation(rid)
            if res is None or res.state != states.PENDING:
                continue
            message = f"number {position} in pool {res.pool_id}'s queue; placed in order as capacity frees"
            if any(c.type == "Queued" and c.message == message for c in res.conditions):
                continue
            res.set_condition("Queued", "True", "WaitingForCapacity", message, now)
            self.save(tx, res)

    def start_binding(self, tx: Tx, res: Reservation, now: int) -> bool:
        """placed -> binding at the window's start; the nodes' agents are to bind the devices (or, where a node of
        it is lost, it ends at once as one lost while binding does)."""
        catalog = self.catalog.current
        states.move(res, states.BINDING, now)
        without_agent = [p.node_id for p in res.placements if catalog.nodes.get(p.node_id) and catalog.nodes[p.node_id].declared]
        if without_agent:
            res.set_condition("DevicesBound", "False", "NoAgent",
                              f"node {', '.join(without_agent)} has no agent connected: its devices cannot be bound "
                              "until its agent registers", now)
        else:
            res.set_condition("DevicesBound", "False", "Binding", "waiting for the nodes' agents to bind the devices", now)
        if not self.save(tx, res, states.PLACED):
            return False
        self.event(tx, res, states.EVENT_OF_STATE[states.BINDING], now)
        lost = [p.node_id for p in res.placements
                if catalog.nodes.get(p.node_id) and not catalog.nodes[p.node_id].schedulable]
        if lost:  # lost while it waited for its window: as one lost while binding (nothing binds there)
            self.end(tx, res, now, "node-lost", actor="platform", nodeId=lost[0])
        return True

    @staticmethod
    def devices_bound(res: Reservation, now: int) -> None:
        res.set_condition("DevicesBound", "True", "Bound", "every node reported the devices bound", now)

    def mark_active(self, tx: Tx, res: Reservation, now: int) -> bool:
        """binding -> active once every node reported the devices bound; the create operation succeeds."""
        states.move(res, states.ACTIVE, now)
        self.devices_bound(res, now)
        res.billing_start = now  # confirmed readiness: billing starts
        tx.bill_from(res, now)
        op = res.create_operation()
        if op is not None and op.status == "running":
            op.status, op.updated_at = "succeeded", now
        if not self.save(tx, res, states.BINDING):
            return False
        self.event(tx, res, states.EVENT_OF_STATE[states.ACTIVE], now)
        return True

    def end(self, tx: Tx, res: Reservation, now: int, reason: str, actor: str = "customer",
            kind: str | None = None, **event_data: Any) -> Operation | None:
        """End a live reservation now: released, or cancelled if it never started (pending, or a cancel).

        `reason` goes on the reservation and its event; `kind` names the
        operation recorded for the mutation that ended it (release, cancel):
        it runs until every node that reported the devices bound reports them
        unbound (succeeded at once when none had). A create operation still
        running ends cancelled (the customer's doing) or failed (`actor`
        provider or platform).
        """
        old = res.state
        target = states.CANCELLED if old == states.PENDING or reason in ("cancel", "expired") else states.RELEASED
        held = res.binding == "kubernetes" and bool(res.bound) and reason != "node-lost" and res.end is not None
        # billing stops where the tenant's time did: a lease at its deadline, even when its lapse is seen late (a
        # control plane that was down), as a window at its end
        stop = min(now, res.lease_deadline) if reason == "lease-lapsed" and res.lease_deadline is not None else now
        stop = max(stop, res.billing_start or stop)  # never before billing began (a bound report seen first)
        if old == states.ACTIVE and held and stop < res.end:
            res.held_from = stop  # the devices stay booked and billed, as held time, until the pods let go
        elif old == states.ACTIVE:  # confirmed release: billing stops, at the window's end at the latest
            res.billing_end = min(stop, res.end) if res.end is not None else stop
            tx.bill_until(res.id, res.billing_end)
        if held:
            self._hold(res, now)
        elif old in (states.BINDING, states.ACTIVE) and res.turnaround_ms:
            # handed over: cleaned before reuse, within the turnaround booked after the window (an end seen late,
            # as a timer's always is, must not reach into the node's next booking)
            ended = min(now, res.end) if res.end is not None else now
            self.keep_for_turnaround(tx, res, ended + res.turnaround_ms)
        elif old in states.BOOKED:
            self.unbook(tx, res, now)
        if old in states.CHARGED:
            tx.touch()
            self.state.ledger.refund(res.tenant_id, res.charge)
        states.move(res, target, now, reason)
        # what it waited for, and a lost node it held (the node's return clears NodeLost only on live ones)
        for cond in ("Unschedulable", "Queued", "NodeLost"):
            res.clear_condition(cond)
        res.pending_change = None
        if res.bound:
            res.set_condition("DevicesBound", "False", "Unbinding",
                              f"waiting for node {', '.join(b.node_id for b in res.bound)} to unbind the devices", now)
        else:
            res.clear_condition("DevicesBound")
        create_op = res.create_operation()
        if create_op is not None and create_op.status == "running":
            create_op.status = "cancelled" if actor == "customer" else "failed"
            create_op.updated_at = now
            create_op.failure = ending_failure(reason, actor)
        for ext in res.operations:  # an extension the nodes had not applied yet: the end overtook it
            if ext.kind == "extend" and ext.status == "running":
                ext.status, ext.updated_at = ("cancelled" if actor == "customer" else "failed"), now
                ext.failure = overtaken_extension(reason, actor)
        op = None
        if kind is not None:
            op = res.add_operation(kind, "running" if res.bound else "succeeded", now)
        elif create_op is not None and res.operation_id == create_op.id:
            op = create_op
        if not self.save(tx, res, old):
            return None
        self.event(tx, res, states.EVENT_OF_STATE[res.state], now, reason=reason, **event_data)
        return op


    # ---- the release hold (binding: kubernetes) ---------------------------------------------
    @staticmethod
    def _hold(res: Reservation, now: int) -> None:
        nodes = [b.node_id for b in res.bound]
        res.hold = Hold(since=now, nodes=nodes, until=res.end or now)
        res.set_condition("DevicesHeld", "True", "ReleaseHold",
                          f"node {', '.join(nodes)} withdrew the devices from the kubelet; they stay booked"
                          + (" and billed" if res.held_from is not None else "")
                          + " until the node reports that no pod holds them (AllocationReleased)", now)

    def held(self, res: Reservation, node_id: str, holders: list[str], now: int) -> None:
        """A node reports the pods that still hold the devices of a released reservation."""
        hold = res.hold
        if hold is None or node_id not in hold.nodes:
            return
        hold.holders[node_id] = holders
        self._held_condition(res, now)

    @staticmethod
    def _held_condition(res: Reservation, now: int) -> None:
        hold = res.hold
        assert hold is not None
        pods = sorted({p for ps in hold.holders.values() for p in ps})
        who = (f"pod(s) {', '.join(pods[:10])}" + (f" and {len(pods) - 10} more" if len(pods) > 10 else "")
               if pods else f"pods on node {', '.join(hold.nodes)}")
        billed = " and billed" if res.held_from is not None and hold.carried_from is None else ""
        carried = " (carried on past the window in 5-minute steps, unbilled)" if hold.carried_from is not None else ""
        res.set_condition("DevicesHeld", "True", "PodsHoldDevices",
                          f"{who} still hold the devices; they stay booked{billed} until no pod holds them{carried}",
                          now)

    def allocation_released(self, tx: Tx, res: Reservation, node_id: str, now: int, reason: str = "AllocationReleased",
                            message: str = "") -> bool:
        """A node of a held reservation has no pod holding its devices any more (or is lost); True when that ended
        the hold (its bookings and billing end now)."""
        hold = res.hold
        if hold is None or node_id not in hold.nodes:
            return False
        hold.nodes.remove(node_id)
        hold.holders.pop(node_id, None)
        if hold.nodes:
            return False
        self.end_hold(tx, res, now, reason, message or f"node {node_id} reports that no pod holds the devices")
        return True

    def end_hold(self, tx: Tx, res: Reservation, now: int, reason: str, message: str) -> None:
        """The hold is over: the bookings end now (at their current end at the latest), held time stops billing."""
        hold = res.hold
        if hold is None:
            return
        stop = min(now, hold.until)
        if res.held_from is not None and hold.carried_from is None and res.billing_end is None:
            res.billing_end = min(now, res.end or now)
            tx.bill_until(res.id, res.billing_end)
        self.unbook(tx, res, stop)
        res.hold = None
        res.set_condition("DevicesHeld", "False", reason, message, now)
        self.save(tx, res)
        self.event(tx, res, "reservation.hold-ended", now, reason=reason)

    def carry_on(self, tx: Tx, res: Reservation, now: int) -> str | None:
        """At the bookings' end, pods still hold the devices: carry the bookings on by one step while the devices
        are free (unbilled), up to CARRY_MAX_MS past the window; the pool to wake when that ended the hold."""
        hold = res.hold
        if hold is None or now < hold.until or res.end is None:
            return None
        limit = res.end + CARRY_MAX_MS
        if hold.until >= limit:
            pods = sorted({p for ps in hold.holders.values() for p in ps})
            stuck = list(hold.nodes)
            why = (f"pods still held the devices of {res.id} {CARRY_MAX_MS // 3_600_000} h after the window's end"
                   + (f" ({', '.join(pods[:10])})" if pods else ""))
            self.end_hold(tx, res, now, "CarryOnLimit", why + "; the booking ended anyway")
            for node_id in stuck:  # the node cannot free what it was given back: an operator looks at it
                self.to_maintenance(tx, node_id, "KubernetesReleaseStuck", why, now)
            return res.pool_id
        until = self.room(res, min(hold.until + CARRY_STEP_MS, limit))
        if until <= hold.until:
            self.end_hold(tx, res, now, "Overtaken", "a booking made for these devices starts now: the node evicts "
                          "the pods still holding them")
            return res.pool_id
        first = hold.carried_from is None
        if first:
            hold.carried_from = res.end
            if res.held_from is not None and res.billing_end is None:
                res.billing_end = res.end  # the carry-on is not billed
                tx.bill_until(res.id, res.end)
        tx.set_bookings_end(res.id, until)
        tx.touch()
        self.state.calendar.set_end(res.id, until)
        hold.until = until
        self._held_condition(res, now)
        self.save(tx, res)
        if first:
            self.event(tx, res, "reservation.carried-on", now, until=until)
        return None

    def to_maintenance(self, tx: Tx, node_id: str, reason: str, message: str, now: int) -> None:
        """The platform takes a node out of placement until an operator clears it (`berth admin nodes clear`);
        what was placed there and has not started moves to other nodes (or back to pending), as on a drain."""
        node = self.catalog.current.nodes.get(node_id)
        if node is None or node.state == node_states.MAINTENANCE:
            return
        self.put_node(tx, replace(node, state=node_states.MAINTENANCE, state_reason=f"{reason}: {message}",
                                  cleaning=None))
        moved, pending = self.move_off(tx, node, now, "maintenance")
        tx.event(node_states.FLEET_EVENTS, None, "node.maintenance", now,
                 {"nodeId": node_id, "poolId": node.pool_id, "state": node_states.MAINTENANCE, "from": node.state,
                  "by": "platform", "reason": reason, "message": message,
                  **({"moved": len(moved), "pending": len(pending)} if moved or pending else {})})
        log.warning("node to maintenance", node_id=node_id, reason=reason, message=message, moved=len(moved),
                    pending=len(pending))

    def placed_ahead(self, node: Node, now: int) -> list[str]:
        """The reservations booked on the node whose bookings start after now, in the calendar's order."""
        cal = self.state.calendar.pool(node.pool_id).nodes.get(node.id)
        if cal is None:
            return []
        return list(dict.fromkeys(hb.owner for hb in cal.host[bisect_left(cal.host_starts, now + 1):]))

    def fits_elsewhere(self, res: Reservation, now: int) -> bool:
        """Whether the reservation, taken out of its own bookings, would be placed again (spot work it may preempt
        counted): a dry run on the calendar, which is put back as it was."""
        start, end = self.window(res, now)
        if end <= start:
            return False
        calendar, nodes, ask = self.state.calendar, self.catalog.current.nodes, ask_of(res, start, end)
        removed = calendar.remove(res.id)
        try:
            if place(calendar.pool(res.pool_id), nodes, ask) is not None:
                return True
            return not res.spot and bool(would_preempt(calendar, res.pool_id, nodes, ask,
                                                       self.state.spot.get(res.pool_id, ())))
        finally:
            for booking in removed:
                calendar.book(booking)

    def move_off(self, tx: Tx, node: Node, now: int, why: str,
                 keep: bool = False) -> tuple[list["Moved"], list[str]]:
        """Move the node's placed reservations that have not started to other nodes (the placement of a create:
        gangs whole, spot work preempted for work that is not spot), or back to pending where nothing fits; `why`:
        drain, maintenance or lost. With `keep`, one that fits nowhere else stays where it is (a lost node may be
        back before its window), and the second list holds those kept (none goes back to pending)."""
        moved: list[Moved] = []
        pending: list[str] = []
        for rid in self.placed_ahead(node, now):
            res = tx.reservation(rid)
            if res is None or res.state != states.PLACED or (res.start or 0) <= now:
                continue  # started (the reconciler moves it to binding): it runs here to its end
            if keep and not self.fits_elsewhere(res, now):
                pending.append(res.id)
                continue
            before = tuple(p.node_id for p in res.placements)
            self.unbook(tx, res, now)
            res.placements = []
            res.clear_condition("DevicesLost")  # of the node it leaves
            if self.try_place(tx, res, now, may_preempt=True) is not None:
                res.updated_at = now
                self.save(tx, res, states.PLACED)
                to = tuple(p.node_id for p in res.placements)
                self.event(tx, res, "reservation.moved", now, nodeId=node.id, fromNodes=list(before), nodes=list(to),
                           reason=why)
                moved.append(Moved(res.id, res.tenant_id, before, to))
                log.info("reservation moved off a node", reservation_id=res.id, node_id=node.id, to=to, why=why)
                continue
            self._back_to_pending(tx, res, node, now, why)
            self.event(tx, res, "reservation.pending", now, nodeId=node.id, fromNodes=list(before), reason=why)
            pending.append(res.id)
            log.warning("reservation back to pending: nothing else fits it", reservation_id=res.id, node_id=node.id,
                        why=why)
        return moved, pending

    def _back_to_pending(self, tx: Tx, res: Reservation, node: Node, now: int, why: str) -> None:
        states.move(res, states.PENDING, now)
        res.lease_deadline = None  # the lease runs from placement
        happened, reason = MOVES_OFF[why]
        if self.placer_of(res) == "pool-lease":
            position = self.state.queue_position(res)
            res.set_condition("Queued", "True", "WaitingForCapacity",
                              f"number {position} in pool {res.pool_id}'s queue (node {node.id} {happened}); placed "
                              "in order as capacity frees", now)
        else:
            res.set_condition("Unschedulable", "True", reason,
                              f"node {node.id} {happened} and no other node of pool {res.pool_id} fits the window; "
                              "retried every 30 s and when capacity frees", now)
        self.save(tx, res, states.PLACED)
        self.state.timers.retry_pool(res.pool_id, now + RETRY_MS)

    def put_node(self, tx: Tx, node: Node) -> None:
        """Write a changed node to the catalog (the store and the snapshot placement reads)."""
        catalog = self.catalog.current
        tx.put_catalog("node", node.id, encode_item(node))
        tx.touch()
        self.catalog.current = catalog.with_changes(nodes={**catalog.nodes, node.id: node})

    @staticmethod
    def confirm(res: Reservation, now: int) -> None:
        """The nodes confirmed what the running operations asked: a release or cancel when nothing is bound any
        more, an extension when every bound node applied the new end."""
        for op in res.operations:
            if op.status != "running" or op.kind == "create":
                continue
            if op.kind in ("release", "cancel") and not res.bound:
                op.status, op.updated_at = "succeeded", now
                res.clear_condition("DevicesBound")
            elif op.kind == "extend" and all(b.end is not None and b.end >= (res.end or 0) for b in res.bound):
                op.status, op.updated_at = "succeeded", now
        if not res.bound and res.state in states.TERMINAL:  # an end with no operation (the window's, a lapse)
            res.clear_condition("DevicesBound")  # Unbinding is over: no node holds the devices


def overtaken_extension(reason: str, actor: str) -> Failure:
    """An extend still running (a node had not applied the new end) when the reservation ended."""
    return Failure(f"reservation_ended:{reason}", actor,
                   f"The reservation ended ({reason}) before every node applied the new end. Billing stopped when it "
                   "ended.", "Nothing to undo. Create a new reservation, with a new idempotency key, if you still "
                   "need the devices.")


def ending_failure(reason: str, actor: str) -> Failure:
    again = ("Create again with a new idempotency key (the old one replays this failed reservation), or contact "
             "support with the operation id.")
    messages = {
        "release": ("released", "The reservation was released before its devices were ready. Nothing was billed.",
                    "Create a new reservation, with a new idempotency key, when you need the devices."),
        "cancel": ("cancelled", "The reservation was cancelled before it started. Nothing was billed.",
                   "Create a new reservation, with a new idempotency key, when you need the devices."),
        "expired": ("provider_rejected:no_capacity", "The window passed before the devices could be placed: no "
                    "capacity for this shape in it. Nothing was billed.",
                    "Request a fresh quote, perhaps for another window, region or shape."),
        "preempted": ("provider_rejected:preempted", "Spot capacity was taken back for a reservation that is not spot.",
                      "Retry later with a new idempotency key, or book without spot."),
        "lease-lapsed": ("lease_lapsed", "The lease was not renewed within leaseSeconds.",
                         "Renew within leaseSeconds, or create again (a new idempotency key) without a lease."),
        "node-lost": ("node_lost", "The node was lost before the devices were ready. Nothing was billed.", again),
        # the keys were checked at the create: what failed is the node's (no such user, an unsafe keys directory)
        "handover-failed": ("handover_failed", "The node could not be handed over (the tenant's keys could not be "
                            "installed). Nothing was billed.", "Nothing in your request needs to change: the "
                            "node's message says what its operator must fix. " + again),
        "ended": ("devices_not_bound", "The window ended before the node reported the devices bound. Nothing was "
                  "billed.", again),
    }
    code, message, nxt = messages.get(reason, (reason, f"The reservation ended: {reason}.", "Create a new reservation."))
    return Failure(code, actor, message, nxt)
