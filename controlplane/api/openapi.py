"""The API's description: an OpenAPI 3.1 document built from the app's router and the Structs that validate requests.

What is described is what is served: the methods and paths come from the
router, and a route that DESCRIBED does not describe, or a description no
route serves, stops the app at startup, naming it. Each request body's JSON
Schema is msgspec's reading of the very Struct its handler decodes into, so
the document cannot disagree with the validation (OpenAPI 3.1's schemas are
JSON Schema 2020-12, msgspec's dialect); the error envelope is api/errors.py's
Struct, and the refusals come from the one table of codes (common/errors.py).
Checked against the router at startup, built at the first request (once
per app), and served without a token at `GET /api/openapi.json`.
"""
from __future__ import annotations

import http
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from common import errors as error_table
from common import nodewire
from common.version import VERSION
from controlplane import schemas
from controlplane.api import admin, identity, pools, ui
from controlplane.api.errors import BODY_FIELDS, HTTP_CODES, ErrorEnvelope
from controlplane.bootstrap import BootstrapDoc
from controlplane.domain import errors as e
from controlplane.domain import node_states

PATH = "/api/openapi.json"
REF = "#/components/schemas/{name}"
JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Described:
    """What the router cannot say about a route: its body's Struct, its success status and what it answers."""

    summary: str
    body: type[Struct] | None = None  # the Struct the handler decodes the body into; None: it reads no body
    status: int = 200  # on success
    answer: type[Struct] | tuple[str, ...] = ()  # the answer's Struct, or the keys every answer carries
    media: tuple[str, ...] = (JSON,)  # of the answer; none: a redirect
    idempotency_key: bool = False  # also takes the Idempotency-Key header
    also: tuple[tuple[int, str], ...] = ()  # other statuses it answers with the same document (not the error
    # envelope), and when; such a status is not also described as a refusal
    refuses: tuple[str, ...] = ()  # error codes a route without a body refuses with besides a failure, a missing
    # token and a path that names nothing (every code may refuse a body)


RESERVATION = ("reservation",)
NODE_ACTED = ("node", "changed", "moved", "pending")

