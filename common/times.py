"""Instants as people and programs read them: epoch milliseconds as ISO 8601 UTC with milliseconds."""
from __future__ import annotations

import time


def iso(ms: int) -> str:
    """1767225600123 -> '2026-01-01T00:00:00.123Z'."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"
