"""Facts about the host read from /proc and /sys, shared by the agent's discovery and the cgroups package.

One short function per kernel file, the roots as parameters (so tests point
them at a hand-made tree), plain values out. OSError becomes HostReadError
(with the path) here and nowhere else; a file whose absence means an older
kernel or a missing feature is read with `read_optional` (a default, and a
debug log naming the feature). The kernel's list format ("0-3,8,10-11") is
parsed and printed here, once, for cpulists, node lists and cpuset files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, TypeVar

import structlog

log = structlog.get_logger("berth.hostfacts")

T = TypeVar("T")


class HostReadError(Exception):
    """A kernel file under /proc or /sys could not be read or parsed; carries the path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


# -- the one boundary ------------------------------------------------------------


def read_text(path: str) -> str:
    """The file's text, stripped; HostReadError (with the path) if it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError as exc:
        raise HostReadError(path, exc.strerror or str(exc)) from exc


def read_optional(path: str, default: T, feature: str) -> str | T:
    """The file's text, or `default` with a debug log naming the kernel feature when the file is absent."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except FileNotFoundError:
        log.debug("kernel file absent", path=path, feature=feature)
        return default
    except OSError as exc:
        raise HostReadError(path, exc.strerror or str(exc)) from exc


def read_int(path: str) -> int:
    text = read_text(path)
    try:
        return int(text)
    except ValueError:
        raise HostReadError(path, f"expected an integer, found {text[:40]!r}") from None


def list_dir(path: str) -> list[str]:
    """The names in a directory, sorted; [] when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise HostReadError(path, exc.strerror or str(exc)) from exc


# -- the kernel's list format -------------------------------------------------------


def parse_cpulist(text: str, path: str = "cpulist") -> tuple[int, ...]:
    """The kernel's list format ("0-3,8,10-11", "" for none) as a sorted tuple of ids."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                first, last = int(lo), int(hi)
                if last < first or first < 0:
                    raise ValueError(part)
                ids.update(range(first, last + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError(part)
                ids.add(value)
        except ValueError:
            raise HostReadError(path, f"not a cpu/node list: {text[:60]!r} (at {part!r})") from None
    return tuple(sorted(ids))


def format_cpulist(ids: Iterable[int]) -> str:
    """The canonical form the kernel prints back ('0-3,8'), so a written value compares equal when read."""
    items = sorted(set(ids))
    runs: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        runs.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(runs)


# -- CPUs and NUMA nodes ---------------------------------------------------------------


def online_cpus(sys_root: str = "/sys") -> tuple[int, ...]:
    path = os.path.join(sys_root, "devices/system/cpu/online")
    return parse_cpulist(read_text(path), path)


def online_nodes(sys_root: str = "/sys") -> tuple[int, ...]:
    """The online NUMA node ids; () when the kernel has no NUMA support (callers then use node 0)."""
    base = os.path.join(sys_root, "devices/system/node")
    text = read_optional(os.path.join(base, "online"), None, "NUMA (CONFIG_NUMA)")
    if text is not None:
        return parse_cpulist(text, os.path.join(base, "online"))
    return tuple(sorted(int(name[4:]) for name in list_dir(base) if name.startswith("node") and name[4:].isdigit()))


def node_cpus(node: int, sys_root: str = "/sys") -> tuple[int, ...]:
    """The CPUs of one NUMA node (online or not: callers intersect with the online set)."""
    path = os.path.join(sys_root, f"devices/system/node/node{node}/cpulist")
    return parse_cpulist(read_optional(path, "", "NUMA node cpulist"), path)


# -- memory ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Meminfo:
    total_kib: int
    hugetlb_kib: int  # memory held by all hugepage pools, every size


@dataclass(frozen=True, slots=True)
class NodeMemory:
    node: int
    total_kib: int


def _fields(text: str, path: str, prefix: str = "") -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        if prefix:
            if not line.startswith(prefix):
                continue
            line = line[len(prefix):]
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if parts:
            try:
                out[key.strip()] = int(parts[0])
            except ValueError:
                raise HostReadError(path, f"{key.strip()}: not a number: {parts[0]!r}") from None
    return out


def read_meminfo(proc_root: str = "/proc") -> Meminfo:
    """/proc/meminfo: MemTotal and what the hugepage pools hold (inside MemTotal, but not allocatable)."""
    path = os.path.join(proc_root, "meminfo")
    fields = _fields(read_text(path), path)
    if "MemTotal" not in fields:
        raise HostReadError(path, "no MemTotal line")
    if "Hugetlb" in fields:
        hugetlb = fields["Hugetlb"]
    else:  # before Linux 4.16: only the default size's pool is in meminfo
        log.debug("meminfo has no Hugetlb line; counting the default hugepage size only", path=path)
        hugetlb = fields.get("HugePages_Total", 0) * fields.get("Hugepagesize", 0)
    return Meminfo(total_kib=fields["MemTotal"], hugetlb_kib=hugetlb)


def read_node_memory(node: int, sys_root: str = "/sys") -> NodeMemory | None:
    """One NUMA node's MemTotal; None when the node has no meminfo (a kernel without NUMA)."""
    path = os.path.join(sys_root, f"devices/system/node/node{node}/meminfo")
    text = read_optional(path, None, "NUMA node meminfo")
    if text is None:
        return None
    fields = _fields(text, path, prefix=f"Node {node} ")
    if "MemTotal" not in fields:
        raise HostReadError(path, f"no 'Node {node} MemTotal' line")
    return NodeMemory(node=node, total_kib=fields["MemTotal"])


# -- hugepages ------------------------------------------------------------------------------

SIZE_1G_KIB = 1048576
SIZE_2M_KIB = 2048


def hugepage_dir(size_kib: int, sys_root: str = "/sys", node: int | None = None) -> str:
    if node is None:
        return os.path.join(sys_root, f"kernel/mm/hugepages/hugepages-{size_kib}kB")
    return os.path.join(sys_root, f"devices/system/node/node{node}/hugepages/hugepages-{size_kib}kB")


def hugepages_total(size_kib: int, sys_root: str = "/sys") -> int | None:
    """Pages of this size in the host pool (nr_hugepages); None when the kernel has no such page size."""
    text = read_optional(os.path.join(hugepage_dir(size_kib, sys_root), "nr_hugepages"), None,
                         f"{size_kib} KiB hugepages")
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise HostReadError(hugepage_dir(size_kib, sys_root), f"nr_hugepages: not a number: {text[:40]!r}") from None
