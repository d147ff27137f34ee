"""The bootstrap file declares each id and each token once: a second entry with the same id (a tenant, a principal,
a pool, a node, a tenant's offer in a pool), the same token in two places, or a key written twice in one object is
refused, naming both places (never the token), and nothing of the file is applied."""
from __future__ import annotations

import json
import re

import pytest

from controlplane.bootstrap import BootstrapError, parse
from controlplane.domain.clock import FakeClock
from controlplane.domain.errors import DomainError
from controlplane.wiring import Config, ConfigError, ControlPlane
from tests.controlplane.conftest import K8S_BOOT, MIG_BOOT, T0, TOKENS, bootstrap_doc, h100_node

ADMIN = "admin-token-for-tests-0001"
H100_BOOT = "node-token-h100-000001"


def refused(doc: dict) -> str:
    with pytest.raises(BootstrapError) as err:
        parse(json.dumps(doc).encode())
    return str(err.value)


def _tenant(doc):
    doc["tenants"].append({"id": "globex", "budgetUsd": "5000", "quota": {"gpu:H100_80GB": 64}})  # tenants[3]


def _principal(doc):
    doc["principals"].append({"id": "alice", "tenant": "globex", "token": "token-globex-alice-0001"})  # [6]


def _pool(doc):  # pools[7]: h100 again, in another region at another price
    doc["pools"].append({"id": "h100", "owner": "acme", "region": "us", "gpuModel": "H100_80GB",
                         "pricePerGpuHourUsd": "0.01"})


def _node(doc):  # nodes[8]: h2 again, another hostname and GPU count
    doc["nodes"].append({**h100_node("h2"), "hostname": "h2-other.test", "gpus": 2})


def _offer(doc):  # pools[0].offers[2]: a second offer to globex in pool h100
    doc["pools"][0]["offers"].append({"tenant": "globex", "budgetCheck": False})


@pytest.mark.parametrize("change, second, first", [
    (_tenant, "tenants[3].id", "tenants[1].id"),
    (_principal, "principals[6].id", "principals[0].id"),
    (_pool, "pools[7].id", "pools[0].id"),
    (_node, "nodes[8].id", "nodes[1].id"),
    (_offer, "pools[0].offers[2].tenant", "pools[0].offers[0].tenant"),
], ids=["tenant", "principal", "pool", "node", "offer"])
def test_an_id_declared_twice_is_refused_naming_both_entries(change, second, first):
    doc = bootstrap_doc()
    change(doc)
    message = refused(doc)
    assert message.startswith(f"{second}: ")  # the second occurrence is the field in error
    assert first in message
    assert re.search(r"keep one|merge them", message)  # and what to do


def _set(*path):
    """A change that sets doc[path[0]][path[1]]...["token"] (or the top-level key) to the token."""
    def change(doc, token):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = token
    return change


def _add_node_token(pool):
    return lambda doc, token: doc["nodeTokens"].append({"pool": pool, "token": token})  # nodeTokens[3]


def shows_none_of(token: str, message: str) -> bool:
    """No 8 characters of the token in a row (the message may not show more than its first 4)."""
    return all(token[i:i + 8] not in message for i in range(len(token) - 7))


@pytest.mark.parametrize("change, token, second, first", [
    (_set("principals", 1, "token"), TOKENS["alice"], "principals[1].token", "principals[0].token"),  # bob: alice's
    (_set("principals", 1, "token"), H100_BOOT, "nodeTokens[0].token", "principals[1].token"),  # a pool's node token
    (_add_node_token("mig"), K8S_BOOT, "nodeTokens[3].token", "nodeTokens[1].token"),  # another pool's node token
    (_add_node_token("mig"), MIG_BOOT, "nodeTokens[3].token", "nodeTokens[2].token"),  # the same pool's, twice
    (_add_node_token("mig"), TOKENS["carol"], "nodeTokens[3].token", "principals[4].token"),
    (_set("adminToken"), TOKENS["alice"], "adminToken", "principals[0].token"),
    (_set("adminToken"), TOKENS["dave"], "adminToken", "principals[5].token"),
    (_set("adminToken"), H100_BOOT, "adminToken", "nodeTokens[0].token"),
], ids=["principal-principal", "principal-nodeToken", "nodeToken-nodeToken", "nodeToken-same-pool",
        "principal-nodeToken-added", "adminToken-principal", "adminToken-last-principal", "adminToken-nodeToken"])
