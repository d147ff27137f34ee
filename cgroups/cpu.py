"""The cpu controller: cpu.max from a share's vcpu, and cpu.stat back.

2.5 vcpu at the default 100 ms period is "250000 100000"; no vcpu limit is
"max 100000".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import FileMissing
from .files import apply_values, format_max, parse_keyed, parse_max, read_file
from .share import CgroupShare

CONTROLLER = "cpu"


def desired_cpu(share: CgroupShare) -> dict[str, str]:
    quota = share.quota_us if share.vcpu_milli is not None else None
    return {"cpu.max": f"{format_max(quota)} {share.cpu_period_us}"}


def apply_cpu(dir: Path, share: CgroupShare) -> list[str]:
    return apply_values(dir, desired_cpu(share))


@dataclass(frozen=True)
class CpuMax:
    quota_us: int | None
    period_us: int


def parse_cpu_max(text: str) -> CpuMax:
    quota, _, period = text.strip().partition(" ")
    return CpuMax(parse_max(quota), int(period) if period else 100_000)


@dataclass(frozen=True)
class CpuStat:
    max: CpuMax
    usage_usec: int
    user_usec: int
    system_usec: int
    nr_periods: int
    nr_throttled: int
    throttled_usec: int


def stat_cpu(dir: Path) -> CpuStat:
    stat = parse_keyed(read_file(dir, "cpu.stat"))
    try:
        limit = parse_cpu_max(read_file(dir, "cpu.max"))
    except FileMissing:
        limit = CpuMax(None, 100_000)
    return CpuStat(limit, stat.get("usage_usec", 0), stat.get("user_usec", 0), stat.get("system_usec", 0),
                   stat.get("nr_periods", 0), stat.get("nr_throttled", 0), stat.get("throttled_usec", 0))
