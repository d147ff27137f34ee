"""cgroup v1 hugetlb, 1 GiB pages: hugetlb.1GB.limit_in_bytes and hugetlb.1GB.rsvd.limit_in_bytes where present.

The same bytes as cgroup2's hugetlb.1GB.max / .rsvd.max; usage and failcnt
come back in cgroup2's HugetlbStat shape. (On the hosts this is tested on,
hugetlb is a cgroup2 controller; this module is checked on a hand-made v1
tree only.)
"""
from __future__ import annotations

from pathlib import Path

from ..errors import FileMissing
from ..files import apply_values, has_file, read_file
from ..hugetlb import GIB, HugetlbStat
from ..share import CgroupShare

CONTROLLER = "hugetlb"
LIMIT_FILE = "hugetlb.1GB.limit_in_bytes"
RSVD_FILE = "hugetlb.1GB.rsvd.limit_in_bytes"
NO_LIMIT_ABOVE = 1 << 62  # "no limit" reads back as the kernel's maximum rounded down to a huge page


def desired_hugetlb(share: CgroupShare, *, has_rsvd: bool = True) -> dict[str, str]:
    value = str(share.hugepages_1g * GIB)
    return {LIMIT_FILE: value, RSVD_FILE: value} if has_rsvd else {LIMIT_FILE: value}


def apply_hugetlb(dir: Path, share: CgroupShare) -> list[str]:
    if not has_file(dir, LIMIT_FILE):
        raise FileMissing(f"{dir}/{LIMIT_FILE} is missing: this kernel has no 1 GiB hugetlb pages (hugepagesz=1G); "
                          f"cannot give {share.hugepages_1g} pages", path=Path(dir) / LIMIT_FILE)
    return apply_values(dir, desired_hugetlb(share, has_rsvd=has_file(dir, RSVD_FILE)))


def stat_hugetlb(dir: Path) -> HugetlbStat:
    def opt(name: str) -> int | None:
        try:
            return int(read_file(dir, name))
        except FileMissing:
            return None

    def limit(v: int | None) -> int | None:
        return None if v is None or v >= NO_LIMIT_ABOVE else v

    return HugetlbStat(current_bytes=int(read_file(dir, "hugetlb.1GB.usage_in_bytes")),
                       max_bytes=limit(int(read_file(dir, LIMIT_FILE))),
                       rsvd_current_bytes=opt("hugetlb.1GB.rsvd.usage_in_bytes"),
                       rsvd_max_bytes=limit(opt(RSVD_FILE)), events_max=opt("hugetlb.1GB.failcnt") or 0)
