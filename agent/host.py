"""The host's CPUs, memory and hugepages as facts, behind one small protocol (`HostSource.read() -> HostFacts`).

`KernelHost` reads them from /proc and /sys through `agent.cpus`,
`common.hostfacts` and `agent.hugepages`; `agent.simulate` offers a host that
replaces any of the three sections from a topology file.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Protocol

from agent import hugepages
from agent.cpus import CpuTopology, read_cpu_topology
from agent.hugepages import HugepagePool
from common.hostfacts import SIZE_1G_KIB, SIZE_2M_KIB, Meminfo, NodeMemory, read_meminfo, read_node_memory, read_optional


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
        node_memory = tuple(m for n in node_ids if (m := read_node_memory(n, self.sys_root)) is not None)
        boot_id = read_optional(os.path.join(self.proc_root, "sys/kernel/random/boot_id"), None, "boot id")
        hostname = read_optional(os.path.join(self.proc_root, "sys/kernel/hostname"), None, "UTS hostname")
        return HostFacts(
            cpus=cpus,
            meminfo=read_meminfo(self.proc_root),
            node_memory=node_memory,
            pages_1g=hugepages.read_pool(SIZE_1G_KIB, node_ids, self.sys_root),
            pages_2m=hugepages.read_pool(SIZE_2M_KIB, node_ids, self.sys_root),
            boot_id=boot_id or None,
            hostname=hostname or socket.gethostname(),
        )
