"""cgroup v1 cpuset: cpuset.cpus and cpuset.mems, and the rule that a new v1 cpuset cgroup starts EMPTY.

A v1 cpuset child is born with empty cpuset.cpus and cpuset.mems (unless its
parent has cgroup.clone_children 1), and no task can join it until both are
set (the write to cgroup.procs fails with ENOSPC). So every directory the
package makes in the cpuset hierarchy is filled from its parent at once
(`fill_from_parent`) and gets cgroup.clone_children 1, so its own children
are born filled. A share without cpus or mems asks for the parent's lists,
the v1 spelling of cgroup2's empty 'inherit'.
"""
from __future__ import annotations

from pathlib import Path

from ..cpuset import CpusetStat
from ..errors import FileMissing
from ..files import apply_values, parse_cpulist, read_file
from ..share import CgroupShare
from . import spy

CONTROLLER = "cpuset"


def desired_cpuset(share: CgroupShare, parent_cpus: str, parent_mems: str) -> dict[str, str]:
    # mems, then cpus, as runc writes them; a task can join once both are set
    return {"cpuset.mems": share.mems or parent_mems, "cpuset.cpus": share.cpus or parent_cpus}


def _parent_lists(dir: Path) -> tuple[str, str]:
    parent = Path(dir).parent
    return read_file(parent, "cpuset.cpus"), read_file(parent, "cpuset.mems")


def desired_for(dir: Path, share: CgroupShare) -> dict[str, str]:
    return desired_cpuset(share, *_parent_lists(dir))


def apply_cpuset(dir: Path, share: CgroupShare) -> list[str]:
    return apply_values(dir, desired_for(dir, share))


def is_empty(dir: Path) -> bool:
    """Whether no task could join: cpuset.cpus or cpuset.mems is empty."""
    return not read_file(dir, "cpuset.cpus") or not read_file(dir, "cpuset.mems")


def fill_from_parent(dir: Path) -> list[str]:
    """Give a cpuset cgroup the package made its parent's cpus and mems where empty, and clone_children 1."""
    cpus, mems = _parent_lists(dir)
    desired = {}
    if not read_file(dir, "cpuset.mems"):
        desired["cpuset.mems"] = mems
    if not read_file(dir, "cpuset.cpus"):
        desired["cpuset.cpus"] = cpus
    desired["cgroup.clone_children"] = "1"
    return apply_values(dir, desired)


def stat_cpuset(dir: Path) -> CpusetStat:
    ctl = spy.Cpuset(dir)
    cpus, mems = frozenset(ctl.cpus), frozenset(ctl.mems)

    def effective(name: str, default: frozenset[int]) -> frozenset[int]:
        try:
            return parse_cpulist(read_file(dir, name))
        except FileMissing:  # kernels before 4.17 have no effective_* files in v1
            return default

    return CpusetStat(cpus, mems, effective("cpuset.effective_cpus", cpus), effective("cpuset.effective_mems", mems))
