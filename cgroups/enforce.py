"""Which functions write, compare and read back each controller's files, on cgroup2 and on a cgroup v1 hierarchy.

One table per layout, one row per controller, so the Subtree asks "where does
this controller live" once and never branches on file names. Each row's
`desired(dir, share)` gives the files and values the share asks for in that
directory (the feature probes, swap accounting or the rsvd files, are made
there); `apply` writes those that differ; `stat(dir, v2_dir)` reads the
figures back in one shape for both layouts (v2_dir: the cgroup2 directory of
the same cgroup, where v1 has no usage figures of its own).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import cpu, cpuset, hugetlb, memory
from .files import has_file, parse_keyed, read_file
from .share import CgroupShare
from .v1 import cpu as cpu_v1
from .v1 import cpuset as cpuset_v1
from .v1 import hugetlb as hugetlb_v1
from .v1 import memory as memory_v1


@dataclass(frozen=True)
class Files:
    desired: Callable[[Path, CgroupShare], dict[str, str]]
    apply: Callable[[Path, CgroupShare], list[str]]
    stat: Callable[[Path, Path], object]
    check: Callable[[CgroupShare], None] = lambda share: None  # refuse, before any write, what cannot be enforced


def _v2_cpu_usage(v2_dir: Path) -> dict[str, int]:
    """usage_usec, user_usec, system_usec: every cgroup2 cgroup has them in cpu.stat, with or without cpu enabled."""
    return parse_keyed(read_file(v2_dir, "cpu.stat"))


V2 = {
    "cpuset": Files(lambda d, s: cpuset.desired_cpuset(s), cpuset.apply_cpuset, lambda d, v2: cpuset.stat_cpuset(d)),
    "cpu": Files(lambda d, s: cpu.desired_cpu(s), cpu.apply_cpu, lambda d, v2: cpu.stat_cpu(d)),
    "memory": Files(lambda d, s: memory.desired_memory(s, has_swap=memory.has_swap(d)), memory.apply_memory,
                    lambda d, v2: memory.stat_memory(d)),
    "hugetlb": Files(lambda d, s: hugetlb.desired_hugetlb(s, **hugetlb.features(d)), hugetlb.apply_hugetlb,
                     lambda d, v2: hugetlb.stat_hugetlb(d)),
}

V1 = {
    "cpuset": Files(cpuset_v1.desired_for, cpuset_v1.apply_cpuset, lambda d, v2: cpuset_v1.stat_cpuset(d)),
    "cpu": Files(lambda d, s: cpu_v1.desired_cpu(s), cpu_v1.apply_cpu,
                 lambda d, v2: cpu_v1.stat_cpu(d, usage=_v2_cpu_usage(v2))),
    "memory": Files(lambda d, s: memory_v1.desired_memory(s, has_swap=memory_v1.has_swap(d)), memory_v1.apply_memory,
                    lambda d, v2: memory_v1.stat_memory(d), check=memory_v1.check_share),
    "hugetlb": Files(lambda d, s: hugetlb_v1.desired_hugetlb(s, has_rsvd=has_file(d, hugetlb_v1.RSVD_FILE)),
                     hugetlb_v1.apply_hugetlb, lambda d, v2: hugetlb_v1.stat_hugetlb(d)),
}
