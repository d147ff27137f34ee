"""Memory: the host's total and what its hugepage pools hold (/proc/meminfo), and each NUMA node's total.

Sources: /proc/meminfo (MemTotal, Hugetlb) and
/sys/devices/system/node/nodeN/meminfo ("Node 0 MemTotal: ... kB").
Hugepage pool memory is inside MemTotal but cannot back ordinary
allocations, so `agent.discovery` takes it out of what is allocatable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import structlog

from agent.errors import HostReadError
from agent.sysfs import read_optional, read_text

log = structlog.get_logger(__name__)


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
