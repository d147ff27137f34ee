"""The binder on the real kernel: bind, keep unchanged, repair drift, finish a crashed bind, refuse a share the host
cannot give, unbind; every step written through to the checkpoint. Cgroups only below the test's own."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.binder import Binder, plan
from agent.bindspec import HostView, want_of
from agent.checkpoint import Checkpoint
from common.nodewire import Binding, BindingShare, BindingUnit
from cgroups import Subtree, bpf
from cgroups.files import parse_list
from tests.cgroups.conftest import bpf_works, hugetlb_for_own_cgroup, own_cgroup2  # noqa: F401 (fixtures)

pytestmark = pytest.mark.kernel
BOOT = "boot-for-binder-tests"




def binding(host: HostView, rid: str, gpu: int = 0, huge: int = 0) -> Binding:
    g = host.inventory.gpus[gpu]
    return Binding(reservationId=rid, kind="hold", tenantId="acme", principalId="alice", start=0, end=1,
                   units=[BindingUnit(unit=f"gpu{gpu}", gpuIndex=gpu, uuid=g.uuid)],
                   share=BindingShare(vcpuMilli=2000, memoryMiB=1024, hugepages1Gi=huge))


def make_binder(root: Path, tmp_path: Path, controllers=()) -> Binder:
    tree = Subtree(root, controllers=controllers, enable_from=root.parent)
    return Binder(tree, Checkpoint.load(tmp_path / "checkpoint.json", boot_id=BOOT, cgroup_root=str(root)))


def on_disk(tmp_path: Path):
    return Checkpoint.read(tmp_path / "checkpoint.json")


def test_bind_keep_repair_and_unbind_on_the_kernel(own_cgroup2, bpf_works, tmp_path, host):
    binder = make_binder(own_cgroup2 / "w", tmp_path)
    want = want_of(binding(host, "r1"), host)
    [o] = binder.run(plan({"r1": want}, binder.actual()))
    cg = own_cgroup2 / "w" / "rsv-r1"
    assert ("create", "bound", str(cg)) == (o.action.kind, o.report.status, o.report.cgroup)
    assert "completed" == on_disk(tmp_path).bindings["r1"].state
    assert [o.report] == on_disk(tmp_path).pendingReports
    ino, progs = cg.stat().st_ino, bpf.query_ids(cg)

    [o] = binder.run(plan({"r1": want}, binder.actual()))
    assert ("keep", None, ()) == (o.action.kind, o.report, o.repaired), "an unchanged binding is left alone"
    assert (ino, progs) == (cg.stat().st_ino, bpf.query_ids(cg))

    bpf.detach_ids(cg, progs)  # behind the agent's back, as a stale re-apply would
    [o] = binder.run(plan({"r1": want}, binder.actual()))
    assert "keep" == o.action.kind and any("devices" in r for r in o.repaired)
    assert 1 == len(bpf.query_ids(cg)) and cg.stat().st_ino == ino

    [o] = binder.run(plan({}, binder.actual()))
    assert ("remove", "unbound") == (o.action.kind, o.report.status)
    assert not cg.exists() and "r1" not in on_disk(tmp_path).bindings


def test_a_crash_between_mkdir_and_record_is_finished_by_the_next_pass(own_cgroup2, bpf_works, tmp_path, host):
    binder = make_binder(own_cgroup2 / "w", tmp_path)
    binder.subtree.prepare()
    (own_cgroup2 / "w" / "rsv-r2").mkdir()  # what a crash right after mkdir leaves
    assert "no record" in binder.actual()["r2"].problem
    [o] = binder.run(plan({"r2": want_of(binding(host, "r2"), host)}, binder.actual()))
    assert ("update", "bound") == (o.action.kind, o.report.status)
    assert [] == binder.subtree.drift("rsv-r2")


def test_a_restarted_binder_adopts_what_it_finds_without_rebuilding(own_cgroup2, bpf_works, tmp_path, host):
    first = make_binder(own_cgroup2 / "w", tmp_path)
    want = want_of(binding(host, "r3", gpu=1), host)
    first.run(plan({"r3": want}, first.actual()))
    cg = own_cgroup2 / "w" / "rsv-r3"
    ino, progs = cg.stat().st_ino, bpf.query_ids(cg)
    again = make_binder(own_cgroup2 / "w", tmp_path)  # a new process: checkpoint and cgroupfs only
    [o] = again.run(plan({"r3": want_of(binding(host, "r3", gpu=1), host)}, again.actual()))
    assert ("keep", "bound") == (o.action.kind, o.report.status), "a new agent reports what it has"
    assert (ino, progs) == (cg.stat().st_ino, bpf.query_ids(cg))


def test_a_share_the_host_cannot_give_fails_and_leaves_nothing(own_cgroup2, bpf_works, hugetlb_for_own_cgroup,
                                                              tmp_path, host):
    root = own_cgroup2 / "w"
    binder = make_binder(root, tmp_path, controllers=("hugetlb",))
    hv = HostView(inventory=host.inventory, enforced=frozenset({"hugetlb"}), devices_proc=host.devices_proc)
    [o] = binder.run(plan({"r4": want_of(binding(hv, "r4", huge=100_000), hv)}, binder.actual()))
    assert ("create", False, "failed") == (o.action.kind, o.ok, o.report.status)
    assert "hugepages_1g: asked 100000" in o.report.message
    assert not (root / "rsv-r4").exists() and "r4" not in on_disk(tmp_path).bindings
    assert "hugetlb" in parse_list((root / "cgroup.subtree_control").read_text())
