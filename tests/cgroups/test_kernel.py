"""cgroups/ on the real kernel: device programs, 1 GiB hugetlb limits, cgroup.kill, recovery and drift.

Every cgroup lives below a fresh directory under the test's own cgroup (the
own_cgroup2 fixture), every process is started here with a time bound and
ended by pid or by its cgroup, and 1 GiB pages are lent for one test only.
Features the machine lacks are skipped with the reason.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import stat
import textwrap
import time

import pytest

from cgroups import bpf, bpf_program, host
from cgroups.devices import harmless_rules, rule
from cgroups.files import Drift, read_file, write_file
from cgroups.share import CgroupShare
from cgroups.errors import NotCgroup2
from cgroups.tree import Subtree, signal_cgroup, wait_event
from tests.cgroups.children import OPENER, ask, end, outgrow_memory, spawn
from tests.waiting import wait_for

pytestmark = pytest.mark.kernel
GIB = 1 << 30

# -- device programs -------------------------------------------------------


@pytest.mark.parametrize("replace", [True, False], ids=["BPF_F_REPLACE", "attach-then-detach"])
def test_device_program_allows_only_its_rules_and_a_change_swaps_them(own_cgroup2, bpf_works, tmp_path,
                                                                      monkeypatch, replace):
    if not replace:
        monkeypatch.setattr(bpf, "has_prog_replace", lambda: False)
    n0, n1 = tmp_path / "nvidia0", tmp_path / "nvidia1"
    os.mknod(n0, stat.S_IFCHR | 0o600, os.makedev(195, 0))
    os.mknod(n1, stat.S_IFCHR | 0o600, os.makedev(195, 1))
    st = Subtree(own_cgroup2, controllers=())
    first = st.apply("rsv-dev", CgroupShare(), list(harmless_rules()) + [rule("c", 195, 0, "rw")])
    child = spawn(OPENER)
    try:
        st.move("rsv-dev", child.pid)
        child.stdin.write("go\n")
        probe = f"{n0} {n1} /dev/null"
        # ENXIO: the filter let the open through to a major with no driver; EPERM: the filter said no
        assert {str(n0): errno.ENXIO, str(n1): errno.EPERM, "/dev/null": 0} == json.loads(ask(child, probe))
        second = st.apply("rsv-dev", CgroupShare(), list(harmless_rules()) + [rule("c", 195, 1, "rw")])
        assert {str(n0): errno.EPERM, str(n1): errno.ENXIO, "/dev/null": 0} == json.loads(ask(child, probe))
    finally:
        end(child)
    assert first.program_ids != second.program_ids
    assert [second.program_ids[0]] == bpf.query_ids(own_cgroup2 / "rsv-dev")
    assert bpf.expected_tag(bpf_program.build(second.rules)) == bpf.attached(own_cgroup2 / "rsv-dev")[0].tag


def test_applying_the_same_rules_again_keeps_the_attached_program(own_cgroup2, bpf_works):
    st = Subtree(own_cgroup2, controllers=())
    a = st.apply("rsv-dev", CgroupShare(), harmless_rules())
    b = st.apply("rsv-dev", CgroupShare(), reversed(harmless_rules()))
    assert a.program_ids == b.program_ids == tuple(bpf.query_ids(a.path))


def test_this_kernel_can_replace_programs_in_place(bpf_works):
    assert bpf.has_prog_replace()


def test_a_root_on_a_cgroup_v1_hierarchy_is_refused():
    v1 = [m.mount_point for m in host.read_mountinfo() if m.fstype == "cgroup"]
    if not v1:
        pytest.skip("no cgroup v1 hierarchy mounted here")
    with pytest.raises(NotCgroup2, match="cgroup v1"):
        Subtree(v1[0] / "berth-never-created")
    assert not (v1[0] / "berth-never-created").exists()


# -- 1 GiB hugepages ---------------------------------------------------------


HUGE = textwrap.dedent("""
    import mmap, sys
    MAP_HUGETLB, MAP_HUGE_1GB = 0x40000, 30 << 26
    GIB = 1 << 30
    def one():
        m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | MAP_HUGE_1GB)
        m[0] = 1  # fault the page in
        return m
    held = [one()]
    print("first ok", flush=True)
    try:
        held.append(one())
        print("second ok", flush=True)
    except OSError as exc:
        print(f"second errno {exc.errno}", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.slow
def test_hugetlb_limit_maps_one_1g_page_and_refuses_the_second(own_cgroup2, hugetlb_for_own_cgroup,
                                                               reserved_1g_hugepages):
    reserved_1g_hugepages(2)
    st = Subtree(own_cgroup2, controllers=("hugetlb",))
    results = {}
    for pages in (1, 2):  # 2: the control, both pages are there to be had
        c = st.apply(f"rsv-huge{pages}", CgroupShare(hugepages_1g=pages))
        assert str(pages * GIB) == read_file(c.path, "hugetlb.1GB.max")
        child = spawn(HUGE)
        try:
            st.move(c.name, child.pid)
            child.stdin.write("go\n")
            child.stdin.flush()
            results[pages] = (child.stdout.readline().strip(), child.stdout.readline().strip())
            usage = st.stat(c.name).hugetlb
        finally:
            end(child)
        st.remove(c.name)
        if pages == 1:
            assert (GIB, GIB) == (usage.current_bytes, usage.rsvd_current_bytes or GIB)
    # with hugetlb.1GB.rsvd.max the second mmap() itself fails (ENOMEM); without it the touch would SIGBUS
    assert {1: ("first ok", f"second errno {errno.ENOMEM}"), 2: ("first ok", "second ok")} == results


# -- kill and remove -----------------------------------------------------------


FORK_TREE = textwrap.dedent("""
    import os, sys, time
    for _ in range(50):
        if os.fork() == 0:
            if os.fork() == 0:
                time.sleep(30); os._exit(0)
            time.sleep(30); os._exit(0)
    print("ready", flush=True)
    time.sleep(30)
""")


@pytest.mark.parametrize("how", ["cgroup.kill", "freeze-and-signal"])
def test_kill_ends_a_bounded_fork_tree_and_remove_waits_for_it(own_cgroup2, how):
    st = Subtree(own_cgroup2, controllers=())
    c = st.apply("rsv-kill", CgroupShare())
    child = spawn(FORK_TREE)
    try:
        st.move(c.name, child.pid)
        assert "ready" == ask(child, "go").strip()
        wait_for(lambda: len(st.procs(c.name)) == 101, what="101 processes in the cgroup")
        started = time.monotonic()
        if how == "cgroup.kill":
            st.kill(c.name)
        else:
            signal_cgroup(c.path)
        assert wait_event(c.path, "populated", 0, 10.0)
        st.remove(c.name, timeout=10.0)
        elapsed = time.monotonic() - started
    finally:
        end(child)
    assert not c.path.exists()
    assert elapsed < 10.0
    assert -signal.SIGKILL == child.returncode


def test_remove_kills_what_is_inside_and_waits_until_gone(own_cgroup2):
    st = Subtree(own_cgroup2, controllers=())
    c = st.apply("rsv-rm", CgroupShare())
    child = spawn("import time; time.sleep(30)")
    try:
        st.move(c.name, child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        st.remove(c.name, timeout=5.0)
        assert not c.path.exists()
        assert -signal.SIGKILL == child.wait(timeout=5)
    finally:
        end(child)


def test_freeze_and_thaw_report_in_cgroup_events(own_cgroup2):
    st = Subtree(own_cgroup2, controllers=())
    c = st.apply("rsv-frz", CgroupShare())
    child = spawn("import time; time.sleep(30)")
    try:
        st.move(c.name, child.pid)
        st.freeze(c.name)
        assert st.stat(c.name).frozen
        st.thaw(c.name)
        assert not st.stat(c.name).frozen
    finally:
        end(child)


# -- recovery and drift --------------------------------------------------------


def test_a_restarted_subtree_lists_what_was_made_and_adopts_it_unchanged(own_cgroup2, bpf_works):
    st = Subtree(own_cgroup2, controllers=())
    made = {
        "rsv-a": st.apply("rsv-a", CgroupShare(vcpu_milli=1000), harmless_rules()),
        "rsv-b": st.apply("rsv-b", CgroupShare(memory_bytes=GIB), list(harmless_rules()) + [rule("c", 195, 2, "rw")]),
        "rsv-c": st.apply("rsv-c", CgroupShare()),  # devices not filtered
    }
    child = spawn("import time; time.sleep(30)")
    try:
        st.move("rsv-a", child.pid)
        del st
        again = Subtree(own_cgroup2, controllers=())
        found = {c.name: c for c in again.list()}
        assert {n: (c.share, c.rules, c.program_ids) for n, c in made.items()} == {
            n: (c.share, c.rules, c.program_ids) for n, c in found.items()}
        assert [child.pid] == again.procs("rsv-a")
        assert made["rsv-b"].program_ids == again.apply("rsv-b", found["rsv-b"].share, found["rsv-b"].rules).program_ids
        assert all([] == again.drift(n) for n in made)
    finally:
        end(child)


def test_drift_finds_a_changed_limit_and_a_lost_or_extra_program_and_repair_restores_them(
        own_cgroup2, bpf_works, hugetlb_for_own_cgroup):
    st = Subtree(own_cgroup2, controllers=("hugetlb",))
    c = st.apply("rsv-drift", CgroupShare(hugepages_1g=0), harmless_rules())
    tag = bpf.attached(c.path)[0].tag.hex()
    # behind the subtree's back: a limit raised, the device program detached (every device open)
    write_file(c.path, "hugetlb.1GB.max", str(GIB))
    bpf.detach_ids(c.path, list(c.program_ids))
    again = Subtree(own_cgroup2, controllers=("hugetlb",))
    assert [Drift("hugetlb.1GB.max", "0", str(GIB)), Drift("devices", f"1 program, tag {tag}", "0 program(s): none")
            ] == again.drift(c.name)
    again.repair(c.name)
    assert [] == again.drift(c.name)
    # a second program attached beside ours
    stub = [bpf_program.Insn(bpf_program.MOV32_K, 0, imm=1), bpf_program.Insn(bpf_program.EXIT)]
    fd, cfd = bpf.load(stub), bpf.open_cgroup(c.path)
    try:
        bpf.attach(cfd, fd)
    finally:
        os.close(fd)
        os.close(cfd)
    assert ["devices"] == [d.what for d in again.drift(c.name)]
    again.repair(c.name)
    assert ([], 1) == (again.drift(c.name), len(bpf.query_ids(c.path)))


# -- cpu, cpuset, memory wherever this host has them: cgroup2 or a v1 hierarchy ----------------


def _placed(layout, controller: str) -> str:
    place = layout.place(controller)
    if place is None:
        pytest.skip(f"{controller} is absent on this host: {layout.why_absent(controller)}")
    return place


@pytest.mark.parametrize("controller,share,expected", [
    ("cpu", CgroupShare(vcpu_milli=1500), {"v2": {"cpu.max": "150000 100000"},
                                           "v1": {"cpu.cfs_quota_us": "150000", "cpu.cfs_period_us": "100000",
                                                  "cpu.shares": "1536"}}),
    ("cpuset", CgroupShare(cpus="0", mems="0"), {"v2": {"cpuset.cpus": "0", "cpuset.mems": "0"},
                                                 "v1": {"cpuset.cpus": "0", "cpuset.mems": "0"}}),
    ("memory", CgroupShare(memory_bytes=256 << 20), {"v2": {"memory.max": str(256 << 20), "memory.swap.max": "0"},
                                                     "v1": {"memory.limit_in_bytes": str(256 << 20),
                                                            "memory.memsw.limit_in_bytes": str(256 << 20)}}),
])
def test_limits_read_back_from_the_real_kernel(own_cgroup2, host_layout, controller, share, expected):
    place = _placed(host_layout, controller)
    st = Subtree(own_cgroup2, controllers=(controller,))
    c = st.apply("rsv-lim", share)
    d = c.path if place == "v2" else c.parts[controller]
    want = expected[place]
    assert want == {k: read_file(d, k) for k in want if (d / k).exists()}
    assert [] == st.drift(c.name)
    st.remove(c.name)


def test_a_process_above_its_memory_limit_is_oom_killed_and_counted(own_cgroup2, host_layout):
    _placed(host_layout, "memory")
    st = Subtree(own_cgroup2, controllers=("memory",))
    c = st.apply("rsv-oom", CgroupShare(memory_bytes=64 << 20))
    assert -signal.SIGKILL == outgrow_memory(st, c.name)
    memory = st.stat(c.name).memory
    assert memory.oom_kills >= 1
    st.remove(c.name)