def test_a_token_declared_twice_is_refused_naming_both_places_and_not_the_token(change, token, second, first):
    doc = bootstrap_doc()
    change(doc, token)
    message = refused(doc)
    assert message.startswith(f"{second}: ") and first in message
    assert "new token" in message
    assert token not in message and shows_none_of(token, message)  # a secret


@pytest.mark.parametrize("raw, where", [
    ('{"tenants": [{"id": "a", "budgetUsd": "1", "budgetUsd": "9"}]}', "tenants[0].budgetUsd"),
    ('{"tenants": [{"id": "a", "quota": {"gpu:H100": 4, "gpu:H100": 8}}]}', "tenants[0].quota.gpu:H100"),
    ('{"adminToken": "admin-token-0000000001", "adminToken": "admin-token-0000000002"}', "adminToken"),
    ('{"tenants": [], "tenants": [{"id": "a"}]}', "tenants"),
], ids=["field", "quota-row", "top-level", "list"])
def test_a_key_written_twice_in_one_object_is_refused(raw, where):
    with pytest.raises(BootstrapError) as err:
        parse(raw.encode())
    assert str(err.value).startswith(f"{where}: written twice")
    assert "admin-token-000000000" not in str(err.value)


def test_what_is_not_a_duplicate_still_parses():
    """Two node tokens for one pool (each registers for it), the same id in different kinds (a tenant, a pool
    and a principal all called 'acme'), ids differing only in case, and offers to different tenants."""
    doc = bootstrap_doc()
    doc["nodeTokens"].append({"pool": "h100", "token": "node-token-h100-000002"})
    doc["pools"].append({"id": "acme", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "offers": [{"tenant": "globex"}, {"tenant": "initech"}]})
    doc["principals"].append({"id": "acme", "tenant": "acme", "token": "token-acme-acme-0000001"})
    doc["tenants"].append({"id": "Acme"})
    doc["nodes"].append({**h100_node("H1"), "hostname": "H1-upper.test"})
    catalog, tokens, admin = parse(json.dumps(doc).encode())
    assert {"acme", "Acme"} <= set(catalog.tenants) and "acme" in catalog.pools and "acme" in catalog.principals
    assert {"h1", "H1"} <= set(catalog.nodes)
    assert [("node-token-h100-000001", "h100"), ("node-token-h100-000002", "h100")] == [
        row for row in tokens["node-bootstrap"] if row[1] == "h100"]
    assert ADMIN == admin


def plane(tmp_path, bootstrap: str) -> ControlPlane:
    return ControlPlane(Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap, clock=FakeClock(T0),
                               synchronous="OFF", reconcile=False))


