"""Waiting in tests for something another process or thread brings about (one poll loop for every test), and for
a process the test started to end."""
from __future__ import annotations

import signal
import subprocess
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition", *,
             interval: float = 0.02) -> T:
    """Calls `predicate` every `interval` s until it returns something true, and returns that.

    After `timeout` s an AssertionError names `what`, so a failing test says what never happened.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen | None, grace_s: float = 20.0) -> int | None:
    """SIGTERM to `proc` alone (as `systemctl stop` sends it with KillMode=process), then SIGKILL after `grace_s`;
    its exit status, or None where nothing was started."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
