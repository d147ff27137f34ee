"""The booking calendar: who holds which device and how much of each host, over time.

Per device a sorted list of non-overlapping [start, end) bookings, so "is this
device free in [s, e)" is one bisection whatever the size of the calendar; per
node the host-resource bookings (vcpu, memory, hugepages) that ride along.
The calendar is plain memory owned by the store's single writer: it is
rebuilt from the stored bookings at start and changed only after the
transaction that records a change has been written.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

from common.share import NO_SHARE, Share


class DeviceTimeline:
    """Bookings of one device, sorted and never overlapping (so ends are sorted too)."""

    __slots__ = ("starts", "ends", "owners")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.owners: list[str] = []

    def is_free(self, start: int, end: int) -> bool:
        j = bisect_left(self.starts, end)
        return j == 0 or self.ends[j - 1] <= start

    def next_start_after(self, t: int, owner: str | None = None) -> int | None:
        """Start of the first booking beginning at or after t, other than owner's."""
        j = bisect_left(self.starts, t)
        while j < len(self.starts):
            if self.owners[j] != owner:
                return self.starts[j]
            j += 1
        return None

    def add(self, start: int, end: int, owner: str) -> None:
        if not self.is_free(start, end):
            raise ValueError(f"overlapping booking [{start}, {end}) for {owner}")
        i = bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.owners.insert(i, owner)

    def _index(self, start: int, owner: str) -> int:
        i = bisect_left(self.starts, start)
        while i < len(self.starts) and self.starts[i] == start:
            if self.owners[i] == owner:
                return i
            i += 1
        raise KeyError((start, owner))

    def remove(self, start: int, owner: str) -> None:
        i = self._index(start, owner)
        del self.starts[i], self.ends[i], self.owners[i]

    def set_end(self, start: int, owner: str, end: int) -> None:
        i = self._index(start, owner)
        nxt = self.starts[i + 1] if i + 1 < len(self.starts) else None
        if nxt is not None and end > nxt:
            raise ValueError(f"end {end} of {owner} would overlap the booking starting {nxt}")
        self.ends[i] = end

    def __len__(self) -> int:
        return len(self.starts)


@dataclass(slots=True)
class HostBooking:
    start: int
    end: int
    share: Share
    owner: str


