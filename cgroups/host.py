"""Facts about the host's cgroup filesystems: filesystem type, mounts, /proc/cgroups, a process's cgroups.

One short function per kernel file, the roots (/proc, /sys) as parameters so
tests point them at a hand-made tree. OSError becomes CgroupError (with the
path) in `_read`, the one place this module reads. Nothing here writes. Host
sizes (CPUs, memory, 1 GiB pages) are common.hostfacts'.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import CgroupError

CGROUP2_SUPER_MAGIC = 0x63677270
CGROUP_SUPER_MAGIC = 0x27E0EB  # v1
GIB = 1 << 30

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def statfs_type(path: Path | str) -> int:
    """f_type of the filesystem holding path (statfs(2)); f_type is the first word of struct statfs."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(str(path)), buf) != 0:
        err = ctypes.get_errno()
        raise CgroupError(f"statfs {path}: [Errno {err}] {os.strerror(err)}", path=path, errno=err)
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def is_cgroup2(path: Path | str) -> bool:
    return statfs_type(path) == CGROUP2_SUPER_MAGIC


def describe_fs(path: Path | str) -> str:
    kind = statfs_type(path)
    names = {CGROUP2_SUPER_MAGIC: "cgroup2", CGROUP_SUPER_MAGIC: "cgroup v1", 0x01021994: "tmpfs", 0xEF53: "ext4"}
    return names.get(kind, f"filesystem magic {kind:#x}")


@dataclass(frozen=True)
class Mount:
    mount_point: Path
    fstype: str
    super_options: tuple[str, ...]
    root: str = "/"  # the path inside the filesystem that is mounted there (a cgroup namespace shows less)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CgroupError(f"reading {path}: [Errno {exc.errno}] {exc.strerror}", path=path, errno=exc.errno) from None


def read_mountinfo(proc: Path = Path("/proc")) -> list[Mount]:
    """/proc/self/mountinfo: mount point, filesystem type and super options of each mount."""
    out = []
    for line in _read(Path(proc) / "self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        out.append(Mount(Path(point), rfields[0], tuple(rfields[2].split(",")), fields[3].replace("\\040", " ")))
    return out


def cgroup2_mount(proc: Path = Path("/proc")) -> Path | None:
    """Where cgroup2 is mounted (/sys/fs/cgroup on a unified host, /sys/fs/cgroup/unified on a hybrid one)."""
    for m in read_mountinfo(proc):
        if m.fstype == "cgroup2":
            return m.mount_point
    return None


def v1_controllers(proc: Path = Path("/proc")) -> frozenset[str]:
    """Controllers bound to a cgroup v1 hierarchy (they cannot be enabled in cgroup2 on this boot)."""
    out: set[str] = set()
    for m in read_mountinfo(proc):
        if m.fstype == "cgroup":
            out.update(o for o in m.super_options if o not in ("rw", "ro") and "=" not in o)
    return frozenset(out)


@dataclass(frozen=True)
class ControllerRow:
    """One line of /proc/cgroups: the v1 hierarchy a controller is bound to (0: none, so cgroup2 may have it)."""

    name: str
    hierarchy: int
    enabled: bool


def read_proc_cgroups(proc: Path = Path("/proc")) -> dict[str, ControllerRow]:
    """/proc/cgroups by controller name; empty where the kernel has no such file (it lists v1-capable ones)."""
    path = Path(proc) / "cgroups"
    if not path.exists():
        return {}
    out = {}
    for line in _read(path).splitlines():
        parts = line.split()
        if len(parts) == 4 and not line.startswith("#") and parts[1].isdigit():
            out[parts[0]] = ControllerRow(parts[0], int(parts[1]), parts[3] == "1")
    return out


@dataclass(frozen=True)
class Membership:
    """One line of /proc/<pid>/cgroup: hierarchy id (0 for cgroup2), its controllers, the process's path there."""

    hierarchy: int
    controllers: tuple[str, ...]
    path: str


def read_memberships(proc: Path = Path("/proc"), pid: str = "self") -> list[Membership]:
    """/proc/<pid>/cgroup: where the process is in each hierarchy ('4:memory:/a/b', '0::/a')."""
    out = []
    for line in _read(Path(proc) / str(pid) / "cgroup").splitlines():
        hid, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if hid.isdigit():
            out.append(Membership(int(hid), tuple(n for n in names.split(",") if n), path))
    return out


def own_cgroup2(proc: Path = Path("/proc"), pid: str = "self") -> str:
    """This process's cgroup v2 path, the '0::' line of /proc/<pid>/cgroup ('/' at the root)."""
    for line in _read(Path(proc) / pid / "cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise CgroupError(f"{proc}/{pid}/cgroup has no cgroup v2 line (0::); cgroup2 is not mounted")
