"""The in-band clean's MIG part (agent/nvml.clean_gpus) against the stand-in NVML, through the real nvidia-ml-py
binding: what a tenant with root did to a MIG layout (tests/agent/fake_nvml/tenant.py, its own pynvml calls) is
undone with NVML's GPU and compute instance calls, the calls are recorded, and the clean check
(common.inventory.differences) compares the layout by position, so recreated devices with new UUIDs are clean."""
from __future__ import annotations

import pytest

from agent import nvml
from agent.discovery import assemble
from agent.host import KernelHost
from common.inventory import Inventory, MigPlacement, differences
from tests.agent import fake_nvml
from tests.agent.fake_nvml import tenant

A100 = {"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920}
H100 = {"name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}
# GPU 0: GPU instances 1 (3g.40gb at slice 0), 2 (2g.20gb at 3), 3 and 4 (1g.10gb at 5 and 6); GPU 1: MIG off;
# GPU 2: a 3g.40gb GPU instance split into compute instances (one 1c.3g.40gb here).
HOST = {"hostname": "mig", "gpus": [
    dict(A100, mig=[{"profile": "3g.40gb"}, {"profile": "2g.20gb"}, {"profile": "1g.10gb", "count": 2}]),
    H100,
    dict(A100, mig={"profile": "1c.3g.40gb"})]}
MIG_CALLS = ("ci-destroy", "gi-destroy", "gi-create", "ci-create", "mig-mode")


@pytest.fixture
def host(standin, standin_library, tmp_path, monkeypatch):
    """The stand-in with HOST; `discover()` the inventory, `clean(recorded)` the clean's problems, `calls()` the MIG
    calls the clean made (the tenant's are not recorded: it runs before the calls file is named)."""
    calls = tmp_path / "calls.txt"
    standin(HOST)
    lib = str(standin_library)
    facts = KernelHost().read()

    class Host:
        @staticmethod
        def discover() -> Inventory:
            return assemble(nvml.NvmlGpus(library=lib).discover(), facts)

        @staticmethod
        def clean(recorded: Inventory) -> list[str]:
            monkeypatch.setenv(fake_nvml.CALLS_ENV, str(calls))
            try:
                return nvml.clean_gpus(lib, recorded)
            finally:
                monkeypatch.delenv(fake_nvml.CALLS_ENV)

        @staticmethod
        def calls() -> list[str]:
            lines = calls.read_text().splitlines() if calls.exists() else []
            return [c for c in lines if c.split()[0] in MIG_CALLS]

        @staticmethod
        def tenant():
            return nvml.session(lib)

    return Host


def positions(inv: Inventory, gpu: int) -> dict[tuple, str]:
    return {(m.placement.start, m.profile, m.gpuInstanceId, m.computeInstanceId): m.uuid
            for m in inv.gpus[gpu].migDevices}


def test_discovery_reports_each_mig_devices_placement_and_its_slot_is_the_placement_start(host):
    inv = host.discover()
    assert [(0, 0, 3), (3, 3, 2), (5, 5, 1), (6, 6, 1)] == \
        [(m.index, m.placement.start, m.placement.size) for m in inv.gpus[0].migDevices]
    assert [("1c.3g.40gb", MigPlacement(start=0, size=3))] == [(m.profile, m.placement) for m in inv.gpus[2].migDevices]


def test_a_tenant_made_gpu_instance_is_destroyed_and_a_destroyed_declared_one_recreated_at_its_placement(host):
    before = host.discover()
    with host.tenant():
        tenant.destroy_gi(0, 3)  # the declared 1g.10gb at slice 5
        tenant.destroy_gi(0, 4)
        assert 3 == tenant.create_gi(0, "2g.20gb", 5)  # the tenant's own, over both
    changed = host.discover()
    assert differences(before, changed)  # not clean as the tenant left it
    assert [] == host.clean(before)
    assert ["ci-destroy 0 3 0", "gi-destroy 0 3", "gi-create 0 3 0 5", "ci-create 0 3 0 5", "gi-create 0 4 0 6",
            "ci-create 0 4 0 6"] == host.calls()
    after = host.discover()
    assert [] == differences(before, after)  # clean: the same positions
    old, new = positions(before, 0), positions(after, 0)
    assert old.keys() == new.keys()
    assert [True, True, False, False] == [old[p] == new[p] for p in sorted(old)]  # recreated: fresh UUIDs


def test_an_extra_compute_instance_is_destroyed_and_its_gpu_instance_kept(host):
    before = host.discover()
    with host.tenant():
        assert 1 == tenant.create_ci(2, 1, 1)  # a second 1c.3g.40gb in GPU 2's GPU instance 1
    assert 2 == len(host.discover().gpus[2].migDevices)
    assert [] == host.clean(before)
    assert ["ci-destroy 2 1 1"] == host.calls()
    assert [] == differences(before, host.discover())
    assert positions(before, 2) == positions(host.discover(), 2)  # the kept one keeps its UUID


@pytest.mark.parametrize("gpu, on, expected", [
    (1, True, ["mig-mode 1 0"]),  # the tenant turned MIG on where it was off
    (0, False, ["mig-mode 0 1", "gi-create 0 1 2 0", "ci-create 0 1 0 0", "gi-create 0 2 1 3", "ci-create 0 2 0 3",
                "gi-create 0 3 0 5", "ci-create 0 3 0 5", "gi-create 0 4 0 6", "ci-create 0 4 0 6"]),  # and off
])
def test_a_mig_mode_the_tenant_flipped_is_flipped_back_and_the_layout_rebuilt(host, gpu, on, expected):
    before = host.discover()
    with host.tenant():
        if not on:
            for gi in (1, 2, 3, 4):
                tenant.destroy_gi(gpu, gi)
        tenant.set_mig_mode(gpu, on)
    assert on == host.discover().gpus[gpu].migMode.current
    assert [] == host.clean(before)
    assert expected == host.calls()
    assert [] == differences(before, host.discover())


def test_a_layout_as_recorded_is_left_alone_and_the_mig_mode_not_set(host):
    before = host.discover()
    assert [] == host.clean(before)
    assert [] == host.calls()  # nothing destroyed, created, or set: the mode is what was recorded
    assert positions(before, 0) == positions(host.discover(), 0)


def test_a_restored_layout_is_the_next_hand_overs_baseline(host):
    """After a restore the node is handed over again with the new UUIDs; its next clean changes nothing."""
    first = host.discover()
    with host.tenant():
        tenant.destroy_gi(0, 4)
    assert [] == host.clean(first)
    second = host.discover()
    host.calls()
    assert [] == host.clean(second) and [] == differences(second, host.discover())


def test_the_layout_outlives_nvml_shutdown_until_a_new_topology_is_written(host, standin):
    with host.tenant():
        tenant.destroy_gi(0, 4)
    assert 3 == len(host.discover().gpus[0].migDevices)  # another session, the same layout
    standin(HOST)  # a new topology file: its own layout
    assert 4 == len(host.discover().gpus[0].migDevices)


def test_a_gpu_a_process_holds_is_not_touched_and_the_refusal_is_reported(host, standin):
    before = host.discover()
    standin(HOST, processes=[fake_nvml.Process(gpu=0, pid=4242, gi=1, ci=0)])
    with host.tenant():
        tenant.destroy_gi(0, 4)
    problems = host.clean(before)
    assert ["GPU 0: not reset: held by compute process(es) 4242; the driver resets only a GPU no process holds"] == \
        problems
    assert [] == host.calls()


def test_an_instance_the_gpu_cannot_place_again_is_reported(host):
    """A recorded GPU instance without a placement (a record from before placements were read) is not guessed at:
    the clean says which one it could not recreate, and the check names the difference."""
    before = host.discover()
    recorded = before.to_wire()
    recorded["gpus"][0]["migDevices"][3]["placement"] = None  # an older record: no placement to recreate at
    with host.tenant():
        tenant.destroy_gi(0, 4)
    problems = host.clean(Inventory.from_wire(recorded))
    assert ["GPU 0: MIG GPU instance 4 (1g.10gb) not recreated: no placement was recorded"] == problems
    assert differences(before, host.discover())
