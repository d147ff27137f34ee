"""The host's CPUs, memory and hugepages as facts, behind one small protocol (`HostSource.read() -> HostFacts`).

`KernelHost` reads them from /proc and /sys through `agent.cpus`,
`common.hostfacts` and `agent.hugepages`; `agent.simulate` offers a host that
replaces any of the three sections from a topology file.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Protocol

from agent import hugepages
from agent.cpus import CpuTopology, read_cpu_topology
from agent.hugepages import HugepagePool
from common.hostfacts import (
    SIZE_1G_KIB, SIZE_2M_KIB, HostReadError, Meminfo, NodeMemory, hugepage_dir, read_meminfo, read_node_memory,
    read_optional,
)

# The kernel's boot id: a random UUID, lowercase (random(4): /proc/sys/kernel/random/boot_id).
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True, slots=True)
class HostFacts:
    cpus: CpuTopology
    meminfo: Meminfo
    node_memory: tuple[NodeMemory, ...]
    pages_1g: HugepagePool
    pages_2m: HugepagePool
    boot_id: str | None = None
    hostname: str = ""


class HostSource(Protocol):
    def read(self) -> HostFacts: ...


@dataclass(frozen=True, slots=True)
class KernelHost:
    """This host as its kernel shows it; the roots are parameters so tests point them at a hand-made tree."""

    sys_root: str = "/sys"
    proc_root: str = "/proc"

    def read(self) -> HostFacts:
        cpus = read_cpu_topology(self.sys_root)
        node_ids = tuple(n for n, _ in cpus.nodes)
        meminfo = read_meminfo(self.proc_root)
        hostname = read_optional(os.path.join(self.proc_root, "sys/kernel/hostname"), None, "UTS hostname")
        return HostFacts(
            cpus=cpus,
            meminfo=meminfo,
            node_memory=self._node_memory(node_ids, meminfo),
            pages_1g=self._pool(SIZE_1G_KIB, node_ids),
            pages_2m=self._pool(SIZE_2M_KIB, node_ids),
            boot_id=self._boot_id(),
            hostname=hostname or socket.gethostname(),
        )

    def _node_memory(self, node_ids: tuple[int, ...], meminfo: Meminfo) -> tuple[NodeMemory, ...]:
        """Each node's MemTotal. A kernel without NUMA has no node meminfo: its one node 0 (as the CPUs report it)
        holds the whole memory, so the memory section lists the nodes the CPU section does."""
        per_node = tuple(m for n in node_ids if (m := read_node_memory(n, self.sys_root)) is not None)
        if not per_node and node_ids == (0,):
            return (NodeMemory(0, meminfo.total_kib),)
        return per_node

    def _pool(self, size_kib: int, node_ids: tuple[int, ...]) -> HugepagePool:
        """One hugepage pool; a negative count (the kernel never writes one) is an error naming its file, not a
        pool of -5 pages that the inventory's schema refuses."""
        pool = hugepages.read_pool(size_kib, node_ids, self.sys_root)
        counts = [(hugepage_dir(size_kib, self.sys_root), pool.total, pool.free)]
        counts += [(hugepage_dir(size_kib, self.sys_root, n.node), n.total, n.free) for n in pool.nodes]
        for where, total, free in counts:
            for name, value in (("nr_hugepages", total), ("free_hugepages", free)):
                if value < 0:
                    raise HostReadError(os.path.join(where, name), f"{value} pages: a page count is never negative")
        return pool

    def _boot_id(self) -> str | None:
        """The boot id, or None where the kernel has none; anything but a UUID is an error naming the file (the
        checkpoint and the control plane key a boot on it)."""
        path = os.path.join(self.proc_root, "sys/kernel/random/boot_id")
        text = read_optional(path, None, "boot id")
        if not text:
            return None
        if not _BOOT_ID.fullmatch(text):
            raise HostReadError(path, f"not a boot id (a UUID such as 6f1c2e0a-0000-4000-8000-000000000007): "
                                      f"{text[:40]!r}")
        return text
