"""Hugepages: each pool's total and free pages, host-wide and per NUMA node, for 1 GiB and 2 MiB pages.

Sources: /sys/kernel/mm/hugepages/hugepages-<size>kB/{nr,free,resv}_hugepages
and /sys/devices/system/node/nodeN/hugepages/hugepages-<size>kB/. The sizes
a kernel supports are fixed at boot, so they are probed once per root.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from common.hostfacts import SIZE_1G_KIB, hugepage_dir, list_dir, read_int, read_optional
_POOL_DIR = re.compile(r"^hugepages-(\d+)kB$")


@dataclass(frozen=True, slots=True)
class NodePool:
    node: int
    total: int
    free: int


@dataclass(frozen=True, slots=True)
class HugepagePool:
    size_kib: int
    supported: bool
    total: int = 0
    free: int = 0
    reserved: int = 0  # promised to a mapping, not yet faulted in (still counted in free)
    nodes: tuple[NodePool, ...] = ()


@functools.lru_cache(maxsize=None)
def supported_sizes(sys_root: str = "/sys") -> frozenset[int]:
    """The hugepage sizes (KiB) this kernel supports; probed once per root."""
    base = os.path.join(sys_root, "kernel/mm/hugepages")
    return frozenset(int(m.group(1)) for name in list_dir(base) if (m := _POOL_DIR.match(name)))


def has_hugetlb_1g(sys_root: str = "/sys") -> bool:
    return SIZE_1G_KIB in supported_sizes(sys_root)


def read_pool(size_kib: int, nodes: tuple[int, ...], sys_root: str = "/sys") -> HugepagePool:
    """One page size's pool, host-wide and on each of `nodes` (a node without the counters reports 0)."""
    if size_kib not in supported_sizes(sys_root):
        return HugepagePool(size_kib=size_kib, supported=False)
    base = hugepage_dir(size_kib, sys_root)
    per_node = []
    for node in nodes:
        node_dir = hugepage_dir(size_kib, sys_root, node)
        if read_optional(os.path.join(node_dir, "nr_hugepages"), None, "per-node hugepage counters") is None:
            per_node.append(NodePool(node, 0, 0))
            continue
        per_node.append(NodePool(node, read_int(os.path.join(node_dir, "nr_hugepages")),
                                 read_int(os.path.join(node_dir, "free_hugepages"))))
    resv = read_optional(os.path.join(base, "resv_hugepages"), "0", "hugepage reservations")
    return HugepagePool(
        size_kib=size_kib,
        supported=True,
        total=read_int(os.path.join(base, "nr_hugepages")),
        free=read_int(os.path.join(base, "free_hugepages")),
        reserved=int(resv) if resv.isdigit() else 0,
        nodes=tuple(per_node),
    )
