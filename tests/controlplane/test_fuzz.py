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
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess

METHODS = {
    "/api/compute/reservations/create": (schemas.CreateBody, {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}),
    "/api/compute/reservations/get": (schemas.ReservationRef, {"reservationId": "rsv_x"}),
    "/api/compute/reservations/list": (schemas.ListBody, {}),
    "/api/compute/reservations/release": (schemas.ReservationRef, {"reservationId": "rsv_x"}),
    "/api/compute/reservations/cancel": (schemas.ReservationRef, {"reservationId": "rsv_x"}),
    "/api/compute/events/list": (schemas.EventsBody, {}),
}


def _bad_values(t: mi.Type, path: str) -> list[tuple[object, str]]:
    """(value, field path the refusal must name) that the type refuses."""
    if isinstance(t, mi.UnionType):
        inner = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return _bad_values(inner[0], path) if len(inner) == 1 else [([], path)]
    if isinstance(t, mi.IntType):
        out = ["1", 1.5, True, [], {}]
        if t.ge is not None:
            out.append(t.ge - 1)
        if t.le is not None:
            out.append(t.le + 1)
        return [(v, path) for v in out]
    if isinstance(t, mi.FloatType):
        out = ["x", True, [], {}]
        if t.ge is not None:
            out.append(t.ge - 1)
        if t.gt is not None:
            out.append(t.gt)
        if t.le is not None:
            out.append(t.le + 1)
        return [(v, path) for v in out]
    if isinstance(t, mi.StrType):
        out = [1, True, [], {}]
        if t.min_length:
            out.append("")
        if t.max_length is not None:
            out.append("x" * (t.max_length + 1))
        return [(v, path) for v in out]
    if isinstance(t, mi.BoolType):
        return [(v, path) for v in (1, "true", [], {})]
    if isinstance(t, mi.LiteralType):
        return [(v, path) for v in ("nope", 1)]
    if isinstance(t, mi.StructType):
        out = [(1, path), ("x", path), ([], path), ({"bogus": 1}, f"{path}.bogus")]
        for f in t.fields:
            out += [({f.encode_name: v}, p) for v, p in _bad_values(f.type, f"{path}.{f.encode_name}")]
        return out
    return []


def _cases():
    cases = []
    for method, (schema, base) in METHODS.items():
        info = mi.type_info(schema)
        for f in info.fields:
            for value, field in _bad_values(f.type, f.encode_name):
                cases.append((method, json.dumps({**base, f.encode_name: value}).encode(), field))
            if f.required:
                cases.append((method, json.dumps({k: v for k, v in base.items() if k != f.encode_name}).encode(), f.encode_name))
        cases.append((method, json.dumps({**base, "unexpected": 1}).encode(), "unexpected"))
        for raw in (b"[]", b"1", b'"x"', b"null", b"{", b"\xff\xfe", b'{"a":}'):
            cases.append((method, raw, "body"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz")
    (path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(path / "cp.db", path / "b.json", ["--synchronous", "NORMAL"]) as proc:
        yield proc


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_schema_field_refuses_wrong_values_naming_itself(server, method):
    for path, raw, field in [c for c in CASES if c[0] == method]:
        status, doc = server.post(path, TOKENS["alice"], raw)
        assert status == 400, (raw, status, doc)
        assert doc["error"]["code"] == "INVALID_INPUT", (raw, doc)
        assert doc["error"]["details"]["field"] == field, (raw, doc)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(sorted(METHODS)), body=st.dictionaries(
    st.sampled_from(["poolId", "gpuModel", "gpuCount", "nodeCount", "start", "end", "durationHours", "binding",
                     "resources", "spot", "leaseSeconds", "reservationId", "scope", "limit", "cursor", "after",
                     "wait", "state", "x"]),
    json_values, max_size=6))
def test_random_bodies_never_produce_a_500(server, method, body):
    status, doc = server.post(method, TOKENS["alice"], json.dumps(body).encode())
    assert status < 500, (body, status, doc)
    if status >= 400:
        assert set(doc["error"]) == {"code", "message", "details"}
        if doc["error"]["code"] == "INVALID_INPUT":
            assert doc["error"]["details"].get("field"), doc
