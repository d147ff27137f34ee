"""The one clock of the control plane (`compute_now()` in the seeds), in epoch milliseconds.

Everything that needs the time asks the app's Clock; tests pass a FakeClock
and move it forward instead of sleeping.
"""
from __future__ import annotations

import time


class Clock:
    """Wall-clock time in epoch milliseconds."""

    def compute_now(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock(Clock):
    """A clock that moves only when told to; `monotonic` follows it."""

    def __init__(self, now_ms: int = 1_800_000_000_000):
        self.now_ms = now_ms
        self._listeners: list = []

    def compute_now(self) -> int:
        return self.now_ms

    def monotonic(self) -> float:
        return self.now_ms / 1000

    def advance(self, ms: int) -> int:
        self.now_ms += ms
        for listener in list(self._listeners):
            listener(self.now_ms)
        return self.now_ms

    def on_advance(self, listener) -> None:
        """Call listener(now_ms) after every advance (a reconciler wakes on it)."""
        self._listeners.append(listener)


HOUR_MS = 3_600_000
MINUTE_MS = 60_000
