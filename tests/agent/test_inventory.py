"""The inventory document: its wire form round-trips, and diff() says what changed, keyed by identity."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from agent.discovery import Discovery
from common.inventory import Inventory, diff
from agent.simulate import SimulatedGpus, SimulatedHost

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def _inventory(path: Path) -> Inventory:
    gpus = SimulatedGpus(path)
    return Discovery(gpus=gpus, host=SimulatedHost(gpus), wall_ms=lambda: 1).discover()


def _write(tmp_path: Path, top: dict) -> Path:
    path = tmp_path / "top.json"
    path.write_text(json.dumps(top))
    return path


def test_the_wire_form_round_trips():
    inv = _inventory(EXAMPLES / "mixed.json")
    wire = inv.to_wire()
    assert inv == Inventory.from_wire(wire)
    assert inv == Inventory.from_json(inv.to_json())
    assert {"1G", "2M"} == set(wire["hugepages"])


def test_the_wire_form_is_strict():
    wire = _inventory(EXAMPLES / "h100x8.json").to_wire()
    wire["gpus"][0]["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match=r"gpus\[0\]"):
        Inventory.from_wire(wire)


def test_no_change_is_an_empty_diff(tmp_path):
    path = EXAMPLES / "h100x8.json"
    assert diff(_inventory(path), _inventory(path)).empty


def test_the_first_discovery_is_one_addition():
    change = diff(None, _inventory(EXAMPLES / "h100x8.json"))
    assert [("added", "")] == [(c.op, c.path) for c in change.changes]


def test_hugepages_added_changes_the_totals_but_not_free_counters(tmp_path):
    top = json.loads((EXAMPLES / "h100x8.json").read_text())
    before = _inventory(_write(tmp_path, top))
    top["host"]["hugepages1G"] = {"0": 64, "1": 96}
    change = diff(before, _inventory(_write(tmp_path, top)))
    paths = {c.path: (c.old, c.new) for c in change.changes}
    assert (128, 160) == paths["hugepages.1G.total"]
    assert (64, 96) == paths["hugepages.1G.numaNodes[1].total"]
    assert not any(p.endswith(".free") for p in paths)


def test_a_gpu_removed_is_named_with_its_index_and_class(tmp_path):
    top = json.loads((EXAMPLES / "h100x8.json").read_text())
    before = _inventory(_write(tmp_path, top))
    top["lostGpus"] = [5]
    change = diff(before, _inventory(_write(tmp_path, top)))
    lines = change.summary()
    assert f"gpus[{before.gpus[5].uuid}] removed (index 5, deviceClass H100_80GB)" in lines
    assert "lostGpus[5] added (index 5, error GPU is lost)" in lines
    assert "share.bookableGpus: 8 -> 7" in lines


def test_mig_enabled_on_a_gpu_is_a_change_of_mode_and_added_devices(tmp_path):
    top = {"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920}]}
    before = _inventory(_write(tmp_path, top))
    top["gpus"][0]["mig"] = {"profile": "1g.10gb", "count": 7}
    after = _inventory(_write(tmp_path, top))
    change = diff(before, after)
    ops = [(c.op, c.path.split("[")[0] if c.op != "changed" else c.path) for c in change.changes]
    uuid = before.gpus[0].uuid
    assert ("changed", f"gpus[{uuid}].migMode.current") in ops
    assert ("changed", f"gpus[{uuid}].bookable") in ops
    assert 7 == sum(1 for c in change.changes if c.op == "added" and ".migDevices[" in c.path)


def _mig_changed(inv: Inventory, **fields) -> Inventory:
    """inv with its first MIG device changed (the fields given), as a clean might have left it."""
    wire = inv.to_wire()
    gpu = next(g for g in wire["gpus"] if g["migDevices"])
    gpu["migDevices"][0].update(fields)
    return Inventory.from_wire(wire)


@pytest.mark.parametrize("fields, expected", [
    ({"uuid": "MIG-recreated"}, []),  # recreated in place: a new UUID is no difference
    ({"uuid": "MIG-recreated", "gpuInstanceId": 9},  # another GPU instance id
     ["[3g.40gb gi 1 ci 0 at placement 0] removed (index 0, profile 3g.40gb)",
      "[3g.40gb gi 9 ci 0 at placement 0] added (index 0, profile 3g.40gb)"]),
    ({"placement": {"start": 4, "size": 3}},  # another placement
     ["[3g.40gb gi 1 ci 0 at placement 0] removed (index 0, profile 3g.40gb)",
      "[3g.40gb gi 1 ci 0 at placement 4] added (index 0, profile 3g.40gb)"]),
    ({"index": 6}, ["[3g.40gb gi 1 ci 0 at placement 0].index: 0 -> 6"]),  # another slot: the unit would move
])
def test_the_clean_check_compares_mig_devices_by_position_not_uuid(fields, expected):
    from common.inventory import differences

    before = _inventory(EXAMPLES / "mixed.json")
    gpu = next(g for g in before.gpus if g.migDevices)
    assert [f"gpus[{gpu.uuid}].migDevices{e}" for e in expected] == differences(before, _mig_changed(before, **fields))
    assert diff(before, _mig_changed(before, uuid="MIG-recreated")).changes  # diff() still keys them by UUID
