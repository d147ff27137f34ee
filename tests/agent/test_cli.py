"""`berth agent discover`: JSON and table output, --simulate, and this untouched machine without a GPU driver."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def _berth(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "BERTH_NVML_LIBRARY")}
    return subprocess.run([sys.executable, "-m", "berth", *args], capture_output=True, text=True,
                          env=env or clean, timeout=60)


def test_discover_json_on_this_untouched_machine_exits_0_and_says_no_gpu_driver():
    out = _berth("agent", "discover", "--json")
    assert 0 == out.returncode, out.stderr
    doc = json.loads(out.stdout)
    assert ("not-found", []) == (doc["driver"]["status"], doc["gpus"])
    assert "no GPU driver found" in doc["driver"]["message"]
    assert "no GPU driver found" in out.stderr
    assert doc["cpus"]["onlineCount"] >= 1 and doc["memory"]["totalMiB"] > 0
    assert {"1G", "2M"} == set(doc["hugepages"])


def test_discover_simulated_h100_host_shows_eight_h100s(capsys):
    assert 0 == cli.main(["discover", "--simulate", str(EXAMPLES / "h100x8.json"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert ["H100_80GB"] * 8 == [g["deviceClass"] for g in doc["gpus"]]
    assert (8, 27.875) == (doc["share"]["bookableGpus"], doc["share"]["perGpu"]["vcpu"])


def test_discover_prints_a_table_without_json(capsys):
    assert 0 == cli.main(["discover", "--simulate", str(EXAMPLES / "a100-mig.json"), "--reserve-vcpu", "2"])
    out = capsys.readouterr().out
    assert "Host sim-a100-mig" in out
    assert 7 == out.count("MIG 1g.10gb")
    assert "reserved 2 vcpu, allocatable 30 vcpu" in out
    assert "Per-GPU share: none (no bookable GPU)" in out


def test_a_reserve_that_leaves_nothing_to_share_says_what_to_lower(capsys):
    assert 0 == cli.main(["discover", "--simulate", str(EXAMPLES / "h100x8.json"), "--reserve-vcpu", "1000"])
    out = capsys.readouterr().out
    assert ("Per-GPU share: none: the reserve leaves no CPU or memory to share over 8 bookable GPUs (lower "
            "--reserve-vcpu or --reserve-memory-gib)") in out


def test_the_table_on_this_machine_says_no_gpu_driver():
    out = _berth("agent", "discover")
    assert 0 == out.returncode
    assert "GPUs: none (no GPU driver found" in out.stdout
    assert "CPUs:" in out.stdout and "Memory:" in out.stdout and "Hugepages:" in out.stdout


def test_hand_made_roots_are_options(capsys, tree):
    from tests.agent.trees import two_node_host

    two_node_host(tree)
    broken = tree.proc.parent / "libnvidia-ml.so.1"  # an ELF that cannot be loaded: no GPU driver on this host,
    broken.write_bytes(b"\x7fELF" + bytes(60))  # whatever is installed (and no library stays loaded in the process)
    assert 0 == cli.main(["discover", "--json", "--proc-root", str(tree.proc), "--sys-root", str(tree.sys),
                          "--nvml-library", str(broken), "--reserve-memory-gib", "0"])
    doc = json.loads(capsys.readouterr().out)
    assert ("gpu-host-7", "6-7,15", 60416) == (doc["hostname"], doc["cpus"]["offline"], doc["memory"]["allocatableMiB"])


@pytest.mark.parametrize("args, message", [
    (["--simulate", "/nonexistent.json"], "/nonexistent.json"),
    (["--reserve-vcpu", "-1"], "argument --reserve-vcpu: '-1': give a number of at least 0"),
    (["--reserve-memory-gib", "inf"], "argument --reserve-memory-gib: 'inf'"),
    (["--nvml-library", "/etc/hostname"], "not a shared library"),
    (["--device-classes", "/nonexistent-classes.json"], "--device-classes"),
])
def test_bad_options_exit_2_with_a_message(capsys, args, message):
    assert 2 == cli.main(["discover", *args])
    assert message in capsys.readouterr().err


def test_a_bad_topology_names_the_field(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"name": "NVIDIA H100", "memoryMiB": -5}]}))
    assert 2 == cli.main(["discover", "--simulate", str(bad)])
    assert "gpus[0].memoryMiB" in capsys.readouterr().err


def test_discover_help_exits_0(capsys):
    assert 0 == cli.main(["discover", "--help"])
    assert "--simulate" in capsys.readouterr().out


@pytest.mark.parametrize("rules, field", [
    ([{"match": "H100", "class": 5}], "[0].class: 5 is not a string"),
    ([{"match": "H100", "class": "H100_X"}, {"match": "A100", "class": None}], "[1].class: None is not a string"),
    ([{"match": 5, "class": "H100_X"}], "[0].match: 5 is not a regex"),
    ([{"match": "(", "class": "H100_X"}], "[0].match: '(' is not a regex"),
    ([{"class": "H100_X"}], "[0].match: missing"),
    (["H100"], "[0]: a rule is an object"),
])
def test_device_class_rules_of_the_wrong_type_exit_2_naming_the_file_rule_and_field(capsys, tmp_path, rules, field):
    path = tmp_path / "classes.json"
    path.write_text(json.dumps(rules))
    assert 2 == cli.main(["discover", "--simulate", str(EXAMPLES / "h100x8.json"), "--device-classes", str(path)])
    err = capsys.readouterr().err
    assert f"--device-classes {path}{field}" in err and 1 == len(err.strip().splitlines()), err


@pytest.mark.parametrize("flag", ["--reserve-vcpu", "--reserve-memory-gib"])
def test_a_reserve_beyond_any_host_exits_2_naming_the_flag(capsys, flag):
    assert 2 == cli.main(["discover", "--simulate", str(EXAMPLES / "h100x8.json"), flag, "1e308"])
    assert f"argument {flag}: '1e308': give a number from 0 to 1048576" in capsys.readouterr().err


def test_an_inventory_the_control_plane_would_refuse_is_not_printed(capsys, tmp_path):
    """Before: exit 0 with a deviceClass of 98 characters, which the document's own schema refuses."""
    top = tmp_path / "long.json"
    top.write_text(json.dumps({"hostname": "long", "gpus": [{"name": "N" * 95, "memoryMiB": 1000}]}))
    assert 1 == cli.main(["discover", "--simulate", str(top), "--json"])
    out = capsys.readouterr()
    assert "" == out.out
    assert "gpus[0].deviceClass" in out.err and "--device-classes" in out.err
