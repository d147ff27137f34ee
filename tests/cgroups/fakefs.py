"""A plain directory tree laid out like cgroupfs, and the kernel stand-in a Subtree is given for it.

`FakeCgroupfs` writes a small /proc and /sys (mountinfo, /proc/cgroups,
/proc/self/cgroup, online CPUs and nodes, MemTotal, the 1 GiB pool), a cgroup2
mount, and for the controllers named in `v1=` one cgroup v1 hierarchy each,
so the layouts this host does not have (pure cgroup2 with cpu, cpuset and
memory; v1 hierarchies with the test process somewhere below their root) can
be tested. As a `cgroups.kernel.Kernel` it does what the kernel would on
mkdir and rmdir (the interface files of the controllers the parent enables,
or of the v1 hierarchy, appear and go; a v1 cpuset child is born empty
unless its parent clones), checks that a root is inside its mounts, and
keeps device programs in memory with the tags the kernel would give them.
Writes to interface files are plain file writes: what the kernel checks at a
write (a memsw below the limit, a join to an empty cpuset, the v1 device
lists' semantics) is tested on the real kernel instead.
"""
from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path
from typing import Sequence

from cgroups import bpf, bpf_program
from cgroups.errors import CgroupError, NotCgroup2
from cgroups.tree import ALL_CONTROLLERS, Subtree
from cgroups.v1.memory import UNLIMITED

CORE = {"cgroup.procs": "", "cgroup.threads": "", "cgroup.events": "populated 0\nfrozen 0\n", "cgroup.freeze": "0",
        "cgroup.kill": "", "cgroup.type": "domain", "cgroup.subtree_control": "", "cgroup.max.depth": "max",
        "cgroup.stat": "nr_descendants 0\nnr_dying_descendants 0\n",
        "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n"}  # every cgroup2 cgroup has the usage lines
PER_CONTROLLER = {
    "cpu": {"cpu.max": "max 100000", "cpu.weight": "100",
            "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n"},
    "cpuset": {"cpuset.cpus": "", "cpuset.mems": ""},
    "memory": {"memory.max": "max", "memory.high": "max", "memory.low": "0", "memory.min": "0",
               "memory.swap.max": "max", "memory.current": "0", "memory.swap.current": "0",
               "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"},
    "hugetlb": {f"hugetlb.{size}.{f}": v for size in ("2MB", "1GB")
                for f, v in (("max", "max"), ("rsvd.max", "max"), ("current", "0"), ("rsvd.current", "0"),
                             ("events", "max 0\n"), ("events.local", "max 0\n"), ("numa_stat", "total=0\n"))},
}
V1_CORE = {"cgroup.procs": "", "tasks": "", "cgroup.clone_children": "0", "notify_on_release": "0"}
V1_PER_CONTROLLER = {
    "cpu": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "-1", "cpu.shares": "1024",
            "cpu.stat": "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n"},
    "cpuset": {"cpuset.cpus": "", "cpuset.mems": "", "cpuset.effective_cpus": "", "cpuset.effective_mems": ""},
    "memory": {"memory.limit_in_bytes": str(UNLIMITED), "memory.usage_in_bytes": "0", "memory.failcnt": "0",
               "memory.max_usage_in_bytes": "0", "memory.soft_limit_in_bytes": str(UNLIMITED),
               "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
               "memory.use_hierarchy": "1"},
    "hugetlb": {"hugetlb.1GB.limit_in_bytes": str(UNLIMITED), "hugetlb.1GB.rsvd.limit_in_bytes": str(UNLIMITED),
                "hugetlb.1GB.usage_in_bytes": "0", "hugetlb.1GB.rsvd.usage_in_bytes": "0",
                "hugetlb.1GB.failcnt": "0", "hugetlb.1GB.max_usage_in_bytes": "0"},
}
MEMSW = {"memory.memsw.limit_in_bytes": str(UNLIMITED), "memory.memsw.usage_in_bytes": "0",
         "memory.memsw.failcnt": "0"}


