"""The kernel boundary for cgroups: create, limit, fill, kill and remove cgroups; the eBPF device program.

Usable on its own: a `Subtree` owns one delegated cgroup2 directory, its
counterparts in the cgroup v1 hierarchies where the host keeps controllers
there (the hybrid layout), and the share cgroups below them; a `CgroupShare`
says the limits; `DeviceRule`s say which device nodes stay open;
`probe_layout()` says where each controller lives. See docs/cgroups.md.
"""
from .devices import DeviceRule, harmless_rules, normalise, nvidia_rules, read_proc_devices, rule
from .errors import (BpfError, Busy, CgroupError, ControllerMissing, Exists, FileMissing, InvalidName, InvalidRule,
                     InvalidShare, NotCgroup2, NotEnforceable, NotFound, RecordCorrupt, ShareTooLarge)
from .files import Drift
from .kernel import Kernel, LinuxKernel
from .layout import KNOWN, Hierarchy, Layout, probe_layout
from .share import Capacity, CgroupShare, read_capacity
from .tree import ALL_CONTROLLERS, Cgroup, CgroupStat, Subtree, controllers_of

__all__ = [
    "ALL_CONTROLLERS", "BpfError", "Busy", "Capacity", "Cgroup", "CgroupError", "CgroupShare", "CgroupStat",
    "ControllerMissing", "DeviceRule", "Drift", "Exists", "FileMissing", "Hierarchy", "InvalidName", "InvalidRule",
    "InvalidShare", "KNOWN", "Kernel", "Layout", "LinuxKernel", "NotCgroup2", "NotEnforceable", "NotFound",
    "RecordCorrupt", "ShareTooLarge", "Subtree", "controllers_of", "harmless_rules", "normalise", "nvidia_rules",
    "probe_layout", "read_capacity", "read_proc_devices", "rule",
]
