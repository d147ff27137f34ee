"""Fuzz: malformed bodies to every method never produce a 500; each is INVALID_INPUT naming the field.

The malformed values are derived from the wire schemas themselves
(msgspec.inspect), so a field added to a schema is fuzzed too.
"""
from __future__ import annotations

import json

import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane import schemas
from controlplane.api import admin, identity, pools
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess

from common import nodewire

TENANT, BOOTSTRAP, NODE, ADMIN = "alice", "node-token-h100-000001", "node", "admin"  # whose token a method takes

METHODS = {
    "/api/compute/reservations/create": (schemas.CreateBody, {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}, TENANT),
    "/api/compute/reservations/get": (schemas.ReservationRef, {"reservationId": "rsv_x"}, TENANT),
    "/api/compute/reservations/list": (schemas.ListBody, {}, TENANT),
    "/api/compute/reservations/release": (schemas.ReservationRef, {"reservationId": "rsv_x"}, TENANT),
    "/api/compute/reservations/cancel": (schemas.ReservationRef, {"reservationId": "rsv_x"}, TENANT),
    "/api/compute/reservations/extend": (schemas.ExtendBody, {"reservationId": "rsv_x", "by": 1000}, TENANT),
    "/api/compute/reservations/quote": (schemas.CreateBody, {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}, TENANT),
    "/api/compute/events/list": (schemas.EventsBody, {}, TENANT),
    "/api/compute/operations/wait": (schemas.OperationWait, {"operationId": "op_x_0", "timeoutMs": 0}, TENANT),
    "/api/compute/usage/list": (schemas.UsageBody, {}, TENANT),
    "/api/nodes/register": (nodewire.RegisterRequest, {"hostname": "fuzz.test", "inventory": None}, BOOTSTRAP),
    "/api/nodes/heartbeat": (nodewire.HeartbeatRequest, {}, NODE),
    "/api/nodes/watch": (nodewire.WatchRequest, {"timeoutMs": 0}, NODE),
    "/api/nodes/report": (nodewire.ReportRequest, {"reports": [{"reservationId": "rsv_x", "status": "unbound"}]}, NODE),
    "/api/compute/pools/list": (pools.PoolsBody, {}, TENANT),
    "/api/compute/pools/get": (pools.PoolGetBody, {"poolId": "h100"}, TENANT),
    "/api/iam/whoami": (identity.WhoamiBody, {}, TENANT),
    "/api/admin/nodes/list": (admin.NodeListBody, {}, ADMIN),
    "/api/admin/nodes/get": (admin.NodeGetBody, {"nodeId": "h1"}, ADMIN),
    **{f"/api/admin/nodes/{action}": (admin.NodeActionBody, {"nodeId": "nope"}, ADMIN)
       for action in ("cordon", "uncordon", "drain", "clear")},
    "/api/admin/nodes/release-identity": (admin.NodeBody, {"nodeId": "nope"}, ADMIN),
    "/api/admin/pools/list": (admin.Nothing, {}, ADMIN),
    "/api/admin/pools/get": (admin.PoolBody, {"poolId": "h100"}, ADMIN),
    "/api/admin/tenants/list": (admin.Nothing, {}, ADMIN),
    "/api/admin/tenants/get": (admin.TenantBody, {"tenantId": "acme"}, ADMIN),
    "/api/admin/tenants/budget": (admin.BudgetBody, {"tenantId": "nope", "budgetUsd": "1"}, ADMIN),
    "/api/admin/events/list": (schemas.EventsPage, {}, ADMIN),
}


def inventory() -> dict:
    from tests.controlplane.test_nodes import inventory as simulated

    return simulated("fuzz.test")