DESCRIBED: dict[tuple[str, str], Described] = {
    ("GET", "/healthz"): Described("Whether the control plane answers, and whether this replica leads",
                                   answer=("status", "leads")),
    ("GET", "/healthz/leader"): Described(
        "The same, answered 200 only by the replica that leads (for a balancer that reads only the status)",
        answer=("status", "leads"), also=((503, "this replica does not lead (another does, or none yet): send "
                                                "requests to another replica"),)),
    ("GET", PATH): Described("This document", answer=("openapi", "info", "paths", "components")),
    ("GET", "/metrics"): Described("Prometheus text: reservations, nodes, bindings, the store and the reconciler",
                                   media=("text/plain",), refuses=(e.ACCESS_DENIED,)),  # a token not the admin's
    ("GET", "/ui"): Described("Redirects to /ui/", status=302, media=()),
    ("GET", "/ui/"): Described("The calendar page", media=("text/html",)),
    ("GET", "/ui/{name}"): Described("A file of the calendar page", media=tuple(sorted(set(ui.TYPES.values())))),
    # the tenant's API (docs/api.md)
    ("POST", "/api/compute/reservations/create"): Described(
        "Book GPUs of a pool for a window", schemas.CreateBody, 202, RESERVATION, idempotency_key=True),
    ("POST", "/api/compute/reservations/quote"): Described(
        "Price a create without booking it", schemas.CreateBody, answer=("quote",)),
    ("POST", "/api/compute/reservations/get"): Described("One reservation", schemas.ReservationRef, answer=RESERVATION),
    ("POST", "/api/compute/reservations/list"): Described(
        "The tenant's reservations, a page at a time", schemas.ListBody, answer=("reservations", "nextCursor")),
    ("POST", "/api/compute/reservations/release"): Described(
        "End a reservation now", schemas.ReservationRef, 202, RESERVATION),
    ("POST", "/api/compute/reservations/cancel"): Described(
        "Cancel a reservation", schemas.ReservationRef, 202, RESERVATION),
    ("POST", "/api/compute/reservations/extend"): Described(
        "Move a reservation's end later", schemas.ExtendBody, 202, ("reservation", "extended", "availableUntil")),
    ("POST", "/api/compute/reservations/renew"): Described(
        "Renew a reservation's lease", schemas.ReservationRef, answer=RESERVATION),
    ("POST", "/api/compute/events/list"): Described(
        "The tenant's reservation events after a cursor", schemas.EventsBody, answer=("events", "nextCursor")),
    ("POST", "/api/compute/operations/get"): Described("One operation", schemas.OperationRef, answer=("operation",)),
    ("POST", "/api/compute/operations/wait"): Described(
        "An operation once it is done or the timeout passed", schemas.OperationWait, answer=("operation", "done")),
    ("POST", "/api/compute/usage/list"): Described(
        "Billed usage: lines and totals", schemas.UsageBody,
        answer=("lines", "pageTotalUsd", "totalUsd", "byReservation", "nextCursor")),
    ("POST", "/api/compute/pools/list"): Described(
        "The pools the tenant owns or is offered, with their free devices over a window", pools.PoolsBody,
        answer=("pools", "now")),
    ("POST", "/api/compute/pools/get"): Described(
        "One pool the tenant owns or is offered, with its free devices over a window", pools.PoolGetBody,
        answer=("pool", "now")),
    ("POST", "/api/iam/whoami"): Described(
        "Who the caller's token speaks for: tenant, principal, kind, scope", identity.WhoamiBody,
        answer=("principal",)),
    ("POST", "/api/iam/confirmations/list"): Described(
        "Confirmations the caller requested or decides", schemas.ConfirmationList, answer=("confirmations",)),
    ("POST", "/api/iam/confirmations/get"): Described(
        "One confirmation", schemas.ConfirmationRef, answer=("confirmation",)),
    ("POST", "/api/iam/confirmations/approve"): Described(
        "Approve an agent's request (the delegating user)", schemas.ConfirmationRef, answer=("confirmation",)),
    ("POST", "/api/iam/confirmations/deny"): Described(
        "Deny an agent's request (the delegating user)", schemas.ConfirmationRef, answer=("confirmation",)),
    # the node API (docs/node-api.md)
    ("POST", "/api/nodes/register"): Described(
        "An agent registers its node", nodewire.RegisterRequest, answer=nodewire.RegisterAnswer),
    ("POST", "/api/nodes/heartbeat"): Described(
        "An agent is alive (and its inventory, when it changed)", nodewire.HeartbeatRequest,
        answer=nodewire.HeartbeatAnswer),
    ("POST", "/api/nodes/watch"): Described(
        "The node's bindings, once they differ from a resource version", nodewire.WatchRequest,
        answer=nodewire.WatchAnswer),
    ("POST", "/api/nodes/report"): Described(
        "What the agent made of its bindings", nodewire.ReportRequest, answer=nodewire.ReportAnswer),
    # the admin API (docs/admin-api.md)
    ("POST", "/api/admin/bootstrap"): Described("Apply a bootstrap document", BootstrapDoc, answer=("applied",)),
    ("POST", "/api/admin/tenants/budget"): Described(
        "Set a tenant's budget", admin.BudgetBody, answer=("tenantId", "budgetUsd")),
    ("POST", "/api/admin/nodes/release-identity"): Described(
        "Let another machine take a lost node over", admin.NodeBody, answer=("node",)),
    ("POST", "/api/admin/nodes/list"): Described(
        "Nodes with their state and bookings over a window", admin.NodeListBody, answer=("nodes", "now")),
    ("POST", "/api/admin/nodes/get"): Described(
        "One node with its bookings over a window", admin.NodeGetBody, answer=("node", "now")),
    **{("POST", f"/api/admin/nodes/{action}"): Described(f"{action.capitalize()} a node", admin.NodeActionBody,
                                                         answer=NODE_ACTED)
       for action in node_states.ACTIONS},
    ("POST", "/api/admin/pools/list"): Described("Pools with their counts", admin.Nothing, answer=("pools", "now")),
    ("POST", "/api/admin/pools/get"): Described("One pool with its counts", admin.PoolBody, answer=("pool",)),
    ("POST", "/api/admin/tenants/list"): Described(
        "Tenants with their quota, use and spend", admin.Nothing, answer=("tenants",)),
    ("POST", "/api/admin/tenants/get"): Described("One tenant", admin.TenantBody, answer=("tenant",)),
    ("POST", "/api/admin/events/list"): Described(
        "The fleet's events after a cursor", schemas.EventsPage, answer=("events", "nextCursor")),
}

