"""The share the package enforces (CgroupShare), what a host or parent cgroup can give (Capacity), and the check between them.

Plain frozen data: no knowledge of reservations. A share that is malformed in
itself is InvalidShare when it is built; one that the host cannot give is
ShareTooLarge from `check_fits`, before anything is written.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from common import hostfacts

from . import host
from .errors import CgroupError, FileMissing, InvalidShare, ShareTooLarge
from .files import format_cpulist, parse_cpulist, parse_max, read_file

PAGE_SIZE = 4096
MIN_QUOTA_US = 1000  # the kernel refuses a cpu.max quota below 1 ms
DEFAULT_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupShare:
    """One cgroup's limits. None means 'no limit' for that resource.

    vcpu_milli: thousandths of a CPU (2500 = 2.5 vcpu), enforced by cpu.max.
    memory_bytes / memory_high_bytes: memory.max / memory.high (rounded down to a page).
    hugepages_1g: 1 GiB pages the cgroup may fault or reserve (0 = none).
    cpus / mems: cpuset lists ('0-7,16'), for NUMA alignment with the GPUs.
    """

    vcpu_milli: int | None = None
    memory_bytes: int | None = None
    memory_high_bytes: int | None = None
    hugepages_1g: int = 0
    cpus: str | None = None
    mems: str | None = None
    cpu_period_us: int = DEFAULT_PERIOD_US

    def __post_init__(self) -> None:
        for name in ("vcpu_milli", "memory_bytes", "memory_high_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise InvalidShare(f"{name} must be a positive integer or None, got {v!r}")
        if not isinstance(self.hugepages_1g, int) or isinstance(self.hugepages_1g, bool) or self.hugepages_1g < 0:
            raise InvalidShare(f"hugepages_1g must be an integer >= 0, got {self.hugepages_1g!r}")
        if not isinstance(self.cpu_period_us, int) or not 1000 <= self.cpu_period_us <= 1_000_000:
            raise InvalidShare(f"cpu_period_us must be within [1000, 1000000], got {self.cpu_period_us!r}")
        if self.vcpu_milli is not None and self.quota_us < MIN_QUOTA_US:
            raise InvalidShare(
                f"vcpu_milli {self.vcpu_milli} gives a cpu.max quota of {self.quota_us} us, below the kernel's "
                f"{MIN_QUOTA_US} us minimum"
            )
        if self.memory_bytes is not None and self.memory_bytes < PAGE_SIZE:
            raise InvalidShare(f"memory_bytes must be at least one page ({PAGE_SIZE}), got {self.memory_bytes}")
        if self.memory_high_bytes is not None and self.memory_high_bytes < PAGE_SIZE:
            raise InvalidShare(f"memory_high_bytes must be at least one page, got {self.memory_high_bytes}")
        if (self.memory_high_bytes is not None and self.memory_bytes is not None
                and self.memory_high_bytes > self.memory_bytes):
            raise InvalidShare(
                f"memory_high_bytes {self.memory_high_bytes} is above memory_bytes {self.memory_bytes}"
            )
        for name in ("cpus", "mems"):
            v = getattr(self, name)
            if v is not None:
                try:
                    ids = parse_cpulist(v)
                except Exception:
                    raise InvalidShare(f"{name} is not a list like '0-3,8': {v!r}") from None
                if not ids:
                    raise InvalidShare(f"{name} must name at least one id, or be None")
                # canonical form, so that what is written reads back equal
                object.__setattr__(self, name, format_cpulist(ids))

    @property
    def quota_us(self) -> int:
        """cpu.max quota: vcpu x period (2.5 vcpu at 100 ms = 250000)."""
        assert self.vcpu_milli is not None
        return self.vcpu_milli * self.cpu_period_us // 1000

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CgroupShare:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    def asks(self) -> frozenset[str]:
        """The Capacity fields this share needs checked (a share without a limit asks nothing of it)."""
        out = set()
        if self.cpus is not None or self.vcpu_milli is not None:
            out.add("cpus")
        if self.mems is not None:
            out.add("mems")
        if self.memory_bytes is not None or self.memory_high_bytes is not None:
            out.add("memory_bytes")
        if self.hugepages_1g:
            out.add("hugepages_1g")
        return frozenset(out)

    def check_fits(self, capacity: Capacity) -> None:
        """Raise ShareTooLarge for the first field the capacity cannot give (fields it left None: unchecked)."""
        if self.cpus is not None and capacity.cpus is not None:
            if not parse_cpulist(self.cpus) <= capacity.cpus:
                raise ShareTooLarge("cpus", self.cpus, format_cpulist(capacity.cpus))
        if self.mems is not None and capacity.mems is not None:
            if not parse_cpulist(self.mems) <= capacity.mems:
                raise ShareTooLarge("mems", self.mems, format_cpulist(capacity.mems))
        if self.vcpu_milli is not None and capacity.cpus is not None:
            cpus = parse_cpulist(self.cpus) if self.cpus is not None else capacity.cpus
            if self.vcpu_milli > 1000 * len(cpus):
                raise ShareTooLarge("vcpu_milli", self.vcpu_milli, 1000 * len(cpus))
        if capacity.memory_bytes is not None:
            for name in ("memory_bytes", "memory_high_bytes"):
                v = getattr(self, name)
                if v is not None and v > capacity.memory_bytes:
                    raise ShareTooLarge(name, v, capacity.memory_bytes)
        if capacity.hugepages_1g is not None and self.hugepages_1g > capacity.hugepages_1g:
            raise ShareTooLarge("hugepages_1g", self.hugepages_1g, capacity.hugepages_1g)


@dataclass(frozen=True)
class Capacity:
    """What a child of one cgroup can be given: the parent's limits, bounded by the host.

    A field left None was not read (the share asked nothing of it) and is not checked.
    """

    cpus: frozenset[int] | None = None
    mems: frozenset[int] | None = None
    memory_bytes: int | None = None
    hugepages_1g: int | None = None


CAPACITY_FIELDS = frozenset(Capacity.__dataclass_fields__)


@functools.lru_cache(maxsize=8)
def _host_facts(proc: Path, sys: Path) -> tuple[frozenset[int], frozenset[int], int]:
    """Online CPUs, online nodes and MemTotal: fixed for a boot (CPU hotplug aside), so read once per process."""
    try:
        cpus = frozenset(hostfacts.online_cpus(str(sys)))
        nodes = frozenset(hostfacts.online_nodes(str(sys))) or frozenset({0})
        memory = hostfacts.read_meminfo(str(proc)).total_kib * 1024
    except hostfacts.HostReadError as exc:
        raise CgroupError(f"reading the host's size: {exc}", path=Path(exc.path)) from None
    return cpus, nodes, memory


def read_capacity(parent: Path, *, proc: Path = Path("/proc"), sys: Path = Path("/sys"),
                  fields: frozenset[str] = CAPACITY_FIELDS, dirs: Mapping[str, Path] | None = None) -> Capacity:
    """The host's CPUs, nodes, memory and 1 GiB pool, narrowed by the parent cgroup's files where present: its
    effective CPUs and nodes, and the lowest memory and 1 GiB limits of it and every cgroup above it (a limit on
    berth.slice bounds what a reservation below can use whatever its own files say).

    Only `fields` are read (see CgroupShare.asks). `dirs` names, per controller (cpuset, memory, hugetlb), the
    parent's directory in the hierarchy that enforces it, when that is a cgroup v1 one (its files have the v1
    names); the others are read in `parent`. The parent's files and the 1 GiB pool are read on every call; the
    host's CPUs, nodes and MemTotal once per process.
    """
    online, nodes, memory = _host_facts(Path(proc), Path(sys))
    dirs = dirs or {}
    cpuset, mem, huge = (Path(dirs.get(c, parent)) for c in ("cpuset", "memory", "hugetlb"))
    out: dict = {}
    if "cpus" in fields:
        out["cpus"] = _effective(cpuset, "cpuset.cpus.effective", "cpuset.effective_cpus") or online
    if "mems" in fields:
        out["mems"] = _effective(cpuset, "cpuset.mems.effective", "cpuset.effective_mems") or nodes
    if "memory_bytes" in fields:
        parent_max = _lowest_limit(mem, "memory.max", "memory.limit_in_bytes")
        out["memory_bytes"] = memory if parent_max is None else min(memory, parent_max)
    if "hugepages_1g" in fields:
        try:
            pages = hostfacts.hugepages_total(hostfacts.SIZE_1G_KIB, str(sys)) or 0
        except hostfacts.HostReadError as exc:
            raise CgroupError(f"reading the 1 GiB hugepage pool: {exc}", path=Path(exc.path)) from None
        parent_pages = _lowest_limit(huge, "hugetlb.1GB.max", "hugetlb.1GB.limit_in_bytes")
        out["hugepages_1g"] = pages if parent_pages is None else min(pages, parent_pages // host.GIB)
    return Capacity(**out)


def _first(dir: Path, names: tuple[str, ...]) -> str | None:
    """The text of the first of the names (the cgroup2 one, then the v1 one) that exists in dir; None: none does."""
    for name in names:
        try:
            return read_file(dir, name)
        except FileMissing:
            continue
    return None


def _effective(dir: Path, *names: str) -> frozenset[int] | None:
    """The first of the names that exists in dir, as a set; empty is None."""
    text = _first(dir, names)
    return (parse_cpulist(text) or None) if text is not None else None


def _lowest_limit(dir: Path, *names: str) -> int | None:
    """The lowest limit in the first of the names (the cgroup2 one, then the v1 one) at dir and at each cgroup above
    it, up to the first without the file (a cgroup2 root has none; a v1 mount's parent is no cgroup); None: none."""
    lowest = None
    while True:
        text = _first(dir, names)
        if text is None:
            return lowest
        limit = parse_max(text)
        if limit is not None:
            lowest = limit if lowest is None else min(lowest, limit)
        if dir.parent == dir:
            return lowest
        dir = dir.parent
