"""Fixtures for cgroups/: a private cgroup v2 directory below the test's own (and its counterpart below the test's
own cgroup in every v1 hierarchy, removed with it), 1 GiB pages lent and given back, hugetlb switched on for the
test's cgroup and back off, the host's layout, and plain directory trees laid out like cgroupfs (fakefs.py).

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
from cgroups.layout import Layout, probe_layout
from tests.cgroups.fakefs import FakeCgroupfs  # noqa: F401 (also imported from here by the agent's tests)

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
    """Kill everything below path, wait until it is empty, remove it bottom-up. For teardown only. A cgroup v1
    directory (no cgroup.events) is emptied by signalling the pids of its cgroup.procs files."""
    if not path.exists():
        return
    deadline = time.monotonic() + timeout
    kill = path / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")
    events = path / "cgroup.events"
    while time.monotonic() < deadline:
        pids = [int(p) for d, _, _ in os.walk(path) for p in (Path(d) / "cgroup.procs").read_text().split()]
        if ("populated 0" in events.read_text()) if events.exists() else not pids:
            break
        for pid in pids:  # kernels without cgroup.kill, and v1
            try:
                os.kill(pid, signal.SIGKILL)
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


def v1_mirrors(name: str) -> list[Path]:
    """Where a directory `name` made right below this process's own cgroup2 cgroup stands in each mounted v1
    hierarchy: the same name below this process's own cgroup there (what a Subtree rooted at it uses)."""
    own = {m.hierarchy: m.path for m in host.read_memberships()}
    out = []
    for h in probe_layout().v1:
        if h.id in own:
            out.append(h.dir_of(own[h.id]) / name)
    return out


AGENT_V1 = ("cpu", "cpuset", "memory", "devices")  # what an agent enforces on a v1 hierarchy where the host has it


def join_script(v2_dir: Path) -> str:
    """A shell line that puts the shell into v2_dir (below this process's own cgroup2 cgroup) and into the same
    place below this process's own cgroup in each v1 hierarchy an agent uses (cpu, cpuset, memory, devices, where
    the host keeps them on v1): the cgroups a unit with Delegate=yes has on a hybrid systemd host. An agent started
    that way anchors its v1 directories below its own (inside the test's tree, removed with it) instead of at the
    top of each hierarchy, where agents would share them. A new cpuset level gets its parent's cpus and mems (a
    v1 cpuset takes no task before)."""
    line = f'echo $$ > "{v2_dir}/cgroup.procs"'
    layout = probe_layout()
    own = {m.hierarchy: m.path for m in host.read_memberships()}
    rel = v2_dir.relative_to(_own_cgroup2_dir())
    seen: set[int] = set()
    for c in AGENT_V1:
        h = layout.hierarchy(c) if layout.place(c) == "v1" else None
        if h is None or h.id in seen or h.id not in own:
            continue
        seen.add(h.id)
        d = h.dir_of(own[h.id])
        for part in rel.parts:
            d = d / part
            if not d.is_dir():
                d.mkdir()
                if "cpuset" in h.controllers:
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        (d / f).write_text((d.parent / f).read_text())
        line += f' && echo $$ > "{d}/cgroup.procs"'
    return line


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
        for mirror in v1_mirrors(path.name):
            remove_tree(mirror)
        remove_tree(path)


@pytest.fixture(scope="session")
def host_layout() -> Layout:
    return probe_layout()


@pytest.fixture
def hybrid(host_layout) -> Layout:
    """Skip unless cpu, cpuset and memory are cgroup v1 controllers here (the hybrid layout)."""
    for c in ("cpu", "cpuset", "memory"):
        if host_layout.place(c) != "v1":
            pytest.skip(f"{c} is not a cgroup v1 controller on this host ({host_layout.summary()}); the v1 backend "
                        "is tested on the fake v1 tree here")
    return host_layout


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


@pytest.fixture
def fake_cgroupfs(tmp_path: Path) -> FakeCgroupfs:
    """A pure cgroup2 host: cpuset, cpu, memory and hugetlb all on cgroup2."""
    return FakeCgroupfs(tmp_path)


@pytest.fixture
def fake_hybrid(tmp_path: Path) -> FakeCgroupfs:
    """A hybrid host like the test machines: cpu, cpuset, memory on v1 (the process at /process_api/t1 in the
    memory hierarchy, at the root of the others), hugetlb and the device program on cgroup2."""
    return FakeCgroupfs(tmp_path, v1=("cpuset", "cpu", "memory"), own_v1={"memory": "/process_api/t1"})
