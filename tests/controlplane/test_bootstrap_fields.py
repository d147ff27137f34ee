"""A bad value in the bootstrap file is refused naming its field, down to the key of a quota row (which msgspec's
own messages cannot name: they say `quota[...]`)."""
from __future__ import annotations

import json

import pytest

from controlplane.bootstrap import BootstrapError, parse
from tests.controlplane.conftest import bootstrap_doc


@pytest.mark.parametrize("value, rule", [
    (-1, "must be a number >= 0"),
    ("8", "must be a number (got a string)"),
    (True, "must be a number (got a boolean)"),
    (None, "must be a number (got null)"),
    ([8], "must be a number (got an array)"),
])
def test_a_quota_value_that_is_not_a_count_is_refused_naming_its_key(value, rule):
    doc = bootstrap_doc()
    doc["tenants"][0]["quota"]["gpu:H100_80GB"] = value
    with pytest.raises(BootstrapError) as err:
        parse(json.dumps(doc).encode())
    assert str(err.value) == f"tenants[0].quota.gpu:H100_80GB: {rule}"


def test_a_fractional_gpu_quota_and_an_unknown_row_are_named():
    doc = bootstrap_doc()
    doc["tenants"][0]["quota"]["gpu:H100_80GB"] = 1.5
    with pytest.raises(BootstrapError, match=r"^tenants\[0\]\.quota\.gpu:H100_80GB: GPU quota must be a whole number"):
        parse(json.dumps(doc).encode())
    doc["tenants"][0]["quota"] = {"disk": 1}
    with pytest.raises(BootstrapError, match=r"^tenants\[0\]\.quota\.disk: quota rows are"):
        parse(json.dumps(doc).encode())


def test_fractional_vcpu_and_memory_quota_are_kept_in_their_units():
    doc = bootstrap_doc()
    doc["tenants"][0]["quota"] = {"vcpu": 2.5, "memoryGiB": 0.5}
    catalog, _, _ = parse(json.dumps(doc).encode())
    tenant = catalog.tenants[doc["tenants"][0]["id"]]
    assert tenant.quota == {"vcpu_milli": 2500, "memory_mib": 512}


@pytest.mark.parametrize("hostname, taken", [("gpu-01.example.net", True), ("gpu_01", True),
                                             ("gpu-01.example.net.", True),  # absolute, as an earlier release took ("bad host", False),
                                             ("line\nbreak", False), ("-dash.example", False), ("a" * 64, False)])
def test_a_declared_nodes_hostname_is_held_to_the_rule_its_agent_registers_with(hostname, taken):
    """The node API refuses a register whose hostname is not a host name; a declared node with one could never be
    taken over by its agent, so the bootstrap refuses it, naming the field."""
    doc = bootstrap_doc()
    doc["nodes"][0]["hostname"] = hostname
    if taken:
        catalog, _, _ = parse(json.dumps(doc).encode())
        assert hostname == catalog.nodes[doc["nodes"][0]["id"]].hostname
    else:
        with pytest.raises(BootstrapError, match=r"^nodes\[0\]\.hostname: .* is not a host name \(letters"):
            parse(json.dumps(doc).encode())
