"""A bad value in the bootstrap file is refused naming its field, down to the key of a quota row (which msgspec's
own messages cannot name: they say `quota[...]`)."""
from __future__ import annotations

import json

import pytest

from common.money import RULE as MONEY_RULE
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


MONEY_FIELDS = [("pools", "pricePerGpuHourUsd"), ("pools", "pricePerVcpuHourUsd"), ("pools", "pricePerGibHourUsd"),
                ("tenants", "budgetUsd")]


@pytest.mark.parametrize("kind, field", MONEY_FIELDS)
@pytest.mark.parametrize("value", ["1e3", "1_000", "+3", "-0", "-1", " 5", "5.", ".5", "\u0663", "3\n", "1.1234567",
                                   "1000000000000", "1" + "0" * 60, "1e400", "NaN", 1e-7, 1e60, -1])
def test_a_price_or_budget_outside_the_apis_money_grammar_is_refused_naming_its_field(kind, field, value):
    """The API's money (docs/api.md): an amount it could not take on the wire does not come in by the file either
    (a price of 10^60 made every quote in its pool a 503; "1e3" and an Arabic-Indic digit were read as numbers)."""
    doc = bootstrap_doc()
    doc[kind][0][field] = value
    with pytest.raises(BootstrapError) as err:
        parse(json.dumps(doc).encode())
    assert str(err.value).startswith(f"{kind}[0].{field}: ") and str(err.value).endswith(MONEY_RULE)


@pytest.mark.parametrize("value, amount", [("2.5", "2.5"), ("999999999999.999999", "999999999999.999999"),
                                           (2.49, "2.49"), (5, "5.0"), ("0", "0")])
def test_a_price_in_the_money_grammar_or_a_plain_json_number_is_taken_as_written(value, amount):
    doc = bootstrap_doc()
    doc["pools"][0]["pricePerGpuHourUsd"] = value
    catalog = parse(json.dumps(doc).encode())[0]
    assert str(catalog.pools[doc["pools"][0]["id"]].price_per_gpu_hour) == amount


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


def test_only_a_capacity_the_document_lowers_can_strand_a_nodes_bookings(tmp_path):
    """An agent's node keeps its own, allocatable capacity (the host less its reserve), which bookings made before it
    registered may exceed: the document's other changes to it (its BMC) must still apply. A capacity the document
    lowers below them is refused."""
    from dataclasses import replace

    from common.share import Share
    from controlplane.bootstrap import merge, stranded
    from controlplane.domain.calendar import Booking, Calendar

    doc = bootstrap_doc()
    current, _, _ = parse(json.dumps(doc).encode())
    node = current.nodes["h1"]
    agents = replace(node, declared=False, capacity=Share(60_000, node.capacity.memory_mib, 0))  # less than booked
    current = current.with_changes(nodes={**current.nodes, "h1": agents})
    calendar = Calendar()
    calendar.add_node(node.pool_id, node.id, [u.id for u in node.units])
    calendar.book(Booking("rsv_1", node.pool_id, node.id, tuple(u.id for u in node.units), 0, 10, node.capacity))
    with_bmc = bootstrap_doc()
    creds = tmp_path / "bmc.json"
    creds.write_text('{"username": "u", "password": "p"}')
    creds.chmod(0o600)
    with_bmc["nodes"][0]["bmc"] = {"redfishUrl": "https://bmc.test", "systemId": "1", "credentialsFile": str(creds)}
    declared, _, _ = parse(json.dumps(with_bmc).encode())
    assert stranded(current, merge(current, declared), calendar) is None
    smaller = bootstrap_doc()
    smaller["nodes"][0]["vcpu"] = 8
    declared, _, _ = parse(json.dumps(smaller).encode())
    fresh, _, _ = parse(json.dumps(doc).encode())  # the node as the file declared it, not taken over
    assert "gets less host capacity" in stranded(fresh, merge(fresh, declared), calendar)


def test_a_syntax_error_after_an_unknown_field_is_said_to_be_bad_json_not_blamed_on_the_field():
    with pytest.raises(BootstrapError, match=r"^not valid JSON"):
        parse(b'{"bogus": 1} ]]')
    with pytest.raises(BootstrapError, match="bogus"):
        parse(b'{"bogus": 1}')  # valid JSON: the field is named


@pytest.mark.parametrize("where", ["principals", "nodeTokens", "adminToken"])
@pytest.mark.parametrize("token", ["trailing-newline-token-0001\n", " leading-space-token-00001",
                                   "trailing-space-token-0001 ", "non-ascii-tökén-000001", "control\x01char-token-01"])
def test_a_token_no_header_could_carry_is_refused_without_showing_it(where, token):
    """Such tokens were taken, and every call with them was 401: a header cannot carry them as written."""
    doc = bootstrap_doc()
    if where == "adminToken":
        doc["adminToken"] = token
        field = "adminToken"
    else:
        doc[where][0]["token"] = token
        field = f"{where}[0].token"
    with pytest.raises(BootstrapError) as err:
        parse(json.dumps(doc).encode())
    assert str(err.value).startswith(f"{field}: must be printable ASCII, with no space at either end"), err.value
    assert token.strip()[:8] not in str(err.value)


@pytest.mark.parametrize("token", ["q0Zr+7Kx/9mVb3Yw1tHc2PnL8sJe4dFgUa6iOy5RzTk=", "Acme!Alice#Token@2024:x",
                                   "QUOTE'TOKENPARTtwoLEAKS01", "SPACE TOKENPARTtwoLEAKS03"])
def test_a_token_a_header_can_carry_is_taken(token):
    doc = bootstrap_doc()
    doc["principals"][0]["token"] = token
    parse(json.dumps(doc).encode())
