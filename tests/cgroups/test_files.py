"""cgroups.files: the one reader/writer pair and the parsers of cgroupfs formats."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from cgroups.errors import CgroupError, FileMissing
from cgroups.files import (Drift, apply_values, drift_values, format_cpulist, format_max, parse_cpulist, parse_keyed,
                           parse_max, read_file, write_file)


@pytest.mark.parametrize("name", ["a/b", "../cpu.max", "", ".", ".."])
def test_names_with_slashes_or_dots_are_refused(tmp_path, name):
    with pytest.raises(CgroupError, match="a name, not a path"):
        write_file(tmp_path, name, "1")
    with pytest.raises(CgroupError, match="a name, not a path"):
        read_file(tmp_path, name)


def test_write_error_names_the_path_and_the_value(tmp_path):
    with pytest.raises(FileMissing) as info:
        write_file(tmp_path, "memory.max", "1234")
    assert str(tmp_path / "memory.max") in str(info.value)
    assert "'1234'" in str(info.value)
    assert (info.value.path, info.value.value) == (tmp_path / "memory.max", "1234")


def test_write_then_read_round_trips_without_the_newline(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    write_file(tmp_path, "cpu.max", "250000 100000")
    assert "250000 100000" == read_file(tmp_path, "cpu.max")


def test_an_empty_value_is_written_as_a_newline_so_the_kernel_sees_it(tmp_path):
    (tmp_path / "cpuset.cpus").write_text("0-3\n")
    write_file(tmp_path, "cpuset.cpus", "")
    assert "\n" == (tmp_path / "cpuset.cpus").read_text()


@pytest.mark.parametrize("text,expected", [("max", None), ("max\n", None), ("0", 0), ("1073741824", 1 << 30)])
def test_parse_max_reads_max_as_no_limit(text, expected):
    assert expected == parse_max(text)


def test_parse_max_refuses_garbage():
    with pytest.raises(CgroupError):
        parse_max("lots")


def test_format_max_is_the_inverse_of_parse_max():
    assert ("max", "42") == (format_max(None), format_max(42))


def test_parse_keyed_reads_flat_keyed_files():
    assert {"low": 0, "high": 2, "oom_kill": 1} == parse_keyed("low 0\nhigh 2\noom_kill 1\n")


@pytest.mark.parametrize("text,ids", [("", set()), ("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), ("1,3-4", {1, 3, 4})])
def test_parse_cpulist(text, ids):
    assert frozenset(ids) == parse_cpulist(text)


@given(st.frozensets(st.integers(0, 300)))
def test_cpulist_format_is_canonical_and_round_trips(ids):
    text = format_cpulist(ids)
    assert ids == parse_cpulist(text)
    assert text == format_cpulist(parse_cpulist(text))


def test_apply_values_writes_only_what_differs(tmp_path):
    (tmp_path / "a").write_text("1\n")
    (tmp_path / "b").write_text("2\n")
    assert ["b"] == apply_values(tmp_path, {"a": "1", "b": "3"})
    assert [] == apply_values(tmp_path, {"a": "1", "b": "3"})


def test_drift_values_lists_each_difference(tmp_path):
    (tmp_path / "a").write_text("1\n")
    assert [Drift("a", "2", "1"), Drift("b", "0", "<missing>")] == drift_values(tmp_path, {"a": "2", "b": "0"})
