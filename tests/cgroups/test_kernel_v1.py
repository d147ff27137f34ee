"""The cgroup v1 backend on the real kernel of a hybrid host: cpu, cpuset, memory and devices on v1 hierarchies,
cgroup2 beside them. Skipped with the reason on a host without that layout.

Every cgroup lives below a fresh directory under the test's own cgroup in each
hierarchy (own_cgroup2 and its v1 mirrors, removed after, also on failure);
every process is started here and ended by pid in the test's finally.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import stat
from pathlib import Path

import pytest

from cgroups import bpf, host
from cgroups.bpf_program import build
from cgroups.devices import harmless_rules, normalise, rule
from cgroups.errors import NotEnforceable
from cgroups.files import Drift, read_file, write_file
from cgroups.share import CgroupShare
from cgroups.tree import Subtree
from cgroups.v1 import devices as devices_v1
from cgroups.v1.memory import UNLIMITED
from common import hostfacts
from tests.cgroups.children import OPENER, ask, end, outgrow_memory, spawn
from tests.cgroups.fakefs import FakeCgroupfs

pytestmark = pytest.mark.kernel
MIB, GIB = 1 << 20, 1 << 30
V1_CONTROLLERS = ("cpuset", "cpu", "memory")


@pytest.fixture
def st(own_cgroup2, hybrid) -> Subtree:
    return Subtree(own_cgroup2, controllers=V1_CONTROLLERS)


@pytest.fixture
def v1_devices(host_layout) -> None:
    if host_layout.place("devices") != "v1":
        pytest.skip(f"devices is not a cgroup v1 controller on this host ({host_layout.summary()})")


@pytest.fixture
def nodes(tmp_path) -> dict[int, Path]:
    """Device nodes with the NVIDIA major and no driver behind them: an open the filters let through is ENXIO."""
    out = {}
    for minor in (0, 1, 2):
        out[minor] = tmp_path / f"nvidia{minor}"
        os.mknod(out[minor], stat.S_IFCHR | 0o600, os.makedev(195, minor))
    return out


def last_cpu() -> str:
    return str(max(hostfacts.online_cpus()))


def cgroups_of(pid: int) -> dict[str, str]:
    """/proc/<pid>/cgroup by controller ('' for cgroup2)."""
    out = {}
    for m in host.read_memberships(pid=str(pid)):
        for c in m.controllers or ("",):
            out[c] = m.path
    return out


def test_each_v1_root_lies_below_this_process_own_cgroup_in_that_hierarchy(st, own_cgroup2):
    st.prepare()
    mine = cgroups_of(os.getpid())
    for c, root in st.v1_roots.items():
        h = st.layout.hierarchy(c)
        assert h.dir_of(mine[c]) / own_cgroup2.name == root, c
        assert root.is_dir()
    cpuset_root, parent = st.v1_roots["cpuset"], st.v1_roots["cpuset"].parent
    # a new v1 cpuset starts empty: the one made here got its parent's lists, and passes them on at mkdir
    assert (read_file(parent, "cpuset.cpus"), read_file(parent, "cpuset.mems"), "1") == (
        read_file(cpuset_root, "cpuset.cpus"), read_file(cpuset_root, "cpuset.mems"),
        read_file(cpuset_root, "cgroup.clone_children"))
    assert {"cpuset": "v1", "cpu": "v1", "memory": "v1"}.items() <= st.places.items()


def test_a_process_above_its_memory_limit_is_oom_killed_inside_its_v1_cgroup(st):
    c = st.apply("rsv-oom", CgroupShare(memory_bytes=64 * MIB))
    part = c.parts["memory"]
    assert (str(64 * MIB), str(64 * MIB)) == (read_file(part, "memory.limit_in_bytes"),
                                             read_file(part, "memory.memsw.limit_in_bytes"))
    before = st.stat(c.name).memory.oom_kills
    assert -signal.SIGKILL == outgrow_memory(st, c.name)
    assert (0, 1) == (before, st.stat(c.name).memory.oom_kills)
    assert "oom_kill 1" in read_file(part, "memory.oom_control")
    os.kill(os.getpid(), 0)  # and this process is still here, in its own memory cgroup
    assert cgroups_of(os.getpid())["memory"] != st.layout.hierarchy("memory").path_of(part)


BUSY = """
import time
t0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < 1.5:
    pass
