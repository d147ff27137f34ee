"""Discovery: host policy (classes, bookable GPUs, system reserve, the per-GPU share) and re-discovery yielding diffs."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from common.device_classes import DeviceClasses
from common.share import host_share_per_gpu

from agent.discovery import Discovery, Rediscovery, Reserve
from agent.health import HealthPolicy, XidEvent
from agent.host import KernelHost
from agent.simulate import SimulatedGpus, SimulatedHost
from tests.agent.trees import two_node_host

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def _sim(path, **kw) -> Discovery:
    gpus = SimulatedGpus(path)
    return Discovery(gpus=gpus, host=SimulatedHost(gpus), **kw)


def test_the_per_gpu_share_is_the_control_planes_definition():
    inv = _sim(EXAMPLES / "h100x8.json", reserve=Reserve.of(vcpu=8, memory_gib=64)).discover()
    want = host_share_per_gpu(216_000, 2048 * 1024 - 128 * 1024 - 64 * 1024, 8)
    assert (want.vcpu_milli, want.memory_mib) == (inv.share.perGpu.vcpuMilli, inv.share.perGpu.memoryMiB)
    assert (27.0, 232.0) == (inv.share.perGpu.vcpu, inv.share.perGpu.memoryGiB)


def test_allocatable_takes_out_the_reserve_and_hugepage_pools(tree):
    two_node_host(tree)
    from agent.nvml import NvmlGpus

    inv = Discovery(gpus=NvmlGpus(library="/nonexistent/libnvidia-ml.so.1"),
                    host=KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)),
                    reserve=Reserve.of(vcpu=1.5, memory_gib=2)).discover()
    assert (13_000, 1_500, 11_500, 11.5) == (inv.cpus.onlineCount * 1000, inv.cpus.reservedVcpuMilli,
                                             inv.cpus.allocatableVcpuMilli, inv.cpus.allocatableVcpu)
    assert (65536, 5120, 2048, 58368) == (inv.memory.totalMiB, inv.memory.hugepagesMiB, inv.memory.reservedMiB,
                                          inv.memory.allocatableMiB)
    assert [(0, 32768, 1024), (1, 32768, 4096)] == [(n.node, n.totalMiB, n.hugepagesMiB) for n in inv.memory.numaNodes]
    assert ["0-3,8-11", "4-5,12-14"] == [n.cpus for n in inv.cpus.numaNodes]
    assert ("gpu-host-7", "6f1c2e0a-0000-4000-8000-000000000007") == (inv.hostname, inv.bootId)


def test_a_reserve_larger_than_the_host_leaves_nothing_allocatable(tmp_path):
    inv = _sim(EXAMPLES / "a100-mig.json", reserve=Reserve.of(vcpu=500, memory_gib=10_000)).discover()
    assert (32_000, 0) == (inv.cpus.reservedVcpuMilli, inv.cpus.allocatableVcpuMilli)
    assert 0 == inv.memory.allocatableMiB


def test_unhealthy_and_mig_gpus_are_not_bookable():
    policy = HealthPolicy()
    discovery = _sim(EXAMPLES / "mixed.json", health=policy)
    before = discovery.discover()
    policy.observe(XidEvent(gpu_uuid=before.gpus[0].uuid, kind="xid", xid=79))
    after = discovery.discover()
    assert (5, 4) == (before.share.bookableGpus, after.share.bookableGpus)
    assert (False, "XID 79: GPU has fallen off the bus") == (after.gpus[0].bookable, after.gpus[0].health.reason)


def test_operator_device_class_rules_come_first(tmp_path):
    rules = tmp_path / "classes.json"
    rules.write_text(json.dumps([{"match": "H100 80GB HBM3", "class": "H100_SXM"}]))
    inv = _sim(EXAMPLES / "h100x8.json", device_classes=DeviceClasses.from_file(rules)).discover()
    assert {"H100_SXM"} == {g.deviceClass for g in inv.gpus}


def _topology_file(tmp_path, count) -> Path:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"hostname": "r", "gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034, "count": count}]}))
    return path


def test_refresh_on_demand_returns_the_diff(tmp_path):
    path = _topology_file(tmp_path, 2)
    seen = []
    loop = Rediscovery(_sim(path).discover, on_change=lambda d, inv: seen.append(d))
    assert not loop.refresh().empty  # the first discovery
    assert loop.refresh().empty  # nothing changed: no call back
    _topology_file(tmp_path, 3)
    change = loop.refresh()
    assert 1 == sum(1 for c in change.changes if c.op == "added" and c.path.startswith("gpus["))
    assert 2 == len(seen)
    assert 3 == len(loop.current.gpus)


def test_the_timer_rediscovers_and_request_wakes_it_early(tmp_path):
    path = _topology_file(tmp_path, 1)
    changed = threading.Event()
    diffs = []

    def on_change(d, inv):
        diffs.append(d)
        if len(diffs) == 2:
            changed.set()

    loop = Rediscovery(_sim(path).discover, interval_s=3600, on_change=on_change).start()
    try:
        for _ in range(200):
            if loop.current is not None:
                break
            threading.Event().wait(0.01)
        _topology_file(tmp_path, 4)
        loop.request()  # on demand: long before the hour is up
        assert changed.wait(5)
    finally:
        loop.stop(timeout=5)
    assert 3 == sum(1 for c in diffs[1].changes if c.op == "added")
