"""The cpuset controller: cpuset.cpus and cpuset.mems (NUMA-aligned with the GPUs), and their effective values back.

A share without cpus or mems writes nothing for it: an empty cpuset file
means 'inherit the parent's', which is what no pinning asks for.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import FileMissing
from .files import apply_values, parse_cpulist, read_file
from .share import CgroupShare

CONTROLLER = "cpuset"


def desired_cpuset(share: CgroupShare) -> dict[str, str]:
    # share.cpus / share.mems are already in the kernel's canonical list form.
    return {"cpuset.cpus": share.cpus or "", "cpuset.mems": share.mems or ""}


def apply_cpuset(dir: Path, share: CgroupShare) -> list[str]:
    return apply_values(dir, desired_cpuset(share))


@dataclass(frozen=True)
class CpusetStat:
    cpus: frozenset[int]
    mems: frozenset[int]
    cpus_effective: frozenset[int]
    mems_effective: frozenset[int]


def stat_cpuset(dir: Path) -> CpusetStat:
    def get(name: str) -> frozenset[int]:
        try:
            return parse_cpulist(read_file(dir, name))
        except FileMissing:
            return frozenset()

    return CpusetStat(get("cpuset.cpus"), get("cpuset.mems"), get("cpuset.cpus.effective"),
                      get("cpuset.mems.effective"))