def test_a_start_with_a_duplicate_stops_and_applies_nothing(tmp_path, bootstrap_file):
    """The QA case: a second h100 pool at another price, bob with alice's token, a second h2, a second globex and
    an admin token equal to carol's. The start stops naming the place; the store keeps what the last good start
    applied."""
    good = plane(tmp_path, bootstrap_file()).open()
    before = (good.catalog.current, dict(good.tokens.rows))
    good.close()
    changes = [_pool, _node, _tenant]
    for change in changes:
        doc = bootstrap_doc()
        change(doc)
        bad = plane(tmp_path, bootstrap_file(doc))
        try:
            with pytest.raises(ConfigError, match=r"^--bootstrap .*bootstrap\.json: (pools|nodes|tenants)\[\d\]\.id"):
                bad.open()
        finally:
            bad.close()
    for key, token in (("principals", TOKENS["alice"]), ("adminToken", TOKENS["carol"])):
        doc = bootstrap_doc()
        if key == "principals":
            doc["principals"][1]["token"] = token
        else:
            doc["adminToken"] = token
        bad = plane(tmp_path, bootstrap_file(doc))
        try:
            with pytest.raises(ConfigError) as err:
                bad.open()
            assert token not in str(err.value) and shows_none_of(token, str(err.value))
        finally:
            bad.close()
    again = plane(tmp_path, None).open()  # no bootstrap: what the store holds
    try:
        assert before == (again.catalog.current, dict(again.tokens.rows))
        assert ("principal", "alice") == again.tokens.resolve(TOKENS["alice"])
        assert "eu" == again.catalog.current.pools["h100"].region
    finally:
        again.close()


async def test_a_bootstrap_through_the_admin_api_with_a_duplicate_changes_nothing(tmp_path, bootstrap_file):
    cp = plane(tmp_path, bootstrap_file()).open()
    try:
        before = (cp.catalog.current, dict(cp.tokens.rows))
        doc = bootstrap_doc()
        doc["principals"][1]["token"] = TOKENS["alice"]
        with pytest.raises(DomainError) as err:
            await cp.apply_bootstrap_doc(json.dumps(doc).encode())
        assert ("principals[1].token", True) == (err.value.details["field"], "principals[0].token" in err.value.details["rule"])
        assert shows_none_of(TOKENS["alice"], str(err.value))
        assert before == (cp.catalog.current, dict(cp.tokens.rows))
        assert ("principal", "alice") == cp.tokens.resolve(TOKENS["alice"])
    finally:
        cp.close()


async def test_a_token_another_caller_holds_in_the_store_is_not_taken_over_by_a_later_document(tmp_path):
    """A document that does not name alice cannot give alice's stored token to someone else: refused, nothing
    applied, and alice's token still speaks for alice."""
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    cp = ControlPlane(Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=str(tmp_path / "b.json"),
                             clock=FakeClock(T0), reconcile=False)).open()
    try:
        later = {"tenants": [{"id": "acme"}], "principals": [{"id": "zed", "tenant": "acme", "token": TOKENS["alice"]}]}
        with pytest.raises(DomainError) as err:
            await cp.apply_bootstrap_doc(json.dumps(later).encode())
        assert ("principals[0].token", True) == (err.value.details["field"],
                                                 "already the token of principal alice" in str(err.value))
        assert shows_none_of(TOKENS["alice"], str(err.value))
        assert ("principal", "alice") == cp.tokens.resolve(TOKENS["alice"]) and "zed" not in cp.catalog.current.principals
        node_boot = bootstrap_doc()["nodeTokens"][0]
        for doc, field in (({"tenants": [{"id": "acme"}], "principals": [  # the document's own path, whichever
                {"id": "zed", "tenant": "acme", "token": "a-token-of-zed-00000001"},
                {"id": "yve", "tenant": "acme", "token": node_boot["token"]}]}, "principals[1].token"),
                           ({"adminToken": TOKENS["alice"]}, "adminToken")):
            with pytest.raises(DomainError) as err:
                await cp.apply_bootstrap_doc(json.dumps(doc).encode())
            assert field == err.value.details["field"], err.value
        rotated = {"tenants": [{"id": "acme"}], "principals": [
            {"id": "alice", "tenant": "acme", "token": "a-new-token-for-alice-0001"},
            {"id": "zed", "tenant": "acme", "token": TOKENS["alice"]}]}  # alice named with a new one: hers is free
        await cp.apply_bootstrap_doc(json.dumps(rotated).encode())
        assert ("principal", "zed") == cp.tokens.resolve(TOKENS["alice"])
    finally:
        cp.close()
