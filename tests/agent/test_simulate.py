"""--simulate topologies: the shipped examples, host overrides, and validation errors that name the field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import simulate
from agent.discovery import Discovery
from agent.errors import TopologyError
from agent.host import KernelHost
from agent.simulate import SimulatedGpus, SimulatedHost

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def _discover(path, **kw):
    gpus = SimulatedGpus(path)
    return Discovery(gpus=gpus, host=SimulatedHost(gpus), **kw).discover()


def test_the_h100_example_is_eight_bookable_h100s_on_two_nodes():
    inv = _discover(EXAMPLES / "h100x8.json")
    assert ["H100_80GB"] * 8 == [g.deviceClass for g in inv.gpus]
    assert [0, 0, 0, 0, 1, 1, 1, 1] == [g.numaNode for g in inv.gpus]
    assert (8, 224, 112, 128) == (inv.share.bookableGpus, inv.cpus.onlineCount, inv.cpus.cores,
                                  inv.hugepages.pages1G.total)
    assert len({g.uuid for g in inv.gpus}) == 8


def test_the_a100_mig_example_has_seven_1g_instances_and_no_whole_gpu():
    inv = _discover(EXAMPLES / "a100-mig.json")
    (gpu,) = inv.gpus
    assert ["1g.10gb"] * 7 == [m.profile for m in gpu.migDevices]
    assert (False, 0, None) == (gpu.bookable, inv.share.bookableGpus, inv.share.perGpu)
    assert len({(m.capMinors.gi, m.capMinors.ci) for m in gpu.migDevices}) == 7


def test_the_mixed_example():
    inv = _discover(EXAMPLES / "mixed.json")
    assert ["H100_80GB", "H100_80GB", "H100_80GB", "A100_80GB", "L40S_48GB", "L40S_48GB"] == \
        [g.deviceClass for g in inv.gpus]
    assert [True, True, False, True, True, True] == [g.bookable for g in inv.gpus]
    assert ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"] == [m.profile for m in inv.gpus[2].migDevices]
    assert (False, True) == (inv.gpus[3].migMode.current, inv.gpus[3].migMode.pending)
    assert inv.gpus[4].migMode is None
    assert ("126-127", 126) == (inv.cpus.offline, inv.cpus.onlineCount)
    assert [32, 0] == [n.total for n in inv.hugepages.pages1G.numaNodes]
    assert [0, 1024] == [n.total for n in inv.hugepages.pages2M.numaNodes]


def test_without_a_host_section_the_real_host_is_used():
    top = simulate.parse(json.dumps({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034}]}))
    gpus = SimulatedGpus(top)
    facts = SimulatedHost(gpus).read()
    assert KernelHost().read().cpus == facts.cpus
    assert "simulated-host" == facts.hostname


@pytest.mark.parametrize("top, field", [
    ({"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}, r"\$.gpus\[0\]"),
    ({"gpus": [{"name": "X", "memoryMiB": "lots"}]}, r"\$.gpus\[0\].memoryMiB"),
    ({"gpus": [{"name": "X", "memoryMiB": 1, "colour": "red"}]}, "colour"),
    ({"gpus": [{"name": "NVIDIA A100", "memoryMiB": 81920, "mig": {"profile": "big"}}]}, r"gpus\[0\].mig.profile"),
    ({"gpus": [{"name": "NVIDIA H100", "memoryMiB": 1, "count": 2, "numaNodes": [0]}]}, r"gpus\[0\].numaNodes"),
    ({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 1, "mig": {"profile": "1g.10gb"}}]}, r"gpus\[0\].mig: 'NVIDIA L4'"),
    ({"gpus": [{"name": "NVIDIA A100", "memoryMiB": 9, "mig": {"profile": "4g.40gb", "count": 2}}]},
     r"gpus\[0\].mig: the profiles take 8 slices"),
    ({"gpus": [{"name": "NVIDIA A100", "memoryMiB": 81920, "mig": {"profile": "1g.10gb", "count": 2},
               "migSlots": [1, 1]}]}, r"gpus\[0\].migSlots"),
    # a 40 GB A100's smallest profile is 1g.5gb: seven of the 80 GB model's 1g.10gb do not fit its memory
    ({"gpus": [{"name": "NVIDIA A100-SXM4-40GB", "memoryMiB": 40960, "mig": {"profile": "1g.10gb", "count": 7}}]},
     r"gpus\[0\].mig: the instances take 68096 MiB; the GPU has 40960 MiB"),
    ({"gpus": [{"name": "NVIDIA A100", "memoryMiB": 40960, "mig": [{"profile": "1g.5gb", "memoryMiB": 30000},
                                                                   {"profile": "1g.5gb", "memoryMiB": 20000}]}]},
     r"gpus\[0\].mig: the instances take 50000 MiB"),
    ({"gpus": [], "lostGpus": [0]}, r"lostGpus\[0\]"),
    ({"host": {"cpus": 7, "threadsPerCore": 2}}, "host.threadsPerCore"),
    ({"host": {"numaNodes": 2, "hugepages1G": {"2": 4}}}, "host.hugepages1G.2"),
    ({"host": {"offlineCpus": "1"}}, "host.cpus"),
    ({"host": {"cpus": 4, "offlineCpus": "0-3"}}, "host.offlineCpus"),
    # the inventory holds at most 256 GPUs: more would be a document the control plane refuses
    ({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 1, "count": 64}] * 5},
     "gpus: 320 GPUs in all; an inventory holds at most 256"),
    ({"hostname": "bad host\nname"}, r"hostname: 'bad host\\nname' is not a host name"),
    ({"hostname": "h" * 64}, "hostname: 'h{64}' is not a host name"),
    ({"hostname": "-lead.example"}, "hostname"),
    # more 1 GiB pages than memory, on the host or on one node
    ({"host": {"memoryGiB": 8, "hugepages1G": {"0": 16}}},
     r"host.hugepages1G.0: 16 GiB of hugepages on node 0, which has 8 GiB \(host.memoryGiB 8 over 1 node"),
    ({"host": {"numaNodes": 2, "memoryGiB": 16, "hugepages1G": {"0": 2, "1": 8}, "hugepages2M": {"1": 1}}},
     r"host.hugepages1G.1: 8.002 GiB of hugepages on node 1, which has 8 GiB"),
])
def test_a_bad_topology_names_the_field(top, field):
    with pytest.raises(TopologyError, match=field):
        simulate.parse(json.dumps(top), "top.json")


def test_a_missing_or_broken_file_says_so(tmp_path):
    with pytest.raises(TopologyError, match="nope.json"):
        simulate.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TopologyError, match="not JSON"):
        simulate.load(tmp_path / "bad.json")


def test_the_file_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034, "count": 2}]}))
    gpus = SimulatedGpus(path)
    assert 2 == len(gpus.discover().gpus)
    path.write_text(json.dumps({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034, "count": 3}]}))
    assert 3 == len(gpus.discover().gpus)


def test_256_gpus_are_allowed_and_every_pci_bus_id_is_distinct():
    top = simulate.parse(json.dumps({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034, "count": 64}] * 4}))
    gpus = simulate.expand(top)
    assert 256 == len({g.pci_bus_id for g in gpus}) == len({g.uuid for g in gpus})
    # the first sixteen keep the ids they always had (one bus each, device 0); then the device number counts up
    assert ["00000000:18:00.0", "00000000:08:00.0", "00000000:18:01.0", "00000000:08:0F.0"] == \
        [gpus[i].pci_bus_id for i in (0, 15, 16, 255)]


def test_two_gpus_with_one_identity_are_a_topology_error_naming_both(monkeypatch):
    """A guard, should the expansion ever give two GPUs one PCI bus id (it did past 16 GPUs)."""
    monkeypatch.setattr(simulate, "pci_bus_id", lambda index: "00000000:18:00.0")
    with pytest.raises(TopologyError, match=r"top.json: gpus: GPU 1 would have GPU 0's pciBusId 00000000:18:00.0"):
        simulate.parse(json.dumps({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 1, "count": 2}]}), "top.json")


def test_an_empty_mig_list_is_mig_mode_with_no_instances():
    top = {"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "mig": []}], "host": {"cpus": 8, "memoryGiB": 64}}
    inv = _discover(simulate.parse(json.dumps(top)))
    (gpu,) = inv.gpus
    assert (True, True, (), False) == (gpu.migMode.current, gpu.migMode.pending, gpu.migDevices, gpu.bookable)


def test_an_empty_mig_list_on_a_gpu_without_mig_is_refused():
    with pytest.raises(TopologyError, match=r"gpus\[0\].mig: 'NVIDIA L4' does not support MIG"):
        simulate.parse(json.dumps({"gpus": [{"name": "NVIDIA L4", "memoryMiB": 1, "mig": []}]}))


@pytest.mark.parametrize("host", [{"cpus": 16, "numaNodes": 2}, {"numaNodes": 2}, {"numaNodes": 2, "memoryGiB": 64},
                                  {"numaNodes": 2, "hugepages1G": {"1": 2}}])
def test_every_section_lists_every_numa_node(host):
    inv = _discover(simulate.parse(json.dumps({"gpus": [], "host": host})))
    nodes = {"cpus": [n.node for n in inv.cpus.numaNodes], "memory": [n.node for n in inv.memory.numaNodes],
             "1G": [n.node for n in inv.hugepages.pages1G.numaNodes],
             "2M": [n.node for n in inv.hugepages.pages2M.numaNodes]}
    assert {key: [0, 1] for key in nodes} == {key: value[:2] for key, value in nodes.items()}
    assert len({len(v) for v in nodes.values()}) == 1, nodes


def test_memory_not_simulated_is_0_on_the_nodes_this_machine_does_not_have():
    inv = _discover(simulate.parse(json.dumps({"gpus": [], "host": {"cpus": 128, "numaNodes": 64}})))
    real = {n.node: n for n in KernelHost().read().node_memory}
    assert 64 == len(inv.memory.numaNodes)
    assert all(n.totalMiB == (real[n.node].total_kib // 1024 if n.node in real else 0) for n in inv.memory.numaNodes)

