"""GPU health: which GPUs and MIG devices are unwell, and why, from NVML's XID and ECC events.

Two halves. `HealthPolicy` is plain policy: it takes events and answers
`health_of(gpu, gi, ci)`; it ignores the XIDs that application faults
cause, marks a whole GPU or (by GPU and compute instance id) one MIG
device, lets a mark lapse after a quiet time (injectable clock) and clears
it on an operator's word. `XidWatcher` is the loop: it waits on an
EventSource (`agent.nvml.NvmlEvents` on a real host, `ScriptedEvents` in
tests) with a bounded timeout, feeds the policy and calls back on change.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import structlog

from common.inventory import HEALTHY, Health

log = structlog.get_logger(__name__)

# XIDs caused by the application running on the GPU, not by the GPU: a user's
# bad kernel must not take the device out of service (the same list as the
# Kubernetes device plugin): 13 graphics engine exception, 31 GPU memory page
# fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor
# exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

XID_REASONS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


@dataclass(frozen=True, slots=True)
class XidEvent:
    gpu_uuid: str | None  # None: the event named a device the source does not know
    kind: str  # "xid", "ecc-dbe", or "event-0x..." for others
    xid: int | None = None
    gpu_instance_id: int | None = None  # set (with compute_instance_id) for an event on one MIG device
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """A GPU (gi and ci None), a GPU instance (ci None) or one MIG device."""

    gpu_uuid: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    def covers(self, gi: int | None, ci: int | None) -> bool:
        if self.gpu_instance_id is None:
            return True
        if gi != self.gpu_instance_id:
            return False
        return self.compute_instance_id is None or ci == self.compute_instance_id


@dataclass(frozen=True, slots=True)
class Mark:
    target: Target
    xid: int | None
    reason: str
    since_ms: int
    last_seen: float  # on the policy's clock
    count: int = 1


class HealthPolicy:
    """Which devices are unhealthy. Thread-safe; `clock` (seconds, monotonic) and `wall_ms` are injectable.

    quiet_time_s: a mark lapses once no new event arrived for that long;
    None keeps every mark until an operator resets it.
    """

    def __init__(self, *, ignored_xids: Iterable[int] = APPLICATION_XIDS, quiet_time_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.ignored_xids = frozenset(ignored_xids)
        self.quiet_time_s = quiet_time_s
        self.clock = clock
        self.wall_ms = wall_ms
        self._marks: dict[Target, Mark] = {}
        self._lock = threading.Lock()

    def observe(self, event: XidEvent) -> Mark | None:
        """Take one event; the mark it made or renewed, or None when it says nothing about health."""
        if event.gpu_uuid is None:
            log.warning("health event for an unknown device", kind=event.kind, xid=event.xid)
            return None
        if event.kind == "xid":
            if event.xid in self.ignored_xids:
                log.info("application XID ignored", gpu=event.gpu_uuid, xid=event.xid)
                return None
            reason = f"XID {event.xid}" + (f": {XID_REASONS[event.xid]}" if event.xid in XID_REASONS else "")
        elif event.kind == "ecc-dbe":
            reason = "double-bit ECC error"
        else:
            return None
        gi = event.gpu_instance_id
        target = Target(event.gpu_uuid, gi, event.compute_instance_id if gi is not None else None)
        now = self.clock()
        with self._lock:
            old = self._marks.get(target)
            mark = Mark(target=target, xid=event.xid, reason=reason, since_ms=old.since_ms if old else self.wall_ms(),
                        last_seen=now, count=(old.count + 1) if old else 1)
            self._marks[target] = mark
        log.warning("device marked unhealthy", gpu=target.gpu_uuid, gi=target.gpu_instance_id,
                    ci=target.compute_instance_id, xid=event.xid, reason=reason)
        return mark

    def expire(self) -> list[Target]:
        """Drop the marks whose quiet time has passed; the targets that became healthy."""
        if self.quiet_time_s is None:
            return []
        now = self.clock()
        with self._lock:
            done = [t for t, m in self._marks.items() if now - m.last_seen >= self.quiet_time_s]
            for t in done:
                del self._marks[t]
        for t in done:
            log.info("device healthy again after quiet time", gpu=t.gpu_uuid, gi=t.gpu_instance_id,
                     ci=t.compute_instance_id)
        return done

    def reset(self, gpu_uuid: str, gpu_instance_id: int | None = None, compute_instance_id: int | None = None) -> int:
        """An operator's word: clear the marks on this GPU (all of them) or on one GPU instance / MIG device."""
        scope = Target(gpu_uuid, gpu_instance_id, compute_instance_id)
        with self._lock:
            done = [t for t in self._marks if t.gpu_uuid == gpu_uuid and (
                scope.gpu_instance_id is None or (t.gpu_instance_id is not None
                                                  and scope.covers(t.gpu_instance_id, t.compute_instance_id)))]
            for t in done:
                del self._marks[t]
        log.info("health reset by operator", gpu=gpu_uuid, gi=gpu_instance_id, ci=compute_instance_id, cleared=len(done))
        return len(done)

    def health_of(self, gpu_uuid: str, gpu_instance_id: int | None = None,
                  compute_instance_id: int | None = None) -> Health:
        """A GPU's health (gi None: only marks on the whole GPU) or a MIG device's (its own marks or the GPU's)."""
        self.expire()
        with self._lock:
            marks = [m for t, m in self._marks.items() if t.gpu_uuid == gpu_uuid and (
                t.gpu_instance_id is None if gpu_instance_id is None
                else t.covers(gpu_instance_id, compute_instance_id))]
        if not marks:
            return HEALTHY
        latest = max(marks, key=lambda m: m.last_seen)
        return Health(healthy=False, xid=latest.xid, reason=latest.reason, sinceMs=min(m.since_ms for m in marks))

    def marks(self) -> list[Mark]:
        with self._lock:
            return list(self._marks.values())


class EventSource(Protocol):
    def wait(self, timeout_ms: int) -> XidEvent | None: ...


class ScriptedEvents:
    """An EventSource that hands out a given list of events, then times out (for tests and simulated hosts)."""

    def __init__(self, events: Iterable[XidEvent] = ()) -> None:
        self._events = list(events)
        self._lock = threading.Lock()

    def wait(self, timeout_ms: int) -> XidEvent | None:
        with self._lock:
            if self._events:
                return self._events.pop(0)
        time.sleep(min(timeout_ms, 50) / 1000)
        return None


class XidWatcher:
    """The event loop: wait (bounded), feed the policy, call `on_change()` when a device's health changed."""

    def __init__(self, source: EventSource, policy: HealthPolicy, on_change: Callable[[], None] | None = None,
                 timeout_ms: int = 1000) -> None:
        self.source = source
        self.policy = policy
        self.on_change = on_change or (lambda: None)
        self.timeout_ms = timeout_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """One bounded wait; True when some device's health changed (a new mark, or marks that lapsed)."""
        changed = False
        try:
            event = self.source.wait(self.timeout_ms)
        except Exception as exc:  # an NVML error mid-wait (a GPU lost): let re-discovery find out what
            log.warning("event wait failed; asking for re-discovery", error=str(exc))
            event, changed = None, True
        if event is not None:
            mark = self.policy.observe(event)
            changed = changed or mark is not None
        if self.policy.expire():
            changed = True
        if changed:
            self.on_change()
        return changed

    def run(self) -> None:
        while not self._stop.is_set():
            self.poll()

    def start(self) -> "XidWatcher":
        self._thread = threading.Thread(target=self.run, name="berth-xid-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
