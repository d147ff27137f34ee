"""Where each controller lives on this host (cgroup2, a cgroup v1 hierarchy, or nowhere), and where a subtree's
root lies in each v1 hierarchy.

Probed once from /proc/self/mountinfo, /proc/cgroups and the cgroup2 mount's
cgroup.controllers, with /proc as a parameter so tests point it at a
hand-made tree. Three layouts come out of the same probe: unified (every
controller on cgroup2), hybrid (cgroup2 mounted, e.g. at
/sys/fs/cgroup/unified, while cpu, cpuset, memory, devices... stay bound to v1
hierarchies) and legacy (no cgroup2; not enough for a Subtree, whose root is a
cgroup2 directory). Nothing here writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from . import host
from .errors import CgroupError, FileMissing
from .files import parse_list, read_file

# The controllers the package can enforce. "devices" is not a cgroup2 controller: there it is the eBPF program,
# which every cgroup2 cgroup can carry; on a v1 hierarchy it is the devices.allow / devices.deny lists.
KNOWN = ("cpuset", "cpu", "memory", "hugetlb", "devices")
Place = Literal["v2", "v1"]


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy: its id (0 is cgroup2), its controllers, where it is mounted."""

    id: int
    controllers: frozenset[str]
    mount: Path
    mount_root: str = "/"  # the hierarchy path shown at the mount point ('/' unless a cgroup namespace hides more)

    def dir_of(self, path: str) -> Path:
        """The directory of the cgroup at hierarchy path `path` ('/a/b')."""
        rel = _rel(path, self.mount_root)
        if rel is None:
            raise CgroupError(f"cgroup {path} of hierarchy {self.id} is not visible below {self.mount} (which shows "
                              f"{self.mount_root} of it)", path=self.mount)
        return self.mount.joinpath(*rel)

    def path_of(self, dir: Path) -> str:
        """The hierarchy path of a directory below the mount point (the inverse of dir_of)."""
        try:
            rel = Path(dir).relative_to(self.mount)
        except ValueError:
            raise CgroupError(f"{dir} is not below the mount of hierarchy {self.id} ({self.mount})", path=dir) from None
        return str(PurePosixPath(self.mount_root).joinpath(*rel.parts))


@dataclass(frozen=True)
class Layout:
    """What the probe found: the cgroup2 hierarchy (if mounted), the v1 hierarchies, and why a controller is absent."""

    v2: Hierarchy | None
    v1: tuple[Hierarchy, ...] = ()
    absent: dict[str, str] = field(default_factory=dict)  # controller -> why it cannot be enforced here

    def place(self, controller: str) -> Place | None:
        """'v2', 'v1' or None (absent) for one of KNOWN."""
        if controller in self.absent:
            return None
        if any(controller in h.controllers for h in self.v1):
            return "v1"
        if self.v2 is not None and (controller in self.v2.controllers or controller == "devices"):
            return "v2"
        return None

    def places(self) -> dict[str, Place]:
        """Every enforceable controller of KNOWN and where: what an agent may enforce on this host."""
        return {c: p for c in KNOWN if (p := self.place(c)) is not None}

    def hierarchy(self, controller: str) -> Hierarchy | None:
        """The hierarchy that enforces the controller (cgroup2 for 'v2')."""
        place = self.place(controller)
        if place == "v1":
            return next(h for h in self.v1 if controller in h.controllers)
        return self.v2 if place == "v2" else None

    def why_absent(self, controller: str) -> str:
        return self.absent.get(controller, f"{controller} is not available on this host")

    def summary(self) -> str:
        parts = []
        for c, p in self.places().items():
            h = self.hierarchy(c)
            parts.append(f"{c}: {p} ({h.mount})" if h is not None else f"{c}: {p}")
        parts += [f"{c}: absent ({why})" for c, why in self.absent.items()]
        return "; ".join(parts)


