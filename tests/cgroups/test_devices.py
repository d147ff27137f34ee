"""cgroups.devices: device rules, their normal form, and the rule sets of a GPU share."""
from __future__ import annotations

import pytest

from cgroups.devices import DeviceRule, harmless_rules, normalise, nvidia_rules, rule
from cgroups.errors import CgroupError, InvalidRule

PROC_DEVICES = """Character devices:
  1 mem
  5 /dev/tty
136 pts
195 nvidia-frontend
234 nvidia-caps
510 nvidia-uvm

Block devices:
  7 loop
259 blkext
"""


@pytest.fixture
def proc(tmp_path):
    (tmp_path / "devices").write_text(PROC_DEVICES)
    (tmp_path / "driver/nvidia-caps").mkdir(parents=True)
    (tmp_path / "driver/nvidia-caps/mig-minors").write_text(
        "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n")
    return tmp_path


@pytest.mark.parametrize("text,kind,major,minor,access", [
    ("c 195:0 rw", "c", 195, 0, "rw"), ("c 136:* rw", "c", 136, None, "rw"), ("a *:* m", "a", None, None, "m"),
    ("b 7:3 rwm", "b", 7, 3, "rwm"),
])
def test_rules_parse_and_print_in_the_devices_allow_format(text, kind, major, minor, access):
    r = DeviceRule.parse(text)
    assert (kind, major, minor, frozenset(access)) == (r.kind, r.major, r.minor, r.access)
    assert text == str(r)


@pytest.mark.parametrize("args", [("x", 1, 1, "r"), ("c", 1, 1, ""), ("c", 1, 1, "rx"), ("c", -1, 0, "r"),
                                  ("c", 4096, 0, "r"), ("c", 1, 1 << 20, "r")])
def test_bad_rules_are_refused(args):
    with pytest.raises(InvalidRule):
        rule(*args)


def test_normalise_merges_accesses_drops_covered_rules_and_sorts():
    rules = [rule("c", 195, 0, "r"), rule("c", 136, 3, "r"), rule("c", 195, 0, "w"), rule("c", 136, None, "rw"),
             rule("b", 7, 0, "r"), rule("a", 7, None, "rw")]
    assert (rule("a", 7, None, "rw"), rule("c", 136, None, "rw"), rule("c", 195, 0, "rw")) == normalise(rules)


def test_normalise_ignores_order():
    rules = list(harmless_rules()) + [rule("c", 195, 3, "rw")]
    assert normalise(rules) == normalise(reversed(rules))


def test_harmless_rules_are_the_usual_nodes():
    assert ["c 1:3 rw", "c 1:5 rw", "c 1:7 rw", "c 1:8 rw", "c 1:9 rw", "c 5:0 rw", "c 5:2 rw", "c 136:* rw"] == [
        str(r) for r in harmless_rules()]


def test_nvidia_rules_read_the_dynamic_majors_from_proc_devices(proc):
    rules = nvidia_rules([0, 3], mig_cap_minors=[12, 13], modeset=True, proc=proc)
    assert ["c 195:0 rw", "c 195:3 rw", "c 195:255 rw", "c 195:254 rw", "c 510:0 rw", "c 510:1 rw",
            "c 234:12 r", "c 234:13 r"] == [str(r) for r in rules]


def test_nvidia_rules_without_modeset_or_mig(proc):
    assert ["c 195:1 rw", "c 195:255 rw", "c 510:0 rw", "c 510:1 rw"] == [str(r) for r in nvidia_rules([1], proc=proc)]


def test_nvidia_rules_say_what_to_load_when_uvm_is_missing(tmp_path):
    (tmp_path / "devices").write_text("Character devices:\n195 nvidia-frontend\n")
    with pytest.raises(CgroupError, match="nvidia-uvm"):
        nvidia_rules([0], proc=tmp_path)
