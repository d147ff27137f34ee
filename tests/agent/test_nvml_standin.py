"""NVML through the real nvidia-ml-py ctypes binding, answered by the stand-in libnvidia-ml.so.1 built with gcc."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pynvml
import pytest

from agent import nvml, simulate
from agent.discovery import Discovery, Reserve
from agent.errors import DriverNotLoaded, NotSupported, NvmlError
from agent.health import HealthPolicy, XidWatcher
from agent.host import KernelHost
from common.inventory import CapMinors, MigMode
from agent import mig_minors
from tests.agent import fake_nvml
from tests.agent.trees import two_node_host

A100 = {"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920}
L4 = {"name": "NVIDIA L4", "memoryMiB": 23034}
H100 = {"name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}
HOST = {"hostname": "standin", "driver": {"version": "550.54.15", "cuda": 12040},
        "gpus": [dict(A100, mig={"profile": "1g.10gb", "count": 3}, migSlots=[0, 3, 6]), L4, H100]}


def _expanded(top: dict):
    return simulate.expand(simulate.parse(json.dumps(top)))


@pytest.fixture
def gpus(standin_library):
    return nvml.NvmlGpus(library=str(standin_library))


def test_counts_handles_and_fields_come_through_pynvml(standin, gpus):
    standin(HOST)
    inv = gpus.discover()
    want = _expanded(HOST)
    assert ("ok", "550.54.15", "12.4") == (inv.driver.status, inv.driver.version, inv.driver.cudaVersion)
    assert [(g.index, g.uuid, g.name, g.minor, g.pci_bus_id, g.memory_mib) for g in want] == \
        [(g.index, g.uuid, g.name, g.minor, g.pciBusId, g.memoryMiB) for g in inv.gpus]
    assert () == inv.lostGpus


def test_mig_device_slots_are_sparse_and_every_slot_is_walked(standin, gpus):
    standin(HOST)
    a100 = gpus.discover().gpus[0]
    assert MigMode(current=True, pending=True) == a100.migMode
    assert [0, 3, 6] == [m.index for m in a100.migDevices]
    assert [(1, 0), (2, 0), (3, 0)] == [(m.gpuInstanceId, m.computeInstanceId) for m in a100.migDevices]
    assert {"1g.10gb"} == {m.profile for m in a100.migDevices}
    assert {9728} == {m.memoryMiB for m in a100.migDevices}
    assert [m.uuid for m in _expanded(HOST)[0].mig] == [m.uuid for m in a100.migDevices]
    assert all(m.uuid.startswith("MIG-") for m in a100.migDevices)


def test_a_gpu_without_mig_support_answers_not_supported(standin, gpus):
    standin(HOST)
    inv = gpus.discover()
    assert (None, ()) == (inv.gpus[1].migMode, inv.gpus[1].migDevices)  # the L4
    assert (MigMode(current=False, pending=False), ()) == (inv.gpus[2].migMode, inv.gpus[2].migDevices)  # the H100
    with nvml.session(gpus.library):
        handle = nvml._nvml(pynvml.nvmlDeviceGetHandleByIndex, 1)
        with pytest.raises(NotSupported) as err:
            nvml._nvml(pynvml.nvmlDeviceGetMigMode, handle)
    assert (3, "nvmlDeviceGetMigMode") == (err.value.code, err.value.call)


def test_driver_not_loaded_is_reported_plainly(standin, gpus):
    standin(HOST, mode="driver-not-loaded")
    inv = gpus.discover()
    assert ("not-loaded", ()) == (inv.driver.status, inv.gpus)
    assert "no GPU driver found" in inv.driver.message
    with pytest.raises(DriverNotLoaded) as err:
        with nvml.session(gpus.library):
            pass
    assert 9 == err.value.code


def test_a_call_before_init_is_an_nvml_error_with_its_code(standin, gpus):
    standin(HOST)
    gpus.discover()  # the library is loaded, NVML shut down again
    with pytest.raises(NvmlError) as err:
        nvml._nvml(pynvml.nvmlDeviceGetCount)
    assert 1 == err.value.code


def test_sessions_nest_like_nvml_reference_counts(standin, gpus):
    standin(HOST)
    with nvml.session(gpus.library):
        assert 3 == len(gpus.discover().gpus)  # an inner init/shutdown pair
        assert 3 == nvml._nvml(pynvml.nvmlDeviceGetCount)


def test_numa_nodes_and_cap_minors_come_from_the_host_tree(standin, standin_library, tree):
    standin(HOST)
    two_node_host(tree).pci_numa("0000:18:00.0", 1).pci_numa("0000:28:00.0", 0)
    tree.mig_minors(mig_minors.render([0]))
    inv = nvml.NvmlGpus(library=str(standin_library), sys_root=str(tree.sys), proc_root=str(tree.proc)).discover()
    assert [1, 0, None] == [g.numaNode for g in inv.gpus]
    assert [CapMinors(gi=12, ci=13), CapMinors(gi=21, ci=22), CapMinors(gi=30, ci=31)] == \
        [m.capMinors for m in inv.gpus[0].migDevices]


def _discovery(standin_library, tree) -> Discovery:
    two_node_host(tree)
    tree.mig_minors(mig_minors.render([0]))
    return Discovery(gpus=nvml.NvmlGpus(library=str(standin_library), sys_root=str(tree.sys),
                                        proc_root=str(tree.proc)),
                     host=KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)), reserve=Reserve(1000, 4096))


def test_a_gpu_lost_between_two_discoveries_is_a_diff(standin, standin_library, tree):
    from common.inventory import diff

    discovery = _discovery(standin_library, tree)
    standin(HOST)
    before = discovery.discover()
    standin(dict(HOST, lostGpus=[1]))  # the L4 falls off the bus
    after = discovery.discover()
    lost_uuid = before.gpus[1].uuid
    assert [(1, 15)] == [(g.index, g.code) for g in after.lostGpus]
    assert "GPU is lost" in after.lostGpus[0].error
    change = diff(before, after)
    ops = {(c.op, c.path) for c in change.changes}
    assert {("removed", f"gpus[{lost_uuid}]"), ("added", "lostGpus[1]"), ("changed", "share.bookableGpus")} <= ops
    assert (2, 1) == (before.share.bookableGpus, after.share.bookableGpus)


def test_mig_repartitioned_is_a_diff_with_fresh_cap_minors(standin, standin_library, tree):
    from common.inventory import diff

    discovery = _discovery(standin_library, tree)
    standin(HOST)
    before = discovery.discover()
    standin(dict(HOST, gpus=[dict(A100, mig={"profile": "3g.40gb", "count": 2})] + HOST["gpus"][1:]))
    after = discovery.discover()
    a100 = after.gpus[0]
    assert [("3g.40gb", 1, CapMinors(gi=12, ci=13)), ("3g.40gb", 2, CapMinors(gi=21, ci=22))] == \
        [(m.profile, m.gpuInstanceId, m.capMinors) for m in a100.migDevices]
    paths = [(c.op, c.path) for c in diff(before, after).changes]
    assert 3 == sum(1 for op, p in paths if op == "removed" and ".migDevices[" in p)
    assert 2 == sum(1 for op, p in paths if op == "added" and ".migDevices[" in p)


def test_xid_events_reach_the_policy_through_the_nvml_event_set(standin, standin_library, tree):
    E = fake_nvml.Event
    standin(HOST, events=[
        E(gpu=1, data=13),  # an application fault: ignored
        E(gpu=0, data=94, gi=2, ci=0),  # one MIG device
        E(gpu=2, data=79),  # the H100 fell off the bus
        E(gpu=2, type=fake_nvml.EVENT_DBE),
    ])
    policy = HealthPolicy()
    changes = []
    with nvml.NvmlEvents(library=str(standin_library)) as events:
        watcher = XidWatcher(events, policy, on_change=lambda: changes.append(1), timeout_ms=10)
        results = [watcher.poll() for _ in range(5)]
    assert [False, True, True, True, False] == results
    discovery = _discovery(standin_library, tree)
    inv = Discovery(gpus=discovery.gpus, host=discovery.host, health=policy).discover()
    a100, l4, h100 = inv.gpus
    assert (True, True) == (a100.health.healthy, l4.health.healthy)
    assert [True, False, True] == [m.health.healthy for m in a100.migDevices]
    assert 94 == a100.migDevices[1].health.xid
    assert (False, False) == (h100.health.healthy, h100.bookable)
    assert (None, "double-bit ECC error") == (h100.health.xid, h100.health.reason)  # the latest event


def _run_cli(args, env):
    return subprocess.run([sys.executable, "-m", "berth", "agent", "discover", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", nvml.LIBRARY_ENV)}
    env.update(extra)
    return env


def test_pynvml_finds_the_standin_by_name_through_ld_library_path(standin, standin_library):
    path = standin(HOST)
    out = _run_cli(["--json"], _env(LD_LIBRARY_PATH=str(standin_library.parent),
                                    **{fake_nvml.TOPOLOGY_ENV: str(path)}))
    assert 0 == out.returncode, out.stderr
    doc = json.loads(out.stdout)
    assert ["A100_80GB", "L4_24GB", "H100_80GB"] == [g["deviceClass"] for g in doc["gpus"]]


def test_an_explicit_library_path_and_a_missing_one(standin, standin_library):
    path = standin(HOST)
    out = _run_cli(["--json", "--nvml-library", str(standin_library)], _env(**{fake_nvml.TOPOLOGY_ENV: str(path)}))
    assert (0, 3) == (out.returncode, len(json.loads(out.stdout)["gpus"]))
    # a path given that is not there is a mistake to mend, not a host without a driver (that one is found by name)
    out = _run_cli(["--json"], _env(**{nvml.LIBRARY_ENV: "/nonexistent/libnvidia-ml.so.1"}))
    assert (2, True) == (out.returncode, "/nonexistent/libnvidia-ml.so.1: No such file or directory" in out.stderr)


def test_clean_gpus_puts_clocks_and_the_power_limit_back_and_names_what_it_could_not(standin, standin_library,
                                                                                         tmp_path, monkeypatch):
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv(fake_nvml.CALLS_ENV, str(calls))
    host = {**HOST, "gpus": [L4, H100, H100], "lostGpus": [2]}
    standin(host, power={0: (72000, 72000), 1: (700000, 450000)})  # the tenant lowered GPU 1's limit
    problems = nvml.clean_gpus(str(standin_library))
    done = calls.read_text().splitlines()
    for gpu in (0, 1):
        for what in ("reset-applications-clocks", "reset-gpu-locked-clocks", "reset-memory-locked-clocks"):
            assert f"{what} {gpu}" in done
    assert ["power-limit 1 700000"] == [c for c in done if c.startswith("power-limit")]  # only the changed one
    assert 1 == len(problems) and problems[0].startswith("GPU 2: not reachable") and "GPU is lost" in problems[0]


@pytest.mark.parametrize("field", ["uuid", "pciBusId"])
def test_two_gpus_reporting_one_identity_are_a_discovery_error_naming_both(standin, standin_library, tree, field):
    """Before: accepted, and the unit lookup (by uuid first) gave a booking of gpu1 the device of gpu0."""
    from agent.discovery import InventoryInvalid

    path = standin({"hostname": "dup", "gpus": [dict(H100, count=2)]})
    first, second = _expanded({"hostname": "dup", "gpus": [dict(H100, count=2)]})
    same = (second.uuid, first.uuid) if field == "uuid" else (second.pci_bus_id, first.pci_bus_id)
    path.write_text(path.read_text().replace(*same))
    with pytest.raises(InventoryInvalid) as err:
        _discovery(standin_library, tree).discover()
    assert f"gpus[1].{field}: " in str(err.value) and "duplicates gpus[0]'s (NVML GPUs 0 and 1" in str(err.value)
    out = _run_cli(["--json", "--nvml-library", str(standin_library)], _env(**{fake_nvml.TOPOLOGY_ENV: str(path)}))
    assert (1, "") == (out.returncode, out.stdout)  # an error like a kernel file that cannot be read: no document
    assert out.stderr.startswith("berth agent discover: ") and f"gpus[1].{field}" in out.stderr


def test_an_empty_mig_list_is_what_the_standin_reports_for_that_gpu(standin, gpus):
    top = {"hostname": "mig-zero", "gpus": [dict(A100, mig=[])], "host": {"cpus": 8, "memoryGiB": 64}}
    standin(top)
    from agent.simulate import SimulatedGpus

    (nvml_gpu,) = gpus.discover().gpus
    (sim_gpu,) = SimulatedGpus(simulate.parse(json.dumps(top))).discover().gpus
    assert (MigMode(current=True, pending=True), ()) == (nvml_gpu.migMode, nvml_gpu.migDevices)
    assert (nvml_gpu.migMode, nvml_gpu.migDevices) == (sim_gpu.migMode, sim_gpu.migDevices)