def probe_layout(proc: Path = Path("/proc")) -> Layout:
    """Read where each controller of KNOWN lives: /proc/self/mountinfo for the mounts, /proc/cgroups for the
    hierarchy each controller is bound to (0: none) and whether it is enabled, cgroup2's cgroup.controllers."""
    mounts = host.read_mountinfo(proc)
    table = host.read_proc_cgroups(proc)
    v2 = None
    for m in mounts:
        if m.fstype == "cgroup2":
            try:
                offered = frozenset(parse_list(read_file(m.mount_point, "cgroup.controllers")))
            except FileMissing:
                offered = frozenset()
            v2 = Hierarchy(0, offered, m.mount_point, m.root)
            break
    v1: dict[int, Hierarchy] = {}
    for m in mounts:
        if m.fstype != "cgroup":
            continue
        names = frozenset(o for o in m.super_options if o in table)
        if not names:
            continue
        hid = table[next(iter(names))].hierarchy
        if hid not in v1 or (v1[hid].mount_root != "/" and m.root == "/"):  # a bind mount of part of it: keep the whole
            v1[hid] = Hierarchy(hid, names, m.mount_point, m.root)
    absent = {}
    for c in KNOWN:
        row = table.get(c)
        if row is not None and not row.enabled:
            absent[c] = f"{c} is disabled on this kernel (cgroup_disable={c} on its command line?)"
        elif row is not None and row.hierarchy != 0 and row.hierarchy not in v1:
            absent[c] = (f"{c} is bound to cgroup v1 hierarchy {row.hierarchy}, which is not mounted here: mount it "
                         f"(mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}) or boot with cgroup_no_v1={c}")
        elif (row is None or row.hierarchy == 0) and c != "devices" and (v2 is None or c not in v2.controllers):
            absent[c] = (f"the kernel offers no {c} controller ({v2.mount}/cgroup.controllers lacks it)"
                         if v2 is not None else f"{c} is on no mounted hierarchy (cgroup2 is not mounted)")
        elif c == "devices" and v2 is None and (row is None or row.hierarchy == 0):
            absent[c] = "no device filter: cgroup2 is not mounted and devices is on no v1 hierarchy"
    return Layout(v2, tuple(sorted(v1.values(), key=lambda h: h.id)), absent)


def _rel(path: str, top: str) -> tuple[str, ...] | None:
    p, t = PurePosixPath(path).parts[1:], PurePosixPath(top).parts[1:]
    return p[len(t):] if p[:len(t)] == t else None


def v1_path_for(v2_path: str, own_v2: str, own_v1: str) -> str:
    """The v1 hierarchy path that corresponds to cgroup2 path `v2_path`, by where one process is in both.

    Below the process's own v2 cgroup: the same relative path below its own v1
    cgroup (under systemd with Delegate=yes the unit exists in every
    hierarchy, so this maps cleanly; on a host that puts a process at
    /process_api/<id> in the memory hierarchy only, that is honoured).
    Elsewhere: step up from the process's v2 cgroup until it is an ancestor of
    v2_path; a level the process also sits in, by name, in v1 is stepped up
    there too, one it has only in v2 (the agent's own v2-only leaf) is not.
    """
    a2 = list(PurePosixPath(own_v2).parts[1:])
    a1 = list(PurePosixPath(own_v1).parts[1:])
    target = PurePosixPath(v2_path).parts[1:]
    while tuple(a2) != target[:len(a2)]:
        leaf = a2.pop()
        if a1 and a1[-1] == leaf:
            a1.pop()
    return str(PurePosixPath("/").joinpath(*a1, *target[len(a2):]))


def v1_roots_for(layout: Layout, v2_root: Path, controllers: tuple[str, ...], *, proc: Path = Path("/proc"),
                 pid: int | str = "self") -> dict[str, Path]:
    """The directory in each controller's v1 hierarchy that stands for the cgroup2 directory v2_root, anchored on
    where process `pid` is in cgroup2 and in that hierarchy (see v1_path_for). Controllers not on v1 are left out."""
    wanted = [c for c in controllers if layout.place(c) == "v1"]
    if not wanted:
        return {}
    if layout.v2 is None:
        raise CgroupError("cgroup2 is not mounted: a subtree's root is a cgroup2 directory")
    v2_path = layout.v2.path_of(v2_root)
    member = {m.hierarchy: m.path for m in host.read_memberships(proc, str(pid))}
    if 0 not in member:
        raise CgroupError(f"{proc}/{pid}/cgroup has no cgroup2 line (0::)")
    out = {}
    for c in wanted:
        h = layout.hierarchy(c)
        assert h is not None
        if h.id not in member:
            raise CgroupError(f"{proc}/{pid}/cgroup has no line for hierarchy {h.id} ({c})")
        out[c] = h.dir_of(v1_path_for(v2_path, member[0], member[h.id]))
    return out
