"""NUMA: the host's online nodes, each node's CPU list, and the node a PCI device (a GPU) sits on.

Sources: /sys/devices/system/node/{online,nodeN/cpulist} and
/sys/bus/pci/devices/<bus id>/numa_node. A kernel built without NUMA has no
node directory: the host is then one node 0 holding every online CPU.
"""
from __future__ import annotations

import os
import re

from agent.sysfs import list_dir, parse_cpulist, read_int, read_optional

_NODE_DIR = re.compile(r"^node(\d+)$")
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def online_nodes(sys_root: str = "/sys") -> tuple[int, ...]:
    """The online NUMA node ids; () when the kernel has no NUMA support (callers then use node 0)."""
    base = os.path.join(sys_root, "devices/system/node")
    text = read_optional(os.path.join(base, "online"), None, "NUMA (CONFIG_NUMA)")
    if text is not None:
        return parse_cpulist(text, os.path.join(base, "online"))
    return tuple(sorted(int(m.group(1)) for name in list_dir(base) if (m := _NODE_DIR.match(name))))


def node_cpus(node: int, sys_root: str = "/sys") -> tuple[int, ...]:
    """The CPUs of one NUMA node (online or not: callers intersect with the online set)."""
    path = os.path.join(sys_root, f"devices/system/node/node{node}/cpulist")
    return parse_cpulist(read_optional(path, "", "NUMA node cpulist"), path)


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's bus id ("00000000:3B:00.0") in sysfs form ("0000:3b:00.0")."""
    m = _BUS_ID.match(nvml_bus_id.strip())
    if not m:
        raise ValueError(f"not a PCI bus id: {nvml_bus_id!r}")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def numa_node_of(pci_bus_id: str, sys_root: str = "/sys") -> int | None:
    """The NUMA node of a PCI device from sysfs `numa_node`; None when the platform reports none (-1) or no file."""
    try:
        bus_id = sysfs_bus_id(pci_bus_id)
    except ValueError:
        return None
    path = os.path.join(sys_root, "bus/pci/devices", bus_id, "numa_node")
    if read_optional(path, None, "PCI device numa_node") is None:
        return None
    node = read_int(path)
    return node if node >= 0 else None
