"""Instants as people and programs read them: epoch milliseconds as ISO 8601 UTC, the one formatter."""
from __future__ import annotations

import time
from typing import Literal


def iso(ms: int, fraction: Literal["always", "when-any", "never"] = "always") -> str:
    """1767225600123 -> '2026-01-01T00:00:00.123Z'. `fraction`: the milliseconds always (the wire, files), only
    when there are any (a suggested command: exact, and short when it can be), or never (a table, for people)."""
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000))
    if fraction == "always" or (fraction == "when-any" and ms % 1000):
        return f"{text}.{ms % 1000:03d}Z"
    return text + "Z"
