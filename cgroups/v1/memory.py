"""cgroup v1 memory: memory.limit_in_bytes and, where swap accounting is on, memory.memsw.limit_in_bytes equal to it.

memsw (memory + swap) equal to the limit means no swap, as cgroup2's
memory.swap.max 0. The kernel keeps memsw >= limit at every write (EINVAL
otherwise), so a lower limit is written before memsw and a higher one after
(`ordered`). Values are page-aligned bytes; 'no limit' is the kernel's own
maximum, 9223372036854771712 with 4 KiB pages (what it reads back after -1).
memory.high has no v1 counterpart (memory.soft_limit_in_bytes only steers
reclaim under global pressure), so a share with memory_high_bytes is refused
rather than half-enforced. Usage, failcnt and the OOM kill count (the
`oom_kill` line of memory.oom_control, Linux 4.13+) come back in cgroup2's
MemoryStat shape.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import FileMissing, NotEnforceable
from ..files import apply_values, has_file, read_file
from ..memory import MemoryStat
from ..share import PAGE_SIZE, CgroupShare
from . import spy

CONTROLLER = "memory"
LIMIT, MEMSW = "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"
UNLIMITED = (2 ** 63 - 1) // PAGE_SIZE * PAGE_SIZE  # PAGE_COUNTER_MAX pages, as the kernel reads back 'no limit'


def check_share(share: CgroupShare) -> None:
    if share.memory_high_bytes is not None:
        raise NotEnforceable("memory_high_bytes", "memory.high has no cgroup v1 counterpart (memory.soft_limit_in_bytes "
                             "acts only under host-wide memory pressure); leave it None where memory is a v1 controller")


def limit_of(share: CgroupShare) -> int:
    return UNLIMITED if share.memory_bytes is None else share.memory_bytes // PAGE_SIZE * PAGE_SIZE


def desired_memory(share: CgroupShare, *, has_swap: bool = True) -> dict[str, str]:
    value = str(limit_of(share))
    return {LIMIT: value, MEMSW: value} if has_swap else {LIMIT: value}


def ordered(desired: dict[str, str], current_limit: int) -> dict[str, str]:
    """The writes in an order the kernel accepts: memsw >= limit after each one."""
    if MEMSW in desired and int(desired[LIMIT]) >= current_limit:
        return {MEMSW: desired[MEMSW], LIMIT: desired[LIMIT]}
    return desired


def has_swap(dir: Path) -> bool:
    """memory.memsw.* exist only with swap accounting (CONFIG_MEMCG_SWAP, swapaccount=1)."""
    return has_file(dir, MEMSW)


def apply_memory(dir: Path, share: CgroupShare) -> list[str]:
    check_share(share)
    desired = desired_memory(share, has_swap=has_swap(dir))
    return apply_values(dir, ordered(desired, int(read_file(dir, LIMIT))))


def stat_memory(dir: Path) -> MemoryStat:
    ctl = spy.Memory(dir)
    usage, limit = ctl.usage_in_bytes, ctl.limit_in_bytes
    swap = 0
    if has_swap(dir):
        swap = max(0, ctl.memsw_usage_in_bytes - usage)
    try:
        oom = ctl.oom_control
    except FileMissing:
        oom = {}
    events = {"max": ctl.failcnt}
    if isinstance(oom, dict) and "oom_kill" in oom:
        events["oom_kill"] = oom["oom_kill"]
    return MemoryStat(current=usage, max=None if limit is None or limit >= UNLIMITED else limit, high=None,
                      swap_current=swap, events=events)
