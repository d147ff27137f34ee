"""The API description at GET /api/openapi.json through real HTTP: valid OpenAPI 3.1, served without a token, naming
every route the app serves and no other, with request schemas that refuse what the server refuses, every error code
with its status, and answers of the real server that match what it says of them."""
from __future__ import annotations

import jsonschema
import msgspec
import pytest
from aiohttp import web
from openapi_spec_validator import validate

from common import errors as error_table
from common.version import VERSION
from controlplane.api import openapi
from controlplane.api.app import create_app
from controlplane.wiring import Config
from tests.controlplane.conftest import TOKENS
from tests.controlplane.test_nodes import ADMIN, BOOT, inventory, register

JSON = "application/json"
WITH_BODY = sorted(key for key, d in openapi.DESCRIBED.items() if d.body is not None)
WITH_REQUIRED = [key for key in WITH_BODY
                 if any(f.required for f in msgspec.structs.fields(openapi.DESCRIBED[key].body))]


async def fetch(api) -> dict:
    resp = await api.client.get(openapi.PATH)  # no Authorization header: the description is public
    assert (200, JSON) == (resp.status, resp.content_type)
    return await resp.json()


def pointer(doc: dict, ref: str) -> dict:
    """What a local reference (`#/components/...`) names in doc."""
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def deref(doc: dict, node: dict) -> dict:
    """node, or what its lone local $ref points at (a response, a request's schema)."""
    while set(node) == {"$ref"}:
        node = pointer(doc, node["$ref"])
    return node


def check_answer(doc: dict, method: str, path: str, status: int, body) -> None:
    """body, answered with status, is what the document says this operation answers with that status."""
    response = deref(doc, doc["paths"][path][method.lower()]["responses"][str(status)])
    schema = response["content"][JSON]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(body)


def request_schema(doc: dict, method: str, path: str) -> dict:
    return deref(doc, doc["paths"][path][method.lower()]["requestBody"]["content"][JSON]["schema"])


async def caller(api, path: str) -> str:
    """A token the route takes: the pool's bootstrap token, a node's, the admin token, or a tenant user's."""
    if path == "/api/nodes/register":
        return BOOT
    if path.startswith("/api/nodes/"):
        return (await register(api))["nodeToken"]
    return ADMIN if path.startswith("/api/admin/") else "alice"


async def test_the_document_is_valid_openapi_3_1_served_without_a_token(api):
    doc = await fetch(api)
    validate(doc)
    assert ("3.1.0", "Berth", VERSION) == (doc["openapi"], doc["info"]["title"], doc["info"]["version"])
    assert doc == await fetch(api)  # built once, the same every time


async def test_it_names_every_route_the_app_serves_and_no_other(api):
    # HEAD is left out: aiohttp adds one to every GET, and HTTP defines it as that GET without the body.
    served = {(r.method, r.resource.canonical) for r in api.client.server.app.router.routes() if r.method != "HEAD"}
    doc = await fetch(api)
    described = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert served == described
    assert served == set(openapi.DESCRIBED)


async def nothing(request: web.Request) -> web.Response:
    return web.json_response({})


def test_a_route_it_does_not_describe_or_a_description_of_no_route_is_refused_by_name(tmp_path):
    app = create_app(Config(db=f"sqlite:///{tmp_path / 'cp.db'}"))
    app.router.add_post("/api/compute/secrets/list", nothing)
    with pytest.raises(LookupError, match="not described: POST /api/compute/secrets/list; described, not served: none"):
        openapi.document(app.router)
    bare = web.Application()
    bare.router.add_get("/healthz", nothing)
    with pytest.raises(LookupError, match="not described: none; described, not served: .*POST /api/nodes/register"):
        openapi.document(bare.router)


@pytest.mark.parametrize("method,path", WITH_REQUIRED, ids=[p for _, p in WITH_REQUIRED])
async def test_a_field_the_document_requires_is_one_the_server_refuses_a_body_without(api, method, path):
    doc = await fetch(api)
    required = request_schema(doc, method, path)["required"]
    struct = openapi.DESCRIBED[(method, path)].body
    assert [f.encode_name for f in msgspec.structs.fields(struct) if f.required] == required
    assert doc["paths"][path][method.lower()]["requestBody"]["required"]
    status, answer = await api.post(path, await caller(api, path), {})
    assert (400, "INVALID_INPUT") == (status, answer["error"]["code"]), answer
    assert answer["error"]["details"]["field"] in required


@pytest.mark.parametrize("method,path", WITH_BODY, ids=[p for _, p in WITH_BODY])
async def test_a_field_the_document_does_not_name_is_refused(api, method, path):
    doc = await fetch(api)
    schema = request_schema(doc, method, path)
    assert (False, False) == (schema["additionalProperties"], "notAField" in schema["properties"])
    status, answer = await api.post(path, await caller(api, path), {"notAField": 1})
    assert (400, "INVALID_INPUT") == (status, answer["error"]["code"]), answer
    assert "notAField" in answer["error"]["message"]
    check_answer(doc, method, path, 400, answer)


