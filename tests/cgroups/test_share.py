"""cgroups.share: a share is checked in itself when built and against the host's capacity before any write."""
from __future__ import annotations

import pytest

from cgroups.errors import InvalidShare, ShareTooLarge
from cgroups.share import Capacity, CgroupShare, read_capacity

GIB = 1 << 30
CAP = Capacity(cpus=frozenset(range(8)), mems=frozenset({0, 1}), memory_bytes=64 * GIB, hugepages_1g=4)


@pytest.mark.parametrize("kw", [
    {"vcpu_milli": 0}, {"vcpu_milli": -1}, {"vcpu_milli": 5},  # 5 milli = 500 us quota < 1000 us
    {"memory_bytes": 0}, {"memory_bytes": 100}, {"hugepages_1g": -1}, {"cpus": "x"}, {"cpus": ""},
    {"memory_bytes": GIB, "memory_high_bytes": 2 * GIB}, {"cpu_period_us": 10}, {"vcpu_milli": True},
])
def test_malformed_shares_are_refused_when_built(kw):
    with pytest.raises(InvalidShare):
        CgroupShare(**kw)


def test_cpu_lists_are_kept_in_the_kernels_canonical_form():
    assert ("0-3,8", "0") == (CgroupShare(cpus="3,2,1,0,8").cpus, CgroupShare(mems="0").mems)


def test_quota_is_vcpu_times_period():
    assert 250000 == CgroupShare(vcpu_milli=2500).quota_us


@pytest.mark.parametrize("kw,field,available", [
    ({"vcpu_milli": 8001}, "vcpu_milli", 8000),
    ({"vcpu_milli": 2500, "cpus": "0-1"}, "vcpu_milli", 2000),
    ({"cpus": "0-8"}, "cpus", "0-7"),
    ({"mems": "2"}, "mems", "0-1"),
    ({"memory_bytes": 65 * GIB}, "memory_bytes", 64 * GIB),
    ({"hugepages_1g": 5}, "hugepages_1g", 4),
])
def test_a_share_beyond_the_capacity_names_the_field_and_both_numbers(kw, field, available):
    share = CgroupShare(**kw)
    with pytest.raises(ShareTooLarge) as info:
        share.check_fits(CAP)
    assert (field, available) == (info.value.field, info.value.available)


def test_a_share_within_the_capacity_fits():
    CgroupShare(vcpu_milli=8000, memory_bytes=64 * GIB, hugepages_1g=4, cpus="0-7", mems="0-1").check_fits(CAP)


def test_share_round_trips_through_a_dict():
    share = CgroupShare(vcpu_milli=2500, memory_bytes=GIB, memory_high_bytes=GIB // 2, hugepages_1g=1, cpus="0-3")
    assert share == CgroupShare.from_dict(share.to_dict())


def test_capacity_is_the_parents_limits_bounded_by_the_host(fake_cgroupfs):
    root = fake_cgroupfs.mount
    (root / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "hugetlb.1GB.max").write_text(f"{2 * GIB}\n")
    cap = read_capacity(root, proc=fake_cgroupfs.proc, sys=fake_cgroupfs.sys)
    assert Capacity(frozenset(range(8)), frozenset({0, 1}), 8 * GIB, 2) == cap


def test_a_limit_on_a_cgroup_above_the_parent_bounds_the_capacity_too(fake_cgroupfs, tmp_path):
    """A 3 GiB limit on berth.slice, above the agent's root: a 6 GiB share was bound, and its workload OOM-killed at
    4 GiB, where ShareTooLarge was promised (the parent's own file alone was read). On v1 names as on cgroup2."""
    root = fake_cgroupfs.mount
    slice_, agent = root / "berth.slice", root / "berth.slice" / "agent"
    agent.mkdir(parents=True)
    (slice_ / "memory.max").write_text(f"{3 * GIB}\n")
    (agent / "memory.max").write_text("max\n")
    (root / "hugetlb.1GB.max").write_text(f"{1 * GIB}\n")
    (slice_ / "hugetlb.1GB.max").write_text("max\n")
    (agent / "hugetlb.1GB.max").write_text(f"{2 * GIB}\n")
    cap = read_capacity(agent, proc=fake_cgroupfs.proc, sys=fake_cgroupfs.sys)
    assert (cap.memory_bytes, cap.hugepages_1g) == (3 * GIB, 1)
    with pytest.raises(ShareTooLarge) as info:
        CgroupShare(memory_bytes=6 * GIB).check_fits(cap)
    assert (info.value.field, info.value.available) == ("memory_bytes", 3 * GIB)
    v1 = tmp_path / "v1" / "memory"
    (v1 / "berth.slice" / "agent").mkdir(parents=True)
    for d, limit in ((v1, 9223372036854771712), (v1 / "berth.slice", 3 * GIB), (v1 / "berth.slice" / "agent", 8 * GIB)):
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    cap = read_capacity(agent, proc=fake_cgroupfs.proc, sys=fake_cgroupfs.sys, fields=frozenset({"memory_bytes"}),
                        dirs={"memory": v1 / "berth.slice" / "agent"})
    assert cap.memory_bytes == 3 * GIB


def test_a_share_asks_the_capacity_only_about_what_it_limits():
    assert (frozenset(), frozenset({"cpus", "memory_bytes", "hugepages_1g"})) == (
        CgroupShare().asks(), CgroupShare(vcpu_milli=100, memory_high_bytes=GIB, hugepages_1g=1).asks())


def test_fields_the_capacity_did_not_read_are_not_checked():
    CgroupShare(vcpu_milli=100_000, memory_bytes=1 << 50).check_fits(Capacity(hugepages_1g=0))
