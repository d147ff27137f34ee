"""cgroup v1 cpu: cpu.cfs_period_us, cpu.cfs_quota_us (vcpu x period) and cpu.shares (1024 per vcpu); cpu.stat back.

2.5 vcpu at the default 100 ms period is quota 250000, period 100000, shares
2560; no vcpu limit is quota -1 (the kernel's 'none') and shares 1024 (the
kernel's default, one CPU's weight). Shares are bounded to the kernel's range
[2, 262144]. The period is written before the quota, as the kernel checks the
pair against the parent's.
"""
from __future__ import annotations

from pathlib import Path

from ..cpu import CpuMax, CpuStat
from ..files import apply_values
from ..share import CgroupShare
from . import spy

CONTROLLER = "cpu"
MIN_SHARES, MAX_SHARES, SHARES_PER_VCPU = 2, 1 << 18, 1024


def shares_of(vcpu_milli: int | None) -> int:
    """cpu.shares proportional to the vcpu share: 1024 per vcpu, within [2, 262144]; no share: 1024."""
    if vcpu_milli is None:
        return SHARES_PER_VCPU
    return max(MIN_SHARES, min(MAX_SHARES, vcpu_milli * SHARES_PER_VCPU // 1000))


def desired_cpu(share: CgroupShare) -> dict[str, str]:
    quota = share.quota_us if share.vcpu_milli is not None else -1
    return {"cpu.cfs_period_us": str(share.cpu_period_us), "cpu.cfs_quota_us": str(quota),
            "cpu.shares": str(shares_of(share.vcpu_milli))}


def apply_cpu(dir: Path, share: CgroupShare) -> list[str]:
    return apply_values(dir, desired_cpu(share))


def stat_cpu(dir: Path, usage: dict[str, int] | None = None) -> CpuStat:
    """The throttling figures from v1 cpu.stat (throttled_time is in ns); usage_usec, user_usec and system_usec
    come from `usage` (the cgroup2 cgroup's cpu.stat, which every cgroup2 cgroup has), else 0."""
    ctl = spy.Cpu(dir)
    stat, usage = ctl.stat, usage or {}
    return CpuStat(CpuMax(ctl.cfs_quota_us, ctl.cfs_period_us), usage.get("usage_usec", 0), usage.get("user_usec", 0),
                   usage.get("system_usec", 0), stat.get("nr_periods", 0), stat.get("nr_throttled", 0),
                   stat.get("throttled_time", 0) // 1000)