SECURITY_SCHEMES = {
    "tenantToken": {"type": "http", "scheme": "bearer", "description":
                    "a tenant principal's token (bootstrap principals[].token); one with scope read calls no mutation"},
    "nodeToken": {"type": "http", "scheme": "bearer", "description":
                  "register: the pool's bootstrap token (bootstrap nodeTokens[].token); the other calls: the node "
                  "token register answered"},
    "adminToken": {"type": "http", "scheme": "bearer", "description":
                   "the bootstrap file's adminToken, or an operator principal's token (bootstrap, tenants/budget and "
                   "/metrics: the adminToken only)"},
}


def security_of(path: str) -> list[dict[str, list]]:
    """Who may call path, as the middleware and the handlers decide it; no requirement: public."""
    from controlplane.api.app import TENANT_PATHS  # app.py imports this module

    callers = [*((prefix, "tenantToken") for prefix in TENANT_PATHS), ("/api/nodes/", "nodeToken"),
               ("/api/admin/", "adminToken"), ("/metrics", "adminToken")]
    return [{scheme: []} for prefix, scheme in callers if path.startswith(prefix)][:1]


def served(router: web.UrlDispatcher) -> list[tuple[str, str]]:
    """(method, path) of every route but HEAD: aiohttp adds one to each GET, which HTTP defines as GET less the body."""
    return [(route.method, route.resource.canonical) for route in router.routes()
            if route.method != "HEAD" and route.resource is not None]


def check_described(routes: list[tuple[str, str]]) -> None:
    """LookupError naming each route DESCRIBED lacks and each description no route serves."""
    missing = [f"{m} {p}" for m, p in routes if (m, p) not in DESCRIBED]
    stale = [f"{m} {p}" for m, p in DESCRIBED if (m, p) not in set(routes)]
    if missing or stale:
        raise LookupError("controlplane/api/openapi.py DESCRIBED must describe exactly the routes served: "
                          f"not described: {', '.join(missing) or 'none'}; described, not served: "
                          f"{', '.join(stale) or 'none'}")


# ---- refusals ----------------------------------------------------------------------------------


def refusal_statuses() -> dict[int, list[tuple[str, str]]]:
    """Each status a refusal may have, with its (code, meaning)s: the table's, and aiohttp's refusals of a body."""
    by_status: dict[int, list[tuple[str, str]]] = {}
    for row in error_table.TABLE:
        by_status.setdefault(row.status, []).append((row.code, row.meaning))
    for status, field in BODY_FIELDS.items():
        by_status.setdefault(status, []).append(
            (HTTP_CODES[status], f"{http.HTTPStatus(status).phrase}; details.field is {field}"))
    return dict(sorted(by_status.items()))


def refused_name(status: int) -> str:
    return f"Refused{status}"


def refusal_response(status: int, codes: list[tuple[str, str]], envelope: dict) -> dict:
    """components.responses entry: the envelope, its code narrowed to this status's codes, each named and explained."""
    response: dict[str, Any] = {
        "description": "; ".join(f"{code}: {meaning}" for code, meaning in codes),
        "content": {JSON: {"schema": {**envelope, "properties": {"error": {"properties": {
            "code": {"enum": [code for code, _ in codes]}}}}}}},
    }
    if status == error_table.STATUS[e.PROVIDER_UNAVAILABLE]:
        response["headers"] = {"Retry-After": {"description": "seconds to wait before retrying with the same key",
                                               "schema": {"type": "integer", "minimum": 0}}}
    return response


def refusals_of(described: Described, secured: bool, templated: bool) -> list[int]:
    """The statuses an operation may refuse with: every one for a body (any code may refuse a request), else only
    what needs no body: a failure, a missing token where one is needed, a path that names nothing."""
    if described.body is not None:
        return list(refusal_statuses())
    codes = [e.PROVIDER_UNAVAILABLE, *([e.UNAUTHENTICATED] if secured else []), *([e.NOT_FOUND] if templated else []),
             *described.refuses]
    return sorted(error_table.STATUS[code] for code in codes)


# ---- operations --------------------------------------------------------------------------------


