"""CPUs: which are online and offline, how many physical cores they make, and the CPUs of each NUMA node.

Sources: /sys/devices/system/cpu/{online,offline} and each online CPU's
topology/thread_siblings_list (hyperthreads of one core share a list).
What is reserved for the system is policy and lives in `agent.discovery`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from common.hostfacts import node_cpus, online_nodes, parse_cpulist, read_optional, read_text


@dataclass(frozen=True, slots=True)
class CpuTopology:
    online: tuple[int, ...]
    offline: tuple[int, ...]
    cores: int  # physical cores with at least one online thread
    nodes: tuple[tuple[int, tuple[int, ...]], ...]  # (numa node, its online CPUs)

    @property
    def threads(self) -> int:
        return len(self.online)


def read_cpu_topology(sys_root: str = "/sys") -> CpuTopology:
    base = os.path.join(sys_root, "devices/system/cpu")
    online = parse_cpulist(read_text(os.path.join(base, "online")), os.path.join(base, "online"))
    offline = parse_cpulist(read_optional(os.path.join(base, "offline"), "", "CPU hotplug"), os.path.join(base, "offline"))
    online_set = set(online)

    cores: set[tuple[int, ...]] = set()
    for cpu in online:
        path = os.path.join(base, f"cpu{cpu}/topology/thread_siblings_list")
        siblings = read_optional(path, None, "CPU topology (CONFIG_SMP)")
        # Only the online siblings count: an offlined hyperthread leaves its core.
        cores.add(tuple(c for c in parse_cpulist(siblings, path) if c in online_set) if siblings else (cpu,))

    node_ids = online_nodes(sys_root)
    if node_ids:
        nodes = tuple((n, tuple(c for c in node_cpus(n, sys_root) if c in online_set)) for n in node_ids)
    else:
        nodes = ((0, online),)
    return CpuTopology(online=online, offline=offline, cores=len(cores), nodes=nodes)
