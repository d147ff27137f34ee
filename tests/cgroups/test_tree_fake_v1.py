"""The cgroup v1 backend on a plain tree laid out like a hybrid host (fakefs.py): the layout probe, where the
subtree's roots lie in each hierarchy, the v1 files a share gives, and recovery across hierarchies.

What the kernel checks at a write (memsw >= limit, a join to an empty cpuset,
the device lists) is tested on the real kernel in test_kernel_v1.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cgroups.errors import ControllerMissing, NotEnforceable, ShareTooLarge
from cgroups.files import Drift, read_file
from cgroups.layout import probe_layout, v1_path_for
from cgroups.share import CgroupShare
from cgroups.v1 import cpu as cpu_v1
from cgroups.v1 import memory as memory_v1
from tests.cgroups.fakefs import FakeCgroupfs

GIB = 1 << 30


def files(path, names):
    return {n: read_file(path, n) for n in names}


# -- where each controller lives, and where the roots lie -------------------------------------------------------


def test_the_probe_finds_each_controller_on_cgroup2_or_its_v1_hierarchy(fake_hybrid):
    layout = probe_layout(fake_hybrid.proc)
    assert {"cpuset": "v1", "cpu": "v1", "memory": "v1", "hugetlb": "v2", "devices": "v2"} == layout.places()
    assert fake_hybrid.v1["memory"] == layout.hierarchy("memory").mount
    assert fake_hybrid.mount == layout.hierarchy("hugetlb").mount


def test_a_controller_bound_to_an_unmounted_v1_hierarchy_or_disabled_is_absent_with_the_reason(tmp_path):
    fs = FakeCgroupfs(tmp_path, v1=("cpu",))
    table = (fs.proc / "cgroups").read_text().replace("memory\t0\t1\t1", "memory\t7\t1\t1") \
        .replace("cpuset\t0\t1\t1", "cpuset\t0\t1\t0")
    (fs.proc / "cgroups").write_text(table)
    layout = probe_layout(fs.proc)
    assert (None, None, "v1") == (layout.place("memory"), layout.place("cpuset"), layout.place("cpu"))
    assert "hierarchy 7, which is not mounted" in layout.why_absent("memory")
    assert "disabled" in layout.why_absent("cpuset")
    with pytest.raises(ControllerMissing, match="not mounted"):
        fs.subtree(controllers=("memory",)).prepare()


@pytest.mark.parametrize("v2_path,own_v2,own_v1,expected", [
    ("/t/rsv", "/", "/process_api/x", "/process_api/x/t/rsv"),  # below the own cgroup: the same relative path
    ("/s/unit/workloads", "/s/unit/agent", "/s/unit", "/s/unit/workloads"),  # the agent's leaf exists only in v2
    ("/s/unit/workloads", "/s/unit/agent", "/s/unit/agent", "/s/unit/workloads"),  # ... or in both
    ("/berth.slice/w.scope/workloads", "/user.slice/s.scope", "/user.slice/s.scope", "/berth.slice/w.scope/workloads"),
    ("/a", "/a", "/b", "/b"),
])
def test_a_v2_path_maps_to_v1_by_where_the_anchor_process_is_in_both(v2_path, own_v2, own_v1, expected):
    assert expected == v1_path_for(v2_path, own_v2, own_v1)


def test_the_v1_roots_lie_below_the_process_own_cgroup_in_each_hierarchy(fake_hybrid):
    st = fake_hybrid.subtree(fake_hybrid.mount / "agent" / "workloads", enable_from=fake_hybrid.mount)
    assert {"cpuset": fake_hybrid.v1["cpuset"] / "agent/workloads", "cpu": fake_hybrid.v1["cpu"] / "agent/workloads",
            "memory": fake_hybrid.v1["memory"] / "process_api/t1/agent/workloads"} == st.v1_roots
    assert {"cpuset": "v1", "cpu": "v1", "memory": "v1", "hugetlb": "v2", "devices": "v2"} == st.places
    st.prepare()
    assert all(d.is_dir() for d in st.v1_roots.values())
    # v1 cpuset cgroups the subtree made got their parent's lists (a new one starts empty) and clone_children
    for d in (fake_hybrid.v1["cpuset"] / "agent", st.v1_roots["cpuset"]):
        assert {"cpuset.cpus": "0-7", "cpuset.mems": "0-1", "cgroup.clone_children": "1"} == files(
            d, ["cpuset.cpus", "cpuset.mems", "cgroup.clone_children"])


def test_explicit_v1_roots_are_used_and_one_for_a_controller_not_on_v1_is_refused(fake_hybrid):
    mine = fake_hybrid.v1["cpu"] / "elsewhere"
    assert mine == fake_hybrid.subtree(v1_roots={"cpu": mine}).v1_roots["cpu"]
    with pytest.raises(ValueError, match="hugetlb"):
        fake_hybrid.subtree(v1_roots={"hugetlb": fake_hybrid.v1["cpu"] / "x"})


# -- the files a share gives -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("share,expected", [
    (CgroupShare(vcpu_milli=2500), {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "250000", "cpu.shares": "2560"}),
    (CgroupShare(vcpu_milli=1000, cpu_period_us=50_000),
     {"cpu.cfs_period_us": "50000", "cpu.cfs_quota_us": "50000", "cpu.shares": "1024"}),
    (CgroupShare(), {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "-1", "cpu.shares": "1024"}),
])
def test_cfs_quota_is_vcpu_times_period_and_shares_are_1024_per_vcpu(fake_hybrid, share, expected):
    c = fake_hybrid.subtree().apply("rsv-a", share)
    assert expected == files(c.parts["cpu"], expected)


@pytest.mark.parametrize("vcpu_milli,shares", [(None, 1024), (1, 2), (10, 10), (500, 512), (300_000, 262144)])
def test_shares_are_bounded_to_the_kernels_range(vcpu_milli, shares):
    assert shares == cpu_v1.shares_of(vcpu_milli)


@pytest.mark.parametrize("share,expected", [
    (CgroupShare(cpus="4-7,3", mems="1"), {"cpuset.cpus": "3-7", "cpuset.mems": "1"}),
    (CgroupShare(), {"cpuset.cpus": "0-7", "cpuset.mems": "0-1"}),  # no pinning: the parent's lists (never empty)
])
def test_a_v1_cpuset_holds_the_share_or_its_parents_lists(fake_hybrid, share, expected):
    c = fake_hybrid.subtree().apply("rsv-a", share)
    assert expected == files(c.parts["cpuset"], expected)


@pytest.mark.parametrize("swap", [True, False])
def test_memory_limit_and_memsw_are_equal_page_aligned_bytes(tmp_path, swap):
    fs = FakeCgroupfs(tmp_path, v1=("memory",), swap=swap)
    d = fs.subtree().apply("rsv-a", CgroupShare(memory_bytes=GIB + 100)).parts["memory"]
    assert str(GIB) == read_file(d, "memory.limit_in_bytes")
    assert (str(GIB) if swap else None) == (read_file(d, "memory.memsw.limit_in_bytes") if swap else None)
    assert swap == (d / "memory.memsw.limit_in_bytes").exists()


def test_memsw_is_written_first_when_the_limit_rises_and_last_when_it_falls():
    up = memory_v1.ordered(memory_v1.desired_memory(CgroupShare(memory_bytes=2 * GIB)), current_limit=GIB)
    down = memory_v1.ordered(memory_v1.desired_memory(CgroupShare(memory_bytes=GIB)), current_limit=2 * GIB)
    assert ([memory_v1.MEMSW, memory_v1.LIMIT], [memory_v1.LIMIT, memory_v1.MEMSW]) == (list(up), list(down))


def test_memory_high_has_no_v1_counterpart_and_is_refused_before_anything_is_written(fake_hybrid):
    with pytest.raises(NotEnforceable) as info:
        fake_hybrid.subtree().apply("rsv-a", CgroupShare(memory_bytes=GIB, memory_high_bytes=GIB // 2))
    assert "memory_high_bytes" == info.value.field
    assert not (fake_hybrid.mount / "rsv-a").exists()


def test_hugetlb_on_v1_gets_limit_and_rsvd_limit_in_bytes(tmp_path):
    fs = FakeCgroupfs(tmp_path, v1=("hugetlb",))
    st = fs.subtree(controllers=("hugetlb",))
    c = st.apply("rsv-a", CgroupShare(hugepages_1g=3))
    assert {"hugetlb.1GB.limit_in_bytes": str(3 * GIB), "hugetlb.1GB.rsvd.limit_in_bytes": str(3 * GIB)} == files(
        c.parts["hugetlb"], ["hugetlb.1GB.limit_in_bytes", "hugetlb.1GB.rsvd.limit_in_bytes"])
    assert (3 * GIB, 0) == (st.stat("rsv-a").hugetlb.max_bytes, st.stat("rsv-a").hugetlb.current_bytes)


def test_the_v1_parents_memory_limit_bounds_what_a_share_may_ask(fake_hybrid):
    st = fake_hybrid.subtree()
    st.prepare()
    (st.v1_roots["memory"] / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    with pytest.raises(ShareTooLarge) as info:
        st.apply("rsv-a", CgroupShare(memory_bytes=3 * GIB))
    assert ("memory_bytes", 2 * GIB) == (info.value.field, info.value.available)


def test_applying_the_same_share_twice_writes_nothing_the_second_time_in_any_hierarchy(fake_hybrid):
    st = fake_hybrid.subtree()
    share = CgroupShare(vcpu_milli=1500, memory_bytes=GIB, hugepages_1g=1, cpus="0-1", mems="0")
    c = st.apply("rsv-a", share)
    dirs = [c.path, *c.parts.values()]
    before = {p: p.stat().st_mtime_ns for d in dirs for p in d.iterdir()}
    st.apply("rsv-a", share)
    assert before == {p: p.stat().st_mtime_ns for d in dirs for p in d.iterdir()}


# -- processes, recovery, removal ------------------------------------------------------------------------------------


def test_move_writes_the_pid_to_every_cgroup_procs(fake_hybrid):
    st = fake_hybrid.subtree()
    c = st.apply("rsv-a", CgroupShare(vcpu_milli=1000))
    st.move("rsv-a", 4242)
    paths = st.procs_paths("rsv-a")
    assert [c.path, c.parts["cpuset"], c.parts["cpu"], c.parts["memory"]] == [p.parent for p in paths]
    assert {"4242"} == {p.read_text().strip() for p in paths}


def test_list_after_a_restart_adopts_the_v1_parts_and_drift_and_repair_cover_v1_files(fake_hybrid):
    share = CgroupShare(vcpu_milli=2000, memory_bytes=2 * GIB, cpus="0-3")
    made = fake_hybrid.subtree().apply("rsv-1", share)
    (made.parts["cpu"] / "cpu.cfs_quota_us").write_text("-1\n")
    (made.parts["memory"] / "memory.memsw.limit_in_bytes").write_text(f"{memory_v1.UNLIMITED}\n")
    (made.parts["cpuset"] / "cpuset.cpus").write_text("0-7\n")
    st = fake_hybrid.subtree()  # a restarted agent
    [found] = st.list()
    assert (share, made.parts) == (found.share, found.parts)
    expected = [Drift("cpuset.cpus", "0-3", "0-7"), Drift("cpu.cfs_quota_us", "200000", "-1"),
                Drift("memory.memsw.limit_in_bytes", str(2 * GIB), str(memory_v1.UNLIMITED))]
    assert expected == st.drift("rsv-1")
    assert expected == st.repair("rsv-1")
    assert [] == st.drift("rsv-1")


def test_a_child_left_only_in_v1_hierarchies_is_listed_for_removal_and_removed(fake_hybrid):
    st = fake_hybrid.subtree()
    c = st.apply("rsv-1", CgroupShare())
    fake_hybrid.rmdir(c.path)  # what a crash, or someone else, leaves: the cgroup2 directory and its record gone
    [found] = st.list()
    assert (None, True) == (found.share, "only in cgroup v1 hierarchies" in found.problem)
    st.remove("rsv-1")
    assert [] == st.list() and not any(d.exists() for d in c.parts.values())


def test_remove_takes_the_child_out_of_every_hierarchy(fake_hybrid):
    st = fake_hybrid.subtree()
    c = st.apply("rsv-1", CgroupShare(vcpu_milli=1000))
    st.remove("rsv-1")
    st.remove("rsv-1")
    assert [] == [d for d in [c.path, *c.parts.values()] if d.exists()]
    st.remove_roots()
    assert not any(d.exists() for d in st.v1_roots.values())


def test_stat_reads_the_v1_figures_in_the_cgroup2_shape(fake_hybrid):
    st = fake_hybrid.subtree()
    c = st.apply("rsv-1", CgroupShare(vcpu_milli=500, memory_bytes=GIB, cpus="1"))
    (c.path / "cpu.stat").write_text("usage_usec 30\nuser_usec 20\nsystem_usec 10\n")
    (c.parts["cpu"] / "cpu.stat").write_text("nr_periods 9\nnr_throttled 4\nthrottled_time 7000\n")
    mem = c.parts["memory"]
    (mem / "memory.usage_in_bytes").write_text("8192\n")
    (mem / "memory.memsw.usage_in_bytes").write_text("12288\n")
    (mem / "memory.failcnt").write_text("5\n")
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    s = st.stat("rsv-1")
    assert (50_000, 100_000, 30, 9, 4, 7) == (s.cpu.max.quota_us, s.cpu.max.period_us, s.cpu.usage_usec,
                                              s.cpu.nr_periods, s.cpu.nr_throttled, s.cpu.throttled_usec)
    assert (8192, GIB, 4096, 2, 5) == (s.memory.current, s.memory.max, s.memory.swap_current, s.memory.oom_kills,
                                       s.memory.limit_hits)
    assert (frozenset({1}), frozenset({0, 1})) == (s.cpuset.cpus, s.cpuset.mems)


def test_the_fake_tree_cannot_pretend_to_have_v1_device_lists(tmp_path):
    with pytest.raises(ValueError, match="real kernel"):
        FakeCgroupfs(tmp_path, v1=("devices",))


def test_a_new_v1_cpuset_child_starts_empty_unless_its_parent_clones(fake_hybrid):
    parent = fake_hybrid.v1["cpuset"]
    fake_hybrid.mkdir(parent / "plain")
    assert "" == read_file(parent / "plain", "cpuset.cpus")
    (parent / "plain" / "cgroup.clone_children").write_text("1\n")
    (parent / "plain" / "cpuset.cpus").write_text("2-3\n")
    fake_hybrid.mkdir(parent / "plain" / "kid")
    assert "2-3" == read_file(parent / "plain" / "kid", "cpuset.cpus")
    for d in (parent / "plain" / "kid", parent / "plain"):
        fake_hybrid.rmdir(d)
    assert not Path(parent / "plain").exists() and os.path.isdir(parent)
