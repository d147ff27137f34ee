"""Fixtures for cgroups/: a private cgroup v2 directory below the test's own, 1 GiB pages lent and given back,
hugetlb switched on for the test's cgroup and back off, and a plain directory tree laid out like cgroupfs.

Everything a fixture makes it removes in its teardown, also when the test fails.
"""
from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from cgroups import bpf, host
from cgroups.errors import CgroupError

HUGE_1G = Path("/sys") / "kernel/mm/hugepages/hugepages-1048576kB"


# -- the real kernel ---------------------------------------------------------


def _own_cgroup2_dir() -> Path:
    if os.geteuid() != 0:
        pytest.skip("real-kernel cgroup tests need root")
    mount = host.cgroup2_mount()
    if mount is None:
        pytest.skip("cgroup2 is not mounted on this host")
    own = mount / host.own_cgroup2().lstrip("/")
    if not own.is_dir():
        pytest.skip(f"own cgroup2 directory {own} is not visible (cgroup namespace?)")
    return own


def remove_tree(path: Path, timeout: float = 10.0) -> None:
    """Kill everything below path, wait until it is empty, remove it bottom-up. For teardown only."""
    if not path.exists():
        return
    deadline = time.monotonic() + timeout
    kill = path / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")
    while time.monotonic() < deadline:
        events = (path / "cgroup.events").read_text()
        if "populated 0" in events:
            break
        for d, _, _ in os.walk(path):  # kernels without cgroup.kill
            for pid in (Path(d) / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.005)
    dirs = sorted((Path(d) for d, _, _ in os.walk(path)), key=lambda p: -len(p.parts))
    for d in dirs:
        while True:
            try:
                d.rmdir()
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)


@pytest.fixture
def own_cgroup2() -> Path:
    """A fresh, uniquely named cgroup v2 directory below the test process's own cgroup; removed after."""
    own = _own_cgroup2_dir()
    path = own / f"berth-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup below {own}: {exc}")
    try:
        yield path
    finally:
        remove_tree(path)


@pytest.fixture(scope="session")
def bpf_works() -> None:
    try:
        bpf.tag_algorithm()
    except CgroupError as exc:
        pytest.skip(f"cannot load a BPF_PROG_TYPE_CGROUP_DEVICE program here: {exc}")


@pytest.fixture(scope="session")
def hugetlb_for_own_cgroup() -> None:
    """hugetlb switched on in the own cgroup's subtree_control for the session, and back off after if it was off.

    Needed for a child of our own cgroup to have hugetlb.* files at all. Only done where the own cgroup is
    the cgroup2 root (no processes rule does not apply there) and nobody else had it on.
    """
    own = _own_cgroup2_dir()
    if not HUGE_1G.exists():
        pytest.skip("this kernel has no 1 GiB hugepage size")
    if "hugetlb" not in (own / "cgroup.controllers").read_text().split():
        pytest.skip(f"hugetlb is not offered to {own} (cgroup.controllers)")
    enabled = (own / "cgroup.subtree_control").read_text().split()
    if "hugetlb" in enabled:
        yield
        return
    if host.own_cgroup2() != "/":
        pytest.skip(f"would have to enable hugetlb in {own}, which holds this test's process (no internal processes)")
    (own / "cgroup.subtree_control").write_text("+hugetlb")
    try:
        yield
    finally:
        deadline = time.monotonic() + 5.0
        while True:  # EBUSY while our removed cgroups are still dying
            try:
                (own / "cgroup.subtree_control").write_text("-hugetlb")
                break
            except OSError as exc:
                if time.monotonic() > deadline:  # someone else uses it now: leave it on, and say so
                    print(f"left hugetlb enabled in {own}: {exc}")
                    break
                time.sleep(0.05)