def _bad_values(t: mi.Type, base) -> list[tuple[tuple, object, str]]:
    """(path, value, the field the refusal must name) for each value the type refuses, the path relative to t."""
    if isinstance(t, mi.UnionType):
        inner = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return _bad_values(inner[0], base) if len(inner) == 1 else [((), [], "")]
    if isinstance(t, mi.IntType):
        out = ["1", 1.5, True, [], {}]
        if t.ge is not None:
            out.append(t.ge - 1)
        if t.le is not None:
            out.append(t.le + 1)
        return [((), v, "") for v in out]
    if isinstance(t, mi.FloatType):
        out = ["x", True, [], {}]
        if t.ge is not None:
            out.append(t.ge - 1)
        if t.gt is not None:
            out.append(t.gt)
        if t.le is not None:
            out.append(t.le + 1)
        return [((), v, "") for v in out]
    if isinstance(t, mi.StrType):
        out = [1, True, [], {}]
        if t.min_length:
            out.append("")
        if t.max_length is not None:
            out.append("x" * (t.max_length + 1))
        return [((), v, "") for v in out]
    if isinstance(t, mi.BoolType):
        return [((), v, "") for v in (1, "true", [], {})]
    if isinstance(t, mi.LiteralType):
        return [((), v, "") for v in ("nope", 1)]
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        out: list[tuple[tuple, object, str]] = [((), 1, ""), ((), "x", "")]
        item = getattr(t, "item_type", None)
        if item is not None and isinstance(base, list) and base:
            out += [((0, *p), v, f"[0]{f}") for p, v, f in _bad_values(item, base[0])]
        if getattr(t, "max_length", None) is not None and isinstance(base, list) and base:
            out.append(((), base * (t.max_length + 1), ""))
        return out
    if isinstance(t, mi.StructType):
        out = [((), 1, ""), ((), "x", ""), ((), [], ""), ((("bogus",), 1, ".bogus"))]
        here = base if isinstance(base, dict) else {}
        for f in t.fields:
            out += [((f.encode_name, *p), v, f".{f.encode_name}{sub}")
                    for p, v, sub in _bad_values(f.type, here.get(f.encode_name))]
        return out
    return []


def _set(doc, path: tuple, value):
    """A copy of doc with the value at path (dicts made where missing)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(doc)
        items[head] = _set(items[head], rest, value)
        return items
    out = dict(doc) if isinstance(doc, dict) else {}
    out[head] = _set(out.get(head), rest, value)
    return out


def _cases():
    inv = inventory()
    cases = []
    for method, (schema, base, who) in METHODS.items():
        base = {k: (inv if v is None and k == "inventory" else v) for k, v in base.items()}
        info = mi.type_info(schema)
        for f in info.fields:
            for path, value, sub in _bad_values(f.type, base.get(f.encode_name)):
                field = (f.encode_name + sub).replace(".[", "[")
                cases.append((method, json.dumps(_set(base, (f.encode_name, *path), value)).encode(), field, who))
            if f.required:
                cases.append((method, json.dumps({k: v for k, v in base.items() if k != f.encode_name}).encode(),
                              f.encode_name, who))
        cases.append((method, json.dumps({**base, "unexpected": 1}).encode(), "unexpected", who))
        for raw in (b"[]", b"1", b'"x"', b"null", b"{", b"\xff\xfe", b'{"a":}', b'{"a": 1, "a": 2}',
                    b"[" * 100_000 + b"]" * 100_000, b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
            cases.append((method, raw, "body", who))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_db_url):
    path = tmp_path_factory.mktemp("fuzz")
    (path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(module_db_url, path / "b.json", ["--synchronous", "NORMAL"]) as proc:
        status, doc = proc.post("/api/nodes/register", BOOTSTRAP, {"hostname": "h1.test", "inventory": inventory()})
        assert status == 200, doc
        proc.tokens = {TENANT: TOKENS["alice"], BOOTSTRAP: BOOTSTRAP, NODE: doc["nodeToken"],
                       ADMIN: bootstrap_doc()["adminToken"]}
        yield proc


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_schema_field_refuses_wrong_values_naming_itself(server, method):
    for path, raw, field, who in [c for c in CASES if c[0] == method]:
        status, doc = server.post(path, server.tokens[who], raw)
        assert status == 400, (raw[:300], status, doc)
        assert doc["error"]["code"] == "INVALID_INPUT", (raw[:300], doc)
        assert doc["error"]["details"]["field"] == field, (raw[:300], doc)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(sorted(METHODS)), body=st.dictionaries(
    st.sampled_from(["poolId", "gpuModel", "gpuCount", "nodeCount", "start", "end", "durationHours", "binding",
                     "resources", "spot", "leaseSeconds", "reservationId", "scope", "limit", "cursor", "after",
                     "wait", "state", "nodeId", "poolId", "tenantId", "from", "until", "reason", "x"]),
    json_values, max_size=6))
def test_random_bodies_never_produce_a_500(server, method, body):
    status, doc = server.post(method, server.tokens[METHODS[method][2]], json.dumps(body).encode())
    assert status < 500, (body, status, doc)
    if status >= 400:
        assert set(doc["error"]) == {"code", "message", "details"}
        if doc["error"]["code"] == "INVALID_INPUT":
            assert doc["error"]["details"].get("field"), doc
