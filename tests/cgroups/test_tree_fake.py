"""cgroups.tree and the cgroup2 controller modules on a plain tree laid out like a pure cgroup2 host (fakefs.py).

cpu, cpuset and memory are cgroup v1 controllers on the machines these tests
run on, so their cgroup2 files are verified here; test_kernel.py does the
rest on the real kernel, test_tree_fake_v1.py the v1 backend on a v1 tree.
"""
from __future__ import annotations

import os

import pytest

from cgroups import cpu, cpuset, hugetlb, memory
from cgroups.errors import ControllerMissing, Exists, InvalidName, NotCgroup2, NotFound, ShareTooLarge
from cgroups.files import Drift, read_file
from cgroups.record import XattrRecords
from cgroups.devices import rule
from cgroups.share import CgroupShare
from cgroups.tree import Subtree

GIB = 1 << 30


def files(path, names):
    return {n: read_file(path, n) for n in names}


@pytest.mark.parametrize("share,expected", [
    (CgroupShare(vcpu_milli=2500), {"cpu.max": "250000 100000"}),
    (CgroupShare(vcpu_milli=1000, cpu_period_us=50_000), {"cpu.max": "50000 50000"}),
    (CgroupShare(), {"cpu.max": "max 100000"}),
])
def test_cpu_max_is_vcpu_times_period(fake_cgroupfs, share, expected):
    d = fake_cgroupfs.subtree().apply("rsv-a", share).path
    assert expected == files(d, expected)


@pytest.mark.parametrize("share,expected", [
    (CgroupShare(cpus="4-7,3", mems="1"), {"cpuset.cpus": "3-7", "cpuset.mems": "1"}),
    (CgroupShare(), {"cpuset.cpus": "", "cpuset.mems": ""}),
])
def test_cpuset_files_hold_the_canonical_lists(fake_cgroupfs, share, expected):
    d = fake_cgroupfs.subtree().apply("rsv-a", share).path
    assert expected == files(d, expected)


