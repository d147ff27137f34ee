"""The kernel boundary for cgroups v2: create, limit, fill, kill and remove cgroups; the eBPF device program.

Usable on its own: a `Subtree` owns one delegated cgroup v2 directory and the
share cgroups below it; a `CgroupShare` says the limits; `DeviceRule`s say
which device nodes stay open. See docs/cgroups.md.
"""
from .devices import DeviceRule, harmless_rules, normalise, nvidia_rules, read_proc_devices, rule
from .errors import (BpfError, Busy, CgroupError, ControllerMissing, Exists, FileMissing, InvalidName, InvalidRule,
                     InvalidShare, NotCgroup2, NotFound, RecordCorrupt, ShareTooLarge)
from .files import Drift
from .share import Capacity, CgroupShare, read_capacity
from .tree import ALL_CONTROLLERS, Cgroup, CgroupStat, Subtree, controllers_of

__all__ = [
    "ALL_CONTROLLERS", "BpfError", "Busy", "Capacity", "Cgroup", "CgroupError", "CgroupShare", "CgroupStat",
    "ControllerMissing", "DeviceRule", "Drift", "Exists", "FileMissing", "InvalidName", "InvalidRule",
    "InvalidShare", "NotCgroup2", "NotFound", "RecordCorrupt", "ShareTooLarge", "Subtree", "controllers_of",
    "harmless_rules", "normalise", "nvidia_rules", "read_capacity", "read_proc_devices", "rule",
]