class FakeCgroupfs:
    """A cgroup2 mount at base/cgroup offering `controllers`, and one v1 hierarchy at base/v1/<c> for each of `v1`
    (taken off cgroup2's offer, as a hybrid boot does). own_v1: where this 'process' is in a v1 hierarchy
    (default its root), e.g. {"memory": "/process_api/x"} as on the hybrid test host."""

    def __init__(self, base: Path, controllers=("cpuset", "cpu", "io", "memory", "hugetlb", "pids"), *,
                 v1: Sequence[str] = (), own_v1: dict[str, str] | None = None, swap: bool = True,
                 cpus: str = "0-7", mems: str = "0-1", mem_total_kib: int = 64 * 1024 * 1024,
                 pages_1g: int = 4) -> None:
        if "devices" in v1:
            raise ValueError("the fake tree cannot act out the v1 device lists; tests/cgroups/test_kernel_v1.py "
                             "tests them on the real kernel")
        self.base = base
        self.mount = base / "cgroup"
        self.proc = base / "proc"
        self.sys = base / "sys"
        self.swap = swap
        self.v1 = {c: base / "v1" / c for c in v1}
        self._programs: dict[Path, list[bpf.ProgramInfo]] = {}
        self._ids = itertools.count(100)
        offered = [c for c in controllers if c not in self.v1]
        self.mount.mkdir(parents=True)
        for name, value in CORE.items():
            (self.mount / name).write_text(value)
        (self.mount / "cgroup.controllers").write_text(" ".join(offered) + "\n")
        (self.mount / "cpuset.cpus.effective").write_text(cpus + "\n")
        (self.mount / "cpuset.mems.effective").write_text(mems + "\n")
        (self.proc / "self").mkdir(parents=True)
        (self.proc / "meminfo").write_text(f"MemTotal:       {mem_total_kib} kB\nMemFree:        1 kB\n")
        mountinfo = [f"41 31 0:38 / {self.mount} rw,relatime - cgroup2 cgroup2 rw"]
        table = ["#subsys_name\thierarchy\tnum_cgroups\tenabled"]
        membership = ["0::/"]
        names = list(dict.fromkeys([*ALL_CONTROLLERS, *controllers, *self.v1, "devices"]))
        for hid, c in enumerate(self.v1, start=1):
            mountinfo.append(f"{50 + hid} 31 0:{50 + hid} / {self.v1[c]} rw,relatime - cgroup cgroup rw,{c}")
            membership.insert(0, f"{hid}:{c}:{(own_v1 or {}).get(c, '/')}")
        for c in names:
            hid = list(self.v1).index(c) + 1 if c in self.v1 else 0
            table.append(f"{c}\t{hid}\t1\t1")
        (self.proc / "self/mountinfo").write_text("\n".join(mountinfo) + "\n")
        (self.proc / "cgroups").write_text("\n".join(table) + "\n")
        (self.proc / "self/cgroup").write_text("\n".join(membership) + "\n")
        (self.sys / "devices/system/cpu").mkdir(parents=True)
        (self.sys / "devices/system/cpu/online").write_text(cpus + "\n")
        (self.sys / "devices/system/node").mkdir(parents=True)
        (self.sys / "devices/system/node/online").write_text(mems + "\n")
        (self.sys / "kernel/mm/hugepages/hugepages-1048576kB").mkdir(parents=True)
        (self.sys / "kernel/mm/hugepages/hugepages-1048576kB" / "nr_hugepages").write_text(f"{pages_1g}\n")
        for c, mount in self.v1.items():
            mount.mkdir(parents=True)
            self._v1_files(c, mount, None)
            if c == "cpuset":
                for name, value in (("cpuset.cpus", cpus), ("cpuset.mems", mems), ("cpuset.effective_cpus", cpus),
                                    ("cpuset.effective_mems", mems)):
                    (mount / name).write_text(value + "\n")
            own = mount
            for part in Path((own_v1 or {}).get(c, "/")).parts[1:]:
                own = own / part
                self.mkdir(own)

    # -- what the kernel does on mkdir and rmdir -----------------------------

    def _v1_hierarchy(self, path: Path) -> str | None:
        for c, mount in self.v1.items():
            if path == mount or mount in path.parents:
                return c
        return None

    def _v1_files(self, c: str, path: Path, parent: Path | None) -> None:
        files = {**V1_CORE, **V1_PER_CONTROLLER.get(c, {}), **(MEMSW if c == "memory" and self.swap else {})}
        for name, value in files.items():
            (path / name).write_text(value + ("\n" if value and not value.endswith("\n") else ""))
        if c == "cpuset" and parent is not None and (parent / "cgroup.clone_children").read_text().strip() == "1":
            for name in ("cpuset.cpus", "cpuset.mems", "cpuset.effective_cpus", "cpuset.effective_mems"):
                (path / name).write_text((parent / name).read_text())

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)
        parent = path.parent
        hierarchy = self._v1_hierarchy(path)
        if hierarchy is not None:
            self._v1_files(hierarchy, path, parent)
            return
        enabled = [t.lstrip("+") for t in (parent / "cgroup.subtree_control").read_text().split()
                   if not t.startswith("-")]
        for name, value in CORE.items():
            (path / name).write_text(value)
        (path / "cgroup.controllers").write_text(" ".join(enabled) + "\n")
        for c in enabled:
            for name, value in PER_CONTROLLER.get(c, {}).items():
                (path / name).write_text(value)
            if c == "cpuset":
                for f in ("cpuset.cpus.effective", "cpuset.mems.effective"):
                    (path / f).write_text((parent / f).read_text())

    def rmdir(self, path: Path) -> None:
        if any(p.is_dir() for p in path.iterdir()):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        for p in path.iterdir():
            p.unlink()
        os.rmdir(path)  # its xattrs, if any, go with it
        self._programs.pop(path, None)

    def check_cgroup2(self, path: Path) -> None:
        if not (path == self.mount or self.mount in Path(path).parents):
            raise NotCgroup2(path, f"a plain directory outside the fake cgroup2 mount {self.mount}")

    def check_cgroup1(self, path: Path) -> None:
        if self._v1_hierarchy(Path(path)) is None:
            raise CgroupError(f"{path} is outside the fake v1 hierarchies {sorted(map(str, self.v1.values()))}",
                              path=path)

    # -- device programs, kept in memory ---------------------------------------

    def expected_tag(self, insns) -> bytes:
        return bpf_program.program_tag(insns, "sha256")

    def install_program(self, cgroup: Path, insns) -> int:
        tag = self.expected_tag(insns)
        current = self._programs.get(cgroup, [])
        if len(current) == 1 and current[0].tag == tag:
            return current[0].id
        new = bpf.ProgramInfo(next(self._ids), tag, bpf.PROGRAM_NAME, bpf.BPF_PROG_TYPE_CGROUP_DEVICE)
        self._programs[cgroup] = [new]
        return new.id

    def programs(self, cgroup: Path) -> list[bpf.ProgramInfo]:
        return list(self._programs.get(cgroup, []))

    def program_ids(self, cgroup: Path) -> list[int]:
        return [p.id for p in self._programs.get(cgroup, [])]

    def detach_programs(self, cgroup: Path, ids) -> None:
        self._programs[cgroup] = [p for p in self._programs.get(cgroup, []) if p.id not in set(ids)]

    # -- helpers for tests -------------------------------------------------------

    def child(self, name: str) -> Path:
        """A child of the cgroup2 mount made the way the kernel would (for a Subtree root)."""
        path = self.mount / name
        self.mkdir(path)
        return path

    def subtree(self, root: Path | None = None, **kw) -> Subtree:
        from cgroups.record import XattrRecords

        kw.setdefault("controllers", ALL_CONTROLLERS)
        if XattrRecords.probe(self.mount) is None:  # a filesystem without xattrs (some CI sandboxes)
            kw.setdefault("state_dir", self.base / "state")
        return Subtree(root or self.mount, kernel=self, proc=self.proc, sys=self.sys, **kw)