@pytest.mark.parametrize("share,expected", [
    (CgroupShare(memory_bytes=8 * GIB), {"memory.max": str(8 * GIB), "memory.high": "max", "memory.swap.max": "0"}),
    (CgroupShare(memory_bytes=GIB + 100, memory_high_bytes=GIB // 2),
     {"memory.max": str(GIB), "memory.high": str(GIB // 2), "memory.swap.max": "0"}),
    (CgroupShare(), {"memory.max": "max", "memory.high": "max", "memory.swap.max": "0"}),
])
def test_memory_files_are_page_aligned_with_swap_off(fake_cgroupfs, share, expected):
    d = fake_cgroupfs.subtree().apply("rsv-a", share).path
    assert expected == files(d, expected)


@pytest.mark.parametrize("pages", [0, 3])
def test_hugetlb_max_and_rsvd_max_hold_the_pages_in_bytes(fake_cgroupfs, pages):
    d = fake_cgroupfs.subtree().apply("rsv-a", CgroupShare(hugepages_1g=pages)).path
    assert {"hugetlb.1GB.max": str(pages * GIB), "hugetlb.1GB.rsvd.max": str(pages * GIB)} == files(
        d, ["hugetlb.1GB.max", "hugetlb.1GB.rsvd.max"])


def test_hugetlb_without_rsvd_files_writes_only_max(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    d = st.apply("rsv-a", CgroupShare()).path
    os.unlink(d / "hugetlb.1GB.rsvd.max")
    assert ["hugetlb.1GB.max"] == hugetlb.apply_hugetlb(d, CgroupShare(hugepages_1g=1))


def test_applying_the_same_share_twice_writes_nothing_the_second_time(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    share = CgroupShare(vcpu_milli=1500, memory_bytes=GIB, hugepages_1g=1, cpus="0-1", mems="0")
    d = st.apply("rsv-a", share).path
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    for module, fn in ((cpu, cpu.apply_cpu), (cpuset, cpuset.apply_cpuset), (memory, memory.apply_memory),
                       (hugetlb, hugetlb.apply_hugetlb)):
        assert [] == fn(d, share), module.__name__
    st.apply("rsv-a", share)
    assert before == {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def test_only_the_chosen_controllers_are_written(fake_cgroupfs):
    st = fake_cgroupfs.subtree(controllers=("hugetlb",))
    d = st.apply("rsv-a", CgroupShare(vcpu_milli=1000, memory_bytes=GIB, hugepages_1g=1)).path
    assert (False, False, str(GIB)) == ((d / "cpu.max").exists(), (d / "memory.max").exists(),
                                        read_file(d, "hugetlb.1GB.max"))


def test_prepare_enables_the_controllers_in_the_roots_subtree_control(fake_cgroupfs):
    fake_cgroupfs.subtree(controllers=("cpu", "memory")).prepare()
    assert "+cpu +memory" == read_file(fake_cgroupfs.mount, "cgroup.subtree_control")


def test_prepare_enables_down_the_path_from_enable_from(fake_cgroupfs):
    root = fake_cgroupfs.mount / "agent.slice" / "workloads"
    st = fake_cgroupfs.subtree(root, controllers=("cpu", "hugetlb"), enable_from=fake_cgroupfs.mount)
    st.apply("rsv-a", CgroupShare(vcpu_milli=500, hugepages_1g=1))
    assert ("50000 100000", str(GIB)) == (read_file(root / "rsv-a", "cpu.max"),
                                          read_file(root / "rsv-a", "hugetlb.1GB.max"))


def test_a_missing_controller_is_named_with_the_setting_to_change(fake_cgroupfs):
    root = fake_cgroupfs.child("delegated")  # mount's subtree_control is empty: nothing is delegated
    with pytest.raises(ControllerMissing) as info:
        fake_cgroupfs.subtree(root, controllers=("hugetlb",)).prepare()
    assert "hugetlb" == info.value.controller
    assert "systemd does not delegate hugetlb" in info.value.hint
    with pytest.raises(ControllerMissing, match="Delegate="):
        fake_cgroupfs.subtree(root, controllers=("memory",)).prepare()


def test_a_controller_the_kernel_lacks_says_so(fake_cgroupfs):
    (fake_cgroupfs.mount / "cgroup.controllers").write_text("cpu memory\n")
    with pytest.raises(ControllerMissing, match="offers no hugetlb"):
        fake_cgroupfs.subtree(controllers=("hugetlb",)).prepare()


def test_a_plain_directory_is_refused_by_the_kernel_check(tmp_path):
    with pytest.raises(NotCgroup2, match="not on a cgroup v2 filesystem"):
        Subtree(tmp_path)


def test_a_root_outside_the_fake_mount_is_refused_by_the_fake_kernel(fake_cgroupfs, tmp_path):
    with pytest.raises(NotCgroup2):
        fake_cgroupfs.subtree(tmp_path / "elsewhere")


def test_a_share_the_host_cannot_give_writes_nothing(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    with pytest.raises(ShareTooLarge) as info:
        st.apply("rsv-a", CgroupShare(hugepages_1g=5))
    assert ("hugepages_1g", 5, 4) == (info.value.field, info.value.asked, info.value.available)
    assert not (fake_cgroupfs.mount / "rsv-a").exists()


@pytest.mark.parametrize("name", ["a", "rsv-", "rsv-a/b", "rsv-../x", "rsv-" + "x" * 200, "rsv-a b"])
def test_names_are_checked(fake_cgroupfs, name):
    with pytest.raises(InvalidName):
        fake_cgroupfs.subtree().apply(name, CgroupShare())


def test_create_refuses_an_existing_cgroup_and_apply_adopts_it(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    st.create("rsv-a", CgroupShare())
    with pytest.raises(Exists):
        st.create("rsv-a", CgroupShare())
    assert CgroupShare(vcpu_milli=100) == st.apply("rsv-a", CgroupShare(vcpu_milli=100)).share


def test_list_after_a_restart_recovers_every_share_from_the_tree(fake_cgroupfs):
    shares = {"rsv-1": CgroupShare(vcpu_milli=1000), "rsv-2": CgroupShare(memory_bytes=GIB, cpus="2-3")}
    st = fake_cgroupfs.subtree()
    for name, share in shares.items():
        st.apply(name, share)
    fake_cgroupfs.mkdir(fake_cgroupfs.mount / "rsv-stray")  # made by someone else: no record
    fake_cgroupfs.mkdir(fake_cgroupfs.mount / "other")  # not ours by name: ignored
    found = {c.name: c for c in fake_cgroupfs.subtree().list()}
    assert ["rsv-1", "rsv-2", "rsv-stray"] == sorted(found)
    assert shares == {n: found[n].share for n in shares}
    assert found["rsv-stray"].share is None and "no record" in found["rsv-stray"].problem


def test_records_can_live_in_a_state_dir(fake_cgroupfs, tmp_path):
    st = fake_cgroupfs.subtree(state_dir=tmp_path / "state")
    st.apply("rsv-1", CgroupShare(vcpu_milli=1000))
    assert (tmp_path / "state/rsv-1.json").exists()
    assert CgroupShare(vcpu_milli=1000) == fake_cgroupfs.subtree(state_dir=tmp_path / "state").get("rsv-1").share
    st.remove("rsv-1")
    assert not (tmp_path / "state/rsv-1.json").exists()


def test_a_corrupt_record_is_reported_not_trusted(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    c = st.apply("rsv-1", CgroupShare(vcpu_milli=1000))
    forged = st.records.read_raw(c.path).replace(b"1000", b"9000")
    if isinstance(st.records, XattrRecords):
        os.setxattr(c.path, st.records.attr, forged)
    else:
        st.records._path(c.path).write_bytes(forged)
    got = fake_cgroupfs.subtree().get("rsv-1")
    assert (None, True) == (got.share, "checksum" in got.problem)
    assert [Drift("record", "present", got.problem)] == fake_cgroupfs.subtree().drift("rsv-1")


def test_drift_finds_a_limit_changed_behind_our_back_and_repair_puts_it_back(fake_cgroupfs):
    share = CgroupShare(vcpu_milli=2000, memory_bytes=2 * GIB, cpus="0-3")
    fake_cgroupfs.subtree().apply("rsv-1", share)
    d = fake_cgroupfs.mount / "rsv-1"
    (d / "cpu.max").write_text("max 100000\n")
    (d / "memory.swap.max").write_text("max\n")
    (d / "cpuset.cpus").write_text("0-7\n")
    st = fake_cgroupfs.subtree()  # a restarted agent
    expected = [Drift("cpuset.cpus", "0-3", "0-7"), Drift("cpu.max", "200000 100000", "max 100000"),
                Drift("memory.swap.max", "0", "max")]
    assert expected == st.drift("rsv-1")
    assert expected == st.repair("rsv-1")
    assert [] == st.drift("rsv-1")
    assert [] == st.repair("rsv-1")


def test_remove_takes_the_cgroup_away_and_is_idempotent(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    st.apply("rsv-1", CgroupShare())
    st.remove("rsv-1")
    st.remove("rsv-1")
    assert [] == st.list()
    with pytest.raises(NotFound):
        st.get("rsv-1")


def test_stat_reads_usage_of_the_enforced_controllers(fake_cgroupfs):
    st = fake_cgroupfs.subtree(controllers=("cpu", "memory", "hugetlb"))
    d = st.apply("rsv-1", CgroupShare(vcpu_milli=1000, memory_bytes=GIB, hugepages_1g=1)).path
    (d / "memory.current").write_text("4096\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (d / "cpu.stat").write_text("usage_usec 10\nuser_usec 6\nsystem_usec 4\nnr_periods 2\nnr_throttled 1\n"
                                "throttled_usec 7\n")
    s = st.stat("rsv-1")
    assert (False, None) == (s.populated, s.cpuset)
    assert (100000, 10, 1) == (s.cpu.max.quota_us, s.cpu.usage_usec, s.cpu.nr_throttled)
    assert (4096, GIB, None, 1) == (s.memory.current, s.memory.max, s.memory.high, s.memory.events["oom_kill"])
    assert (0, GIB, GIB) == (s.hugetlb.current_bytes, s.hugetlb.max_bytes, s.hugetlb.rsvd_max_bytes)


def test_device_programs_go_through_the_kernel_object_and_drift_sees_them(fake_cgroupfs):
    st = fake_cgroupfs.subtree(controllers=())
    c = st.apply("rsv-1", CgroupShare(), [rule("c", 195, 0, "rw")])
    assert (1, []) == (len(c.program_ids), st.drift("rsv-1"))
    assert c.program_ids == st.apply("rsv-1", CgroupShare(), [rule("c", 195, 0, "rw")]).program_ids
    fake_cgroupfs.detach_programs(c.path, c.program_ids)
    assert ["devices"] == [d.what for d in st.drift("rsv-1")]
    st.repair("rsv-1")
    assert [] == st.drift("rsv-1")
    assert () == st.apply("rsv-1", CgroupShare(), None).program_ids and [] == fake_cgroupfs.program_ids(c.path)


def test_on_a_pure_cgroup2_host_everything_is_v2_and_a_child_has_no_v1_parts(fake_cgroupfs):
    st = fake_cgroupfs.subtree()
    assert ({}, {"cpuset": "v2", "cpu": "v2", "memory": "v2", "hugetlb": "v2", "devices": "v2"}) == (
        st.v1_roots, st.places)
    c = st.apply("rsv-1", CgroupShare(vcpu_milli=1000))
    assert ({}, [c.path / "cgroup.procs"]) == (c.parts, st.procs_paths("rsv-1"))
