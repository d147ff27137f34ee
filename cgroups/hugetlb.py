"""The hugetlb controller, 1 GiB pages: hugetlb.1GB.max and hugetlb.1GB.rsvd.max where the kernel has it; usage back.

With rsvd.max set too, a mapping beyond the share fails at mmap() (ENOMEM)
instead of at first touch (SIGBUS).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import FileMissing
from .files import apply_values, has_file, parse_keyed, parse_max, read_file
from .share import CgroupShare

CONTROLLER = "hugetlb"
GIB = 1 << 30
MAX_FILE = "hugetlb.1GB.max"
RSVD_FILE = "hugetlb.1GB.rsvd.max"


def desired_hugetlb(share: CgroupShare, *, has_1g: bool = True, has_rsvd: bool = True) -> dict[str, str]:
    if not has_1g:
        return {}
    value = str(share.hugepages_1g * GIB)
    out = {MAX_FILE: value}
    if has_rsvd:
        out[RSVD_FILE] = value
    return out


def features(dir: Path) -> dict[str, bool]:
    """Which 1 GiB files this kernel offers in dir."""
    return {"has_1g": has_file(dir, MAX_FILE), "has_rsvd": has_file(dir, RSVD_FILE)}


def apply_hugetlb(dir: Path, share: CgroupShare) -> list[str]:
    found = features(dir)
    if not found["has_1g"] and share.hugepages_1g > 0:
        raise FileMissing(
            f"{dir}/{MAX_FILE} is missing: this kernel has no 1 GiB hugetlb pages (hugepagesz=1G) or the hugetlb "
            f"controller is off for this cgroup; cannot give {share.hugepages_1g} pages",
            path=Path(dir) / MAX_FILE,
        )
    return apply_values(dir, desired_hugetlb(share, **found))


@dataclass(frozen=True)
class HugetlbStat:
    current_bytes: int
    max_bytes: int | None
    rsvd_current_bytes: int | None
    rsvd_max_bytes: int | None
    events_max: int  # times an allocation hit the limit


def stat_hugetlb(dir: Path) -> HugetlbStat:
    def opt(name: str) -> str | None:
        try:
            return read_file(dir, name)
        except FileMissing:
            return None

    rsvd_cur, rsvd_max = opt("hugetlb.1GB.rsvd.current"), opt(RSVD_FILE)
    return HugetlbStat(
        current_bytes=int(read_file(dir, "hugetlb.1GB.current")),
        max_bytes=parse_max(read_file(dir, MAX_FILE)),
        rsvd_current_bytes=int(rsvd_cur) if rsvd_cur is not None else None,
        rsvd_max_bytes=parse_max(rsvd_max) if rsvd_max is not None else None,
        events_max=parse_keyed(opt("hugetlb.1GB.events") or "").get("max", 0),
    )
