"""Discovery: host policy (classes, bookable GPUs, system reserve, the per-GPU share) and re-discovery yielding diffs."""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from common.device_classes import DeviceClasses
from common.inventory import Driver, Gpu, GpuInventory
from common.share import host_share_per_gpu

from agent.discovery import Discovery, InventoryInvalid, Rediscovery, Reserve, discover
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


# -- what the control plane would refuse is refused here, naming the field ------------------------------------


class _Gpus:
    """A GpuSource answering what it is given (for what neither NVML nor a topology can be made to say)."""

    name = "nvml"

    def __init__(self, *gpus: Gpu) -> None:
        self.gpus = gpus

    def discover(self) -> GpuInventory:
        return GpuInventory(source="nvml", driver=Driver(status="ok"), gpus=self.gpus)


def _gpu(index: int, uuid: str, pci: str, name: str = "NVIDIA H100 80GB HBM3") -> Gpu:
    return Gpu(index=index, uuid=uuid, name=name, deviceClass="", minor=index, pciBusId=pci, memoryMiB=81559,
               numaNode=None, migMode=None)


@pytest.mark.parametrize("gpus, message", [
    ((_gpu(0, "GPU-a", "00000000:18:00.0"), _gpu(1, "GPU-a", "00000000:28:00.0")),
     "gpus[1].uuid: GPU-a duplicates gpus[0]'s (NVML GPUs 0 and 1 report one uuid"),
    ((_gpu(0, "GPU-a", "00000000:18:00.0"), _gpu(1, "GPU-b", "00000000:28:00.0"), _gpu(2, "GPU-c", "00000000:28:00.0")),
     "gpus[2].pciBusId: 00000000:28:00.0 duplicates gpus[1]'s (NVML GPUs 1 and 2 report one pciBusId"),
])
def test_two_gpus_with_one_identity_are_a_discovery_error_naming_both(tree, gpus, message):
    two_node_host(tree)
    with pytest.raises(InventoryInvalid) as err:
        discover(_Gpus(*gpus), KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["N" * 95, "NVIDIA Ünïcødé GPU 🚀 " + "x" * 60])
def test_a_device_class_that_cannot_be_one_says_to_name_it_with_device_classes(tree, name):
    two_node_host(tree)
    host = KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc))
    with pytest.raises(InventoryInvalid, match=r"gpus\[0\].deviceClass: .* is longer than 64 characters: name its "
                                               r"class with --device-classes"):
        discover(_Gpus(_gpu(0, "GPU-a", "00000000:18:00.0", name)), host)
    rules = DeviceClasses.from_rules([{"match": "^N{95}$|xxxx", "class": "LAB_GPU_8GB"}])
    inv = discover(_Gpus(_gpu(0, "GPU-a", "00000000:18:00.0", name)), host, device_classes=rules)
    assert "LAB_GPU_8GB" == inv.gpus[0].deviceClass


def test_the_real_hosts_odd_hostname_is_a_discovery_error(tree):
    two_node_host(tree).identity(hostname="gpu_host 7")
    with pytest.raises(InventoryInvalid, match="hostname: 'gpu_host 7' is not a host name"):
        discover(_Gpus(), KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)))


def test_an_inventory_its_own_schema_refuses_is_never_emitted(tree):
    """The last net: whatever a source said, the document is checked against the Inventory type before it leaves."""
    two_node_host(tree)
    facts = KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)).read()

    class OddHost:
        def read(self):
            return dataclasses.replace(facts, boot_id="b" * 65)

    with pytest.raises(InventoryInvalid, match=r"bootId: Expected `str` of length <= 64") as err:
        discover(_Gpus(), OddHost())
    assert "\n" not in str(err.value)


def test_a_reserve_beyond_any_host_is_a_value_error_not_an_overflow():
    with pytest.raises(ValueError, match="reserve"):
        Reserve.of(vcpu=1e308, memory_gib=0)
    with pytest.raises(ValueError, match="reserve"):
        Reserve.of(vcpu=0, memory_gib=float("inf"))


def test_a_failed_rediscovery_keeps_the_last_good_inventory(tmp_path):
    """What the runtime relies on: a discovery that fails (here, a GPU name no device class can be made of) raises;
    the agent never holds, and so never registers, an inventory the control plane would refuse."""
    path = _topology_file(tmp_path, 2)
    loop = Rediscovery(_sim(path).discover)
    loop.refresh()
    good = loop.current
    path.write_text(json.dumps({"hostname": "r", "gpus": [{"name": "N" * 95, "memoryMiB": 23034}]}))
    with pytest.raises(InventoryInvalid):
        loop.refresh()
    assert good is loop.current
