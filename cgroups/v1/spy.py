"""cgroupspy's v1 controllers, with their file I/O routed through cgroups.files.

cgroupspy (the project's v1 library) knows each v1 controller's files and
their value formats: integers where -1 means none, '0-3,8' sets, 'key value'
tables, devices.list entries (DeviceAccess). It also opens and writes the
files itself, raising bare OSError, and builds its trees by walking the whole
hierarchy. Here only its controller classes are used, each bound to one
directory, with `get_property` / `set_property` replaced by
cgroups.files.read_file / write_file, so every byte still passes the one
boundary (names checked, errors with path and value). See docs/cgroups.md for
what it does not do here.
"""
from __future__ import annotations

import os
from pathlib import Path

from cgroupspy import controllers as _spy
from cgroupspy.contenttypes import DeviceAccess

from ..files import read_file, write_file

__all__ = ["Cpu", "Cpuset", "DeviceAccess", "Devices", "Memory"]


class _Through:
    """The I/O half of a cgroupspy controller, over cgroups.files, for one cgroup directory."""

    def __init__(self, dir: Path | str) -> None:
        self.dir = Path(dir)

    def get_property(self, filename: str | bytes) -> str:
        return read_file(self.dir, os.fsdecode(filename))

    def set_property(self, filename: str | bytes, value: object) -> None:
        write_file(self.dir, os.fsdecode(filename), str(value))


class Cpu(_Through, _spy.CpuController):
    """cpu.cfs_period_us, cpu.cfs_quota_us (-1: None), cpu.shares, cpu.stat (a dict) of one v1 cgroup."""


class Cpuset(_Through, _spy.CpuSetController):
    """cpuset.cpus / cpuset.mems (sets), cgroup.clone_children (a flag) of one v1 cgroup."""


class Memory(_Through, _spy.MemoryController):
    """memory.limit_in_bytes, memory.memsw.*, usage, failcnt, memory.oom_control (a dict) of one v1 cgroup."""


class Devices(_Through, _spy.DevicesController):
    """devices.allow / devices.deny (write a DeviceAccess), devices.list (a list of them) of one v1 cgroup."""
