"""NUMA: the node a PCI device (a GPU) sits on, from /sys/bus/pci/devices/<bus id>/numa_node.

The host's nodes and their CPUs are read by common.hostfacts (online_nodes,
node_cpus); a kernel built without NUMA has no node directory, and the host
is then one node 0 holding every online CPU.
"""
from __future__ import annotations

import os
import re

from common.hostfacts import read_int, read_optional

_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


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