@pytest.fixture
def reserved_1g_hugepages():
    """reserve(n): add n 1 GiB pages to the host pool for this test; nr_hugepages is set back after, always."""
    if os.geteuid() != 0 or not HUGE_1G.exists():
        pytest.skip("reserving 1 GiB pages needs root and a kernel with the 1 GiB page size")
    nr = HUGE_1G / "nr_hugepages"
    before = int(nr.read_text())
    changed = []

    def reserve(n: int) -> int:
        free_before = int((HUGE_1G / "free_hugepages").read_text())
        nr.write_text(str(before + n))
        changed.append(True)
        free = int((HUGE_1G / "free_hugepages").read_text())
        if free - free_before < n:
            nr.write_text(str(before))
            pytest.skip(f"could not reserve {n} 1 GiB pages (memory too fragmented: got {free - free_before})")
        return n

    try:
        yield reserve
    finally:
        if changed:
            nr.write_text(str(before))
            assert int(nr.read_text()) == before, f"nr_hugepages not back to {before}: pages still in use"


# -- a plain tree laid out like cgroupfs ---------------------------------------


CORE = {"cgroup.procs": "", "cgroup.threads": "", "cgroup.events": "populated 0\nfrozen 0\n", "cgroup.freeze": "0",
        "cgroup.kill": "", "cgroup.type": "domain", "cgroup.subtree_control": "", "cgroup.max.depth": "max",
        "cgroup.stat": "nr_descendants 0\nnr_dying_descendants 0\n"}
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


class FakeCgroupfs:
    """What the kernel does on mkdir/rmdir in cgroupfs, on a plain directory: the interface files of the
    controllers the parent enables appear, and go with the directory."""

    def __init__(self, base: Path, controllers=("cpuset", "cpu", "io", "memory", "hugetlb", "pids"), *,
                 cpus: str = "0-7", mems: str = "0-1", mem_total_kib: int = 64 * 1024 * 1024,
                 pages_1g: int = 4) -> None:
        self.base = base
        self.mount = base / "cgroup"
        self.proc = base / "proc"
        self.sys = base / "sys"
        self.mount.mkdir(parents=True)
        for name, value in CORE.items():
            (self.mount / name).write_text(value)
        (self.mount / "cgroup.controllers").write_text(" ".join(controllers) + "\n")
        (self.mount / "cpuset.cpus.effective").write_text(cpus + "\n")
        (self.mount / "cpuset.mems.effective").write_text(mems + "\n")
        (self.proc / "self").mkdir(parents=True)
        (self.proc / "meminfo").write_text(f"MemTotal:       {mem_total_kib} kB\nMemFree:        1 kB\n")
        (self.proc / "self/mountinfo").write_text(
            f"41 31 0:38 / {self.mount} rw,relatime - cgroup2 cgroup2 rw\n")
        (self.sys / "devices/system/cpu").mkdir(parents=True)
        (self.sys / "devices/system/cpu/online").write_text(cpus + "\n")
        (self.sys / "devices/system/node").mkdir(parents=True)
        (self.sys / "devices/system/node/online").write_text(mems + "\n")
        (self.sys / "kernel/mm/hugepages/hugepages-1048576kB").mkdir(parents=True)
        (self.sys / "kernel/mm/hugepages/hugepages-1048576kB" / "nr_hugepages").write_text(f"{pages_1g}\n")

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)
        parent = path.parent
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

    def child(self, name: str) -> Path:
        """A child of the mount made the way the kernel would (for a Subtree root)."""
        path = self.mount / name
        self.mkdir(path)
        return path

    def subtree(self, root: Path | None = None, **kw):
        from cgroups.tree import Subtree

        from cgroups.record import XattrRecords

        kw.setdefault("controllers", ("cpuset", "cpu", "memory", "hugetlb"))
        if XattrRecords.probe(self.mount) is None:  # a filesystem without xattrs (some CI sandboxes)
            kw.setdefault("state_dir", self.base / "state")
        return Subtree(root or self.mount, fake_tree=self, proc=self.proc, sys=self.sys, **kw)


@pytest.fixture
def fake_cgroupfs(tmp_path: Path) -> FakeCgroupfs:
    return FakeCgroupfs(tmp_path)