def operation_id(method: str, path: str) -> str:
    """`post_compute_reservations_create`; a trailing slash reads as `_index` (`/ui` and `/ui/` differ)."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", path.removeprefix("/api/")).strip("_") or "root"
    return f"{method.lower()}_{name}{'_index' if path.endswith('/') else ''}"


def tag_of(path: str) -> str:
    """The API a path belongs to: compute, iam, nodes, admin; or its first segment (healthz, metrics, ui, api)."""
    parts = path.strip("/").split("/")
    return parts[1] if parts[0] == "api" and len(parts) > 2 else parts[0]


def success(described: Described, refs: dict[type, dict], why: str = "") -> dict:
    """The answer with described.status; with why (an `also` status's reason) as its description, another's."""
    response: dict[str, Any] = {"description": why or http.HTTPStatus(described.status).phrase}
    if not described.media:
        response["headers"] = {"Location": {"schema": {"type": "string"}}}
        return response
    if isinstance(described.answer, type):
        schema = refs[described.answer]
    else:
        schema = {"type": "object", "required": list(described.answer), "properties": {k: {} for k in described.answer}}
    response["content"] = {media: {"schema": schema if media == JSON else {"type": "string"}}
                           for media in described.media}
    return response


def operation(method: str, path: str, described: Described, refs: dict[type, dict]) -> dict:
    security = security_of(path)
    parameters: list[dict] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                              for name in re.findall(r"\{([^}:]+)", path)]
    if described.idempotency_key:
        parameters.append({"$ref": "#/components/parameters/IdempotencyKey"})
    if security == [{"nodeToken": []}] and path != "/api/nodes/register":
        parameters.append({"$ref": "#/components/parameters/MachineId"})
    op: dict[str, Any] = {"operationId": operation_id(method, path), "summary": described.summary,
                          "tags": [tag_of(path)], "security": security}
    if parameters:
        op["parameters"] = parameters
    if described.body is not None:
        required = any(f.required for f in msgspec.structs.fields(described.body))  # else an empty body reads as {}
        op["requestBody"] = {"required": required, "content": {JSON: {"schema": refs[described.body]}}}
    op["responses"] = {
        str(described.status): success(described, refs),
        **{str(status): {"$ref": f"#/components/responses/{refused_name(status)}"}
           for status in refusals_of(described, bool(security), "{" in path)},
        **{str(status): success(described, refs, why) for status, why in described.also},  # its own, not a refusal
    }
    return op


def document(router: web.UrlDispatcher) -> dict:
    """The OpenAPI 3.1 document of the routes router serves (LookupError when DESCRIBED does not match them)."""
    routes = served(router)
    check_described(routes)
    structs = list(dict.fromkeys([ErrorEnvelope, *(s for d in DESCRIBED.values()
                                                  for s in (d.body, d.answer) if isinstance(s, type))]))
    refs, components = msgspec.json.schema_components(structs, ref_template=REF)
    by_struct = dict(zip(structs, refs))
    paths: dict[str, dict] = {}
    for method, path in routes:
        paths.setdefault(path, {})[method.lower()] = operation(method, path, DESCRIBED[(method, path)], by_struct)
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "Berth", "version": VERSION,
                 "summary": "GPU reservations: the tenant's, the agents' and the operator's API",
                 "description": "Generated from the routes the control plane serves and the msgspec schemas that "
                                "validate their bodies (controlplane/api/openapi.py); see docs/api.md."},
        "paths": paths,
        "components": {
            "schemas": components,
            "responses": {refused_name(status): refusal_response(status, codes, by_struct[ErrorEnvelope])
                          for status, codes in refusal_statuses().items()},
            "parameters": {"IdempotencyKey": {
                "name": "Idempotency-Key", "in": "header", "required": False,
                "schema": msgspec.json.schema(schemas.Key),
                "description": "printable ASCII; the same as the body's idempotencyKey when both are given"},
                "MachineId": {
                "name": nodewire.MACHINE_ID_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
                "description": "the agent's host (/etc/machine-id), as register named it: the node token from "
                               "another host is refused, 409 CONFLICT (details.field: this header, rule: machine_id)"}},
            "securitySchemes": SECURITY_SCHEMES,
        },
    }
    return msgspec.json.decode(msgspec.json.encode(doc))  # JSON's own values: a default of () reads as []


# ---- serving -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Cached:
    """The encoded document, built at the first request for it (most apps, tests among them, never serve it)."""

    encoded: bytes | None = None


DOCUMENT = web.AppKey("openapi_document", Cached)


async def check(app: web.Application) -> None:
    """on_startup, once every route is added: an undescribed route stops the app, naming itself."""
    check_described(served(app.router))


async def serve(request: web.Request) -> web.Response:
    cached = request.app[DOCUMENT]
    if cached.encoded is None:
        cached.encoded = msgspec.json.encode(document(request.app.router))
    return web.Response(body=cached.encoded, content_type=JSON)


def setup(app: web.Application) -> None:
    """Serve the document at PATH, without a token, from app's own router."""
    app[DOCUMENT] = Cached()
    app.router.add_get(PATH, serve)
    app.on_startup.append(check)
