"""The memory controller: memory.max, memory.swap.max 0 and optionally memory.high; usage and events back.

Limits are rounded down to a page, as the kernel stores them, so that a value
read back compares equal to the one written and drift checks stay quiet.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import FileMissing
from .files import apply_values, format_max, parse_keyed, parse_max, read_file
from .share import PAGE_SIZE, CgroupShare

CONTROLLER = "memory"


def _page(v: int | None) -> int | None:
    return None if v is None else v // PAGE_SIZE * PAGE_SIZE


def desired_memory(share: CgroupShare, *, has_swap: bool = True) -> dict[str, str]:
    out = {
        "memory.max": format_max(_page(share.memory_bytes)),
        "memory.high": format_max(_page(share.memory_high_bytes)),
    }
    if has_swap:
        out["memory.swap.max"] = "0"
    return out


def apply_memory(dir: Path, share: CgroupShare) -> list[str]:
    return apply_values(dir, desired_memory(share, has_swap=has_swap(dir)))


def has_swap(dir: Path) -> bool:
    """memory.swap.max exists only with swap accounting (CONFIG_MEMCG_SWAP, swapaccount)."""
    return (Path(dir) / "memory.swap.max").exists()


@dataclass(frozen=True)
class MemoryStat:
    current: int
    max: int | None
    high: int | None
    swap_current: int
    events: dict[str, int]  # low, high, max, oom, oom_kill (memory.events); v1: max (failcnt), oom_kill

    @property
    def oom_kills(self) -> int:
        """Processes the OOM killer ended in this cgroup (memory.events, or v1 memory.oom_control's oom_kill)."""
        return self.events.get("oom_kill", 0)

    @property
    def limit_hits(self) -> int:
        """Times usage hit the limit (memory.events 'max', or v1 memory.failcnt)."""
        return self.events.get("max", 0)


def stat_memory(dir: Path) -> MemoryStat:
    def opt(name: str, default: str) -> str:
        try:
            return read_file(dir, name)
        except FileMissing:
            return default

    return MemoryStat(
        current=int(read_file(dir, "memory.current")),
        max=parse_max(opt("memory.max", "max")),
        high=parse_max(opt("memory.high", "max")),
        swap_current=int(opt("memory.swap.current", "0")),
        events=parse_keyed(opt("memory.events", "")),
    )