class NodeCalendar:
    """The devices and host resources of one node over time.

    Host bookings are kept sorted by start beside the longest booking the node
    has held, so the bookings that can overlap [s, e) are the ones starting in
    [s - longest, e): two bisections, whatever the node's history.
    """

    __slots__ = ("node_id", "devices", "host", "host_starts", "longest", "count")

    def __init__(self, node_id: str, unit_ids: Iterable[str]):
        self.node_id = node_id
        self.devices: dict[str, DeviceTimeline] = {u: DeviceTimeline() for u in unit_ids}
        self.host: list[HostBooking] = []  # sorted by start
        self.host_starts: list[int] = []  # the starts of `host`, for bisection
        self.longest = 0  # the longest host booking ever held here (never shrinks: a bound, not a measure)
        self.count = 0  # live bookings (one per reservation on this node)

    # -- the host bookings' index ---------------------------------------------------
    def add_host(self, booking: HostBooking) -> None:
        i = bisect_right(self.host_starts, booking.start)
        self.host.insert(i, booking)
        self.host_starts.insert(i, booking.start)
        self.longest = max(self.longest, booking.end - booking.start)

    def _host_index(self, owner: str, start: int) -> int:
        i = bisect_left(self.host_starts, start)
        while i < len(self.host) and self.host_starts[i] == start:
            if self.host[i].owner == owner:
                return i
            i += 1
        raise KeyError((owner, start))

    def remove_host(self, owner: str, start: int) -> None:
        i = self._host_index(owner, start)
        del self.host[i], self.host_starts[i]

    def set_host_end(self, owner: str, start: int, end: int) -> None:
        self.host[self._host_index(owner, start)].end = end
        self.longest = max(self.longest, end - start)

    def owners(self) -> list[str]:
        """The reservations booked on the node, each once, in the order of their bookings' starts."""
        return list(dict.fromkeys(b.owner for b in self.host))

    def overlapping(self, start: int, end: int) -> list[HostBooking]:
        """The host bookings that cover some instant of [start, end)."""
        lo = bisect_left(self.host_starts, start - self.longest)
        hi = bisect_left(self.host_starts, end, lo)
        return [b for b in self.host[lo:hi] if b.end > start]

    # -- questions ------------------------------------------------------------------------
    def host_peak(self, start: int, end: int) -> Share:
        """The most host resources booked at any instant of [start, end)."""
        overlapping = [b for b in self.overlapping(start, end) if not b.share.empty]
        if not overlapping:
            return NO_SHARE
        if len(overlapping) == 1:
            return overlapping[0].share
        points: list[tuple[int, int, Share]] = []
        for b in overlapping:
            points.append((max(b.start, start), 1, b.share))
            points.append((b.end, 0, b.share))
        points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at the same instant
        cpu = mem = hp = 0
        peak_cpu = peak_mem = peak_hp = 0
        for _, is_start, s in points:
            sign = 1 if is_start else -1
            cpu += sign * s.vcpu_milli
            mem += sign * s.memory_mib
            hp += sign * s.hugepages_1g
            peak_cpu, peak_mem, peak_hp = max(peak_cpu, cpu), max(peak_mem, mem), max(peak_hp, hp)
        return Share(peak_cpu, peak_mem, peak_hp)

    def host_fits(self, start: int, end: int, share: Share, capacity: Share) -> bool:
        if share.empty:
            return True
        overlapping = self.overlapping(start, end)
        # The sum of every overlapping booking bounds the peak: when even that fits, no sweep is needed.
        cpu, mem, hp = share.vcpu_milli, share.memory_mib, share.hugepages_1g
        for b in overlapping:
            cpu += b.share.vcpu_milli
            mem += b.share.memory_mib
            hp += b.share.hugepages_1g
        if cpu <= capacity.vcpu_milli and mem <= capacity.memory_mib and hp <= capacity.hugepages_1g:
            return True
        peak = self.host_peak(start, end)
        return Share(
            peak.vcpu_milli + share.vcpu_milli, peak.memory_mib + share.memory_mib, peak.hugepages_1g + share.hugepages_1g
        ).fits_in(capacity)

    def host_busy(self, start: int, end: int) -> bool:
        return bool(self.overlapping(start, end))


@dataclass(slots=True)
class Booking:
    """One reservation's hold on one node: its units and host share over [start, end)."""

    reservation_id: str
    pool_id: str
    node_id: str
    units: tuple[str, ...]
    start: int
    end: int
    share: Share


class PoolCalendar:
    """The nodes of one pool, with the ones holding bookings kept in recently-booked order."""

    __slots__ = ("pool_id", "nodes", "in_use", "idle")

    def __init__(self, pool_id: str):
        self.pool_id = pool_id
        self.nodes: dict[str, NodeCalendar] = {}
        self.in_use: OrderedDict[str, None] = OrderedDict()  # most recently booked last
        self.idle: dict[str, None] = {}  # nodes without any live booking, in insertion order

    def add_node(self, node_id: str, unit_ids: Iterable[str]) -> NodeCalendar:
        cal = self.nodes.get(node_id)
        if cal is None:
            cal = self.nodes[node_id] = NodeCalendar(node_id, unit_ids)
            self.idle[node_id] = None
        else:
            for u in unit_ids:
                cal.devices.setdefault(u, DeviceTimeline())
        return cal

    def _booked(self, node_id: str, full: bool = False) -> None:
        """A booking was added: the node is in use, and the most recently booked unless the booking filled it
        (then it goes last in the search, so the next placement does not try it first)."""
        self.idle.pop(node_id, None)
        self.in_use[node_id] = None
        self.in_use.move_to_end(node_id, last=not full)

    def _unbooked(self, node_id: str) -> None:
        if self.nodes[node_id].count == 0:
            self.in_use.pop(node_id, None)
            self.idle[node_id] = None