print((time.process_time() - c0) / (time.monotonic() - t0), flush=True)
"""


@pytest.mark.slow
def test_a_busy_loop_under_half_a_vcpu_is_throttled_to_half_the_wall_time(st):
    c = st.apply("rsv-cpu", CgroupShare(vcpu_milli=500))
    assert ("50000", "100000", "512") == tuple(read_file(c.parts["cpu"], f) for f in (
        "cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares"))
    child = spawn(BUSY)
    try:
        st.move(c.name, child.pid)
        ratio = float(ask(child, "go"))
    finally:
        end(child)
    cpu = st.stat(c.name).cpu
    assert 0.35 <= ratio <= 0.65, f"CPU time / wall time {ratio:.2f} under a 0.5 vcpu quota"
    assert cpu.nr_throttled > 0 and cpu.throttled_usec > 0 and cpu.max.quota_us == 50_000
    assert cpu.usage_usec > 0  # from the cgroup2 cgroup's cpu.stat


def test_cpuset_cpus_confine_a_process_moved_in(st):
    cpu, mine = last_cpu(), os.sched_getaffinity(0)
    c = st.apply("rsv-pin", CgroupShare(cpus=cpu, mems="0"))
    child = spawn("import os; print(sorted(os.sched_getaffinity(0)), flush=True)")
    try:
        st.move(c.name, child.pid)
        assert [int(cpu)] == json.loads(ask(child, "go"))
    finally:
        end(child)
    assert (frozenset({int(cpu)}), frozenset({0})) == (st.stat(c.name).cpuset.cpus, st.stat(c.name).cpuset.mems)
    assert mine == os.sched_getaffinity(0)  # this process is not confined


def test_move_joins_every_hierarchy_and_procs_paths_names_them(st):
    c = st.apply("rsv-join", CgroupShare(vcpu_milli=1000, memory_bytes=GIB), harmless_rules())
    paths = st.procs_paths(c.name)
    assert [c.path / "cgroup.procs"] + [d / "cgroup.procs" for d in c.parts.values()] == paths
    child = spawn("import time; time.sleep(30)")
    try:
        st.move(c.name, child.pid)
        where = cgroups_of(child.pid)
        assert st.layout.v2.path_of(c.path) == where[""]
        for controller, d in c.parts.items():
            assert st.layout.hierarchy(controller).path_of(d) == where[controller], controller
    finally:
        end(child)


def probe(child, nodes) -> dict[int, int]:
    got = json.loads(ask(child, " ".join(str(nodes[m]) for m in sorted(nodes)) + " /dev/null"))
    assert 0 == got.pop("/dev/null")
    return {m: got[str(nodes[m])] for m in sorted(nodes)}


def test_a_v1_device_list_refuses_another_gpu_with_eperm_and_lets_its_own_through(own_cgroup2, v1_devices, nodes,
                                                                                   bpf_works):
    st = Subtree(own_cgroup2, controllers=())
    c = st.apply("rsv-dev", CgroupShare(), list(harmless_rules()) + [rule("c", 195, 0, "rw")])
    part = c.parts["devices"]
    assert set(devices_v1.read_list(part)) == set(c.rules)
    bpf.detach_ids(c.path, list(c.program_ids))  # from here on only the v1 list filters
    child = spawn(OPENER)
    try:
        st.move(c.name, child.pid)
        child.stdin.write("go\n")
        assert {0: errno.ENXIO, 1: errno.EPERM, 2: errno.EPERM} == probe(child, nodes)
        c = st.apply(c.name, CgroupShare(), list(harmless_rules()) + [rule("c", 195, 1, "rw")])
        bpf.detach_ids(c.path, list(c.program_ids))
        assert {0: errno.EPERM, 1: errno.ENXIO, 2: errno.EPERM} == probe(child, nodes)
    finally:
        end(child)
    assert "c 195:1 rw" in read_file(part, "devices.list") and "195:0" not in read_file(part, "devices.list")


def test_with_a_v1_list_and_a_device_program_both_must_allow(own_cgroup2, v1_devices, nodes, bpf_works):
    """The finding written down in docs/cgroups.md: the kernel runs the cgroup2 program, then the v1 list."""
    st = Subtree(own_cgroup2, controllers=())
    c = st.apply("rsv-both", CgroupShare(), list(harmless_rules()) + [rule("c", 195, 0, "rw"), rule("c", 195, 1, "rw")])
    bpf.install(c.path, build(normalise(list(harmless_rules()) + [rule("c", 195, 1, "rw"), rule("c", 195, 2, "rw")])))
    child = spawn(OPENER)
    try:
        st.move(c.name, child.pid)
        child.stdin.write("go\n")
        assert {0: errno.EPERM, 1: errno.ENXIO, 2: errno.EPERM} == probe(child, nodes)
    finally:
        end(child)


def test_an_a_rule_with_a_number_is_written_as_its_c_and_b_halves(own_cgroup2, v1_devices):
    st = Subtree(own_cgroup2, controllers=())
    c = st.apply("rsv-a", CgroupShare(), [rule("a", 7, None, "rw")])
    assert {"c 7:* rw", "b 7:* rw"} == set(read_file(c.parts["devices"], "devices.list").splitlines())


def test_a_restarted_subtree_adopts_the_v1_parts_and_repairs_a_v1_file_changed_behind_its_back(
        st, own_cgroup2, v1_devices, bpf_works):
    share = CgroupShare(vcpu_milli=500, memory_bytes=128 * MIB, cpus=last_cpu(), mems="0")
    rules = list(harmless_rules()) + [rule("c", 195, 0, "rw")]
    made = st.apply("rsv-r1", share, rules)
    child = spawn("import time; time.sleep(30)")
    try:
        st.move(made.name, child.pid)
        again = Subtree(own_cgroup2, controllers=V1_CONTROLLERS)  # a restarted agent: cgroupfs only
        [found] = again.list()
        assert (made.name, share, made.rules, made.program_ids) == (found.name, found.share, found.rules,
                                                                    found.program_ids)
        assert {"cpuset", "cpu", "memory", "devices"} == set(found.parts) and found.parts == made.parts
        assert [] == again.drift(made.name)
        # behind the subtree's back, in the v1 hierarchies
        write_file(found.parts["cpu"], "cpu.cfs_quota_us", "-1")
        write_file(found.parts["memory"], "memory.limit_in_bytes", str(64 * MIB))
        write_file(found.parts["devices"], "devices.allow", "c 195:5 rw")
        drift = again.drift(made.name)
        assert [Drift("cpu.cfs_quota_us", "50000", "-1"), Drift("memory.limit_in_bytes", str(128 * MIB), str(64 * MIB))
                ] == drift[:2]
        assert ["devices.list"] == [d.what for d in drift[2:]]
        assert drift == again.repair(made.name)
        assert [] == again.drift(made.name)
        assert [child.pid] == again.procs(made.name)
        again.remove(made.name)
        assert -signal.SIGKILL == child.wait(timeout=5)
    finally:
        end(child)
    assert not made.path.exists() and not any(d.exists() for d in made.parts.values())
    assert [] == again.list()


def test_a_v1_part_missing_is_drift_and_repair_makes_it(st):
    c = st.apply("rsv-gone", CgroupShare(vcpu_milli=1000))
    os.rmdir(c.parts["cpu"])
    assert [Drift("cpu cgroup", str(c.parts["cpu"]), "missing")] == st.drift(c.name)
    st.repair(c.name)
    assert [] == st.drift(c.name) and c.parts["cpu"].is_dir()


def test_memory_limits_go_up_and_down_in_an_order_the_kernel_accepts(st):
    for limit in (128 * MIB, 512 * MIB, 64 * MIB, None, 32 * MIB):
        c = st.apply("rsv-mem", CgroupShare(memory_bytes=limit))
        want = str(limit or UNLIMITED)
        assert (want, want) == (read_file(c.parts["memory"], "memory.limit_in_bytes"),
                                read_file(c.parts["memory"], "memory.memsw.limit_in_bytes"))
        assert (limit if limit else None) == st.stat(c.name).memory.max


def test_memory_high_is_refused_where_memory_is_v1_and_nothing_is_written(st):
    with pytest.raises(NotEnforceable, match="memory.high has no cgroup v1 counterpart"):
        st.apply("rsv-high", CgroupShare(memory_bytes=GIB, memory_high_bytes=GIB // 2))
    assert not st.path("rsv-high").exists()


def test_remove_kills_and_leaves_nothing_in_any_hierarchy(st, v1_devices):
    c = st.apply("rsv-rm", CgroupShare(vcpu_milli=1000, memory_bytes=GIB), harmless_rules())
    child = spawn("import os, time; os.fork(); time.sleep(30)")
    try:
        st.move(c.name, child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        st.remove(c.name, timeout=5.0)
        assert -signal.SIGKILL == child.wait(timeout=5)
    finally:
        end(child)
    assert [] == [p for p in [c.path, *c.parts.values()] if p.exists()]
    st.remove(c.name)  # idempotent


# -- the same share, the same limits: pure cgroup2 (fake tree) and the v1 hierarchies (this kernel) ---------------


def limits_v2(d: Path, root_cpus: str, root_mems: str) -> dict:
    quota, period = read_file(d, "cpu.max").split()
    memory = read_file(d, "memory.max")
    return {"quota_us": None if quota == "max" else int(quota), "period_us": int(period),
            "memory": None if memory == "max" else int(memory), "swap": int(read_file(d, "memory.swap.max")),
            "cpus": read_file(d, "cpuset.cpus") or root_cpus, "mems": read_file(d, "cpuset.mems") or root_mems}


def limits_v1(parts: dict[str, Path]) -> dict:
    quota = int(read_file(parts["cpu"], "cpu.cfs_quota_us"))
    memory = int(read_file(parts["memory"], "memory.limit_in_bytes"))
    memsw = int(read_file(parts["memory"], "memory.memsw.limit_in_bytes"))
    return {"quota_us": None if quota == -1 else quota, "period_us": int(read_file(parts["cpu"], "cpu.cfs_period_us")),
            "memory": None if memory == UNLIMITED else memory, "swap": memsw - memory,
            "cpus": read_file(parts["cpuset"], "cpuset.cpus"), "mems": read_file(parts["cpuset"], "cpuset.mems")}


SHARES = [
    CgroupShare(),
    CgroupShare(vcpu_milli=500),
    CgroupShare(vcpu_milli=1000, cpu_period_us=50_000),
    CgroupShare(vcpu_milli=1250, memory_bytes=GIB + 100),
    CgroupShare(memory_bytes=256 * MIB, cpus="0", mems="0"),
    CgroupShare(vcpu_milli=2000, memory_bytes=64 * MIB, cpus="0-1"),
]


@pytest.mark.parametrize("share", SHARES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.to_dict().items()
                                                                  if v not in (None, 0, 100_000)) or "none")
def test_the_same_share_gives_the_same_limits_on_pure_cgroup2_and_on_v1(st, tmp_path, share):
    online = hostfacts.format_cpulist(hostfacts.online_cpus())
    if share.cpus is not None and not set(hostfacts.parse_cpulist(share.cpus)) <= set(hostfacts.online_cpus()):
        pytest.skip(f"this host has CPUs {online} only")
    cpus_root = read_file(st.v1_roots["cpuset"].parent, "cpuset.cpus")
    mems_root = read_file(st.v1_roots["cpuset"].parent, "cpuset.mems")
    fake = FakeCgroupfs(tmp_path / "fake", cpus=cpus_root, mems=mems_root)
    on_v2 = fake.subtree(controllers=V1_CONTROLLERS).apply("rsv-t", share)
    on_v1 = st.apply("rsv-t", share)
    assert limits_v2(on_v2.path, cpus_root, mems_root) == limits_v1(on_v1.parts)