def bounds(doc: dict, method: str, path: str) -> dict[str, float]:
    """Each property of the request with an inclusive maximum, itself or in one arm of its anyOf."""
    out = {}
    for name, prop in request_schema(doc, method, path)["properties"].items():
        for arm in prop.get("anyOf", [prop]):
            if "maximum" in arm:
                out[name] = arm["maximum"]
    return out


async def test_the_bounds_the_document_gives_a_create_are_the_servers(api):
    doc = await fetch(api)
    found = bounds(doc, "POST", "/api/compute/reservations/create")
    assert {"gpuCount", "nodeCount", "start", "end", "durationHours", "leaseSeconds"} <= set(found)
    for name, maximum in found.items():
        status, answer = await api.create(key=f"over-{name}", **{name: maximum + 1})
        assert (400, name) == (status, answer["error"]["details"]["field"]), answer


async def test_every_error_code_appears_with_its_status(api):
    doc = await fetch(api)
    envelope = deref(doc, doc["components"]["schemas"]["ErrorEnvelope"]["properties"]["error"])
    assert set(error_table.CODES) == set(envelope["properties"]["code"]["enum"])
    assert ["code", "details", "message"] == sorted(envelope["required"])
    for row in error_table.TABLE:
        response = doc["components"]["responses"][f"Refused{row.status}"]
        assert row.code in response["content"][JSON]["schema"]["properties"]["error"]["properties"]["code"]["enum"]
        assert f"{row.code}: {row.meaning}" in response["description"]
    statuses = {str(row.status) for row in error_table.TABLE}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if "requestBody" in op:
                assert statuses <= set(op["responses"]), (method, path)
    assert "Retry-After" in doc["components"]["responses"]["Refused503"]["headers"]
    wrong = {"error": {"code": "CONFLICT", "message": "m", "details": {}}}  # a 409's code, not a 404's
    with pytest.raises(jsonschema.ValidationError):
        check_answer(doc, "POST", "/api/compute/reservations/get", 404, wrong)


async def test_the_real_answers_are_what_the_document_says(api):
    doc = await fetch(api)

    async def post(path: str, who: str, body: dict, expected: int = 200, **kw) -> dict:
        status, answer = await api.post(path, who, body, **kw)
        assert expected == status, answer
        check_answer(doc, "POST", path, status, answer)
        return answer

    created = (await post("/api/compute/reservations/create", "alice",
                          {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}, 202))
    rid = created["reservation"]["id"]
    await post("/api/compute/reservations/get", "alice", {"reservationId": rid})
    await post("/api/compute/reservations/list", "alice", {})
    await post("/api/compute/reservations/quote", "alice", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1,
                                                            "durationHours": 1})
    await post("/api/compute/operations/get", "alice", {"operationId": created["reservation"]["operation"]["id"]})
    for path in ("/api/compute/events/list", "/api/compute/usage/list", "/api/compute/pools/list",
                 "/api/iam/confirmations/list"):
        await post(path, "alice", {})
    for path in ("/api/admin/nodes/list", "/api/admin/pools/list", "/api/admin/tenants/list", "/api/admin/events/list"):
        await post(path, ADMIN, {})
    node = await post("/api/nodes/register", BOOT, {"hostname": "h1.test", "inventory": inventory("h1.test")})
    await post("/api/nodes/heartbeat", node["nodeToken"], {})
    await post("/api/nodes/watch", node["nodeToken"], {"timeoutMs": 0})
    await post("/api/nodes/report", node["nodeToken"], {"reports": []})
    # refusals, each with its own status
    await post("/api/compute/reservations/get", "alice", {"reservationId": "res-none"}, 404)
    await post("/api/compute/reservations/get", None, {"reservationId": rid}, 401)
    await post("/api/compute/reservations/get", "alice", {"reservationId": rid}, 415,
               headers={"Content-Type": "text/plain"})
    for path in ("/healthz", "/healthz/leader"):  # one replica on SQLite: it leads
        resp = await api.client.get(path)
        assert 200 == resp.status
        check_answer(doc, "GET", path, resp.status, await resp.json())
    leader = doc["paths"]["/healthz/leader"]["get"]["responses"]
    assert "not lead" in leader["503"]["description"]  # its own answer, not the error envelope
    check_answer(doc, "GET", "/healthz/leader", 503, {"status": "ok", "leads": False})



async def test_metrics_refuses_a_token_not_the_admins_as_the_document_says(api):
    doc = await fetch(api)
    resp = await api.client.get("/metrics", headers={"Authorization": "Bearer " + TOKENS["alice"]})
    assert 403 == resp.status
    check_answer(doc, "GET", "/metrics", 403, await resp.json())


async def test_every_call_with_a_node_token_names_the_machine_id_header_it_is_checked_against(api):
    doc = await fetch(api)
    header = deref(doc, {"$ref": "#/components/parameters/MachineId"})
    assert ("Berth-Machine-Id", "header") == (header["name"], header["in"])
    for path, item in doc["paths"].items():
        if path.startswith("/api/nodes/"):
            named = {p.get("$ref") for p in item["post"].get("parameters", [])}
            assert ("#/components/parameters/MachineId" in named) == (path != "/api/nodes/register"), path