class Calendar:
    """All pools' bookings, and each reservation's bookings for release and extension."""

    def __init__(self) -> None:
        self.pools: dict[str, PoolCalendar] = {}
        self.by_reservation: dict[str, list[Booking]] = {}

    def pool(self, pool_id: str) -> PoolCalendar:
        cal = self.pools.get(pool_id)
        if cal is None:
            cal = self.pools[pool_id] = PoolCalendar(pool_id)
        return cal

    def add_node(self, pool_id: str, node_id: str, unit_ids: Iterable[str]) -> None:
        self.pool(pool_id).add_node(node_id, unit_ids)

    def book(self, booking: Booking) -> None:
        pool = self.pool(booking.pool_id)
        node = pool.nodes[booking.node_id]
        done: list[str] = []
        try:
            for u in booking.units:
                node.devices[u].add(booking.start, booking.end, booking.reservation_id)
                done.append(u)
        except ValueError:
            for u in done:
                node.devices[u].remove(booking.start, booking.reservation_id)
            raise
        node.add_host(HostBooking(booking.start, booking.end, booking.share, booking.reservation_id))
        node.count += 1
        full = not any(tl.is_free(booking.start, booking.end) for tl in node.devices.values())
        pool._booked(node.node_id, full)
        self.by_reservation.setdefault(booking.reservation_id, []).append(booking)

    def bookings_of(self, reservation_id: str) -> list[Booking]:
        return list(self.by_reservation.get(reservation_id, ()))

    def _drop(self, booking: Booking) -> None:
        pool = self.pools[booking.pool_id]
        node = pool.nodes[booking.node_id]
        for u in booking.units:
            node.devices[u].remove(booking.start, booking.reservation_id)
        node.remove_host(booking.reservation_id, booking.start)
        node.count -= 1
        pool._unbooked(node.node_id)

    def remove(self, reservation_id: str) -> list[Booking]:
        """Take all of a reservation's bookings out; book() each again to undo."""
        removed = self.by_reservation.pop(reservation_id, [])
        for b in removed:
            self._drop(b)
        return removed

    def release(self, reservation_id: str, at: int) -> list[Booking]:
        """End the reservation's bookings at `at`: those not yet started vanish, running ones are cut.

        Returns the bookings as they stand afterwards (cut ones kept, ending at `at`),
        and forgets the reservation: the calendar holds only what can still block someone.
        """
        kept: list[Booking] = []
        for b in self.by_reservation.pop(reservation_id, ()):
            self._drop(b)
            if b.start < at < b.end:
                kept.append(Booking(b.reservation_id, b.pool_id, b.node_id, b.units, b.start, at, b.share))
            elif b.end <= at:
                kept.append(b)
        return kept

    def set_end(self, reservation_id: str, end: int) -> None:
        """Move the end of all bookings of a reservation (the caller checked that it is free)."""
        for b in self.by_reservation.get(reservation_id, ()):
            node = self.pools[b.pool_id].nodes[b.node_id]
            for u in b.units:
                node.devices[u].set_end(b.start, reservation_id, end)
            node.set_host_end(reservation_id, b.start, end)
            b.end = end

    def latest_end(self, reservation_id: str, limit: int) -> int:
        """The latest end up to `limit` that the reservation's bookings can reach without overlap.

        For device bookings the next booking of each device bounds it; host
        resources are bounded by the next moment the node could not carry the share.
        """
        best = limit
        for b in self.by_reservation.get(reservation_id, ()):
            node = self.pools[b.pool_id].nodes[b.node_id]
            for u in b.units:
                nxt = node.devices[u].next_start_after(b.end, reservation_id)
                if nxt is not None and nxt < best:
                    best = nxt
        return best

    def iter_bookings(self) -> Iterator[Booking]:
        for bookings in self.by_reservation.values():
            yield from bookings

    def overlaps(self) -> list[tuple[str, str, str]]:
        """Every pair of reservations booking one device at once (for tests and checks)."""
        found = []
        for pool in self.pools.values():
            for node in pool.nodes.values():
                for uid, tl in node.devices.items():
                    for i in range(1, len(tl.starts)):
                        if tl.starts[i] < tl.ends[i - 1]:
                            found.append((f"{node.node_id}/{uid}", tl.owners[i - 1], tl.owners[i]))
        return found
