"""HTTP handlers of the node API (docs/node-api.md): register, heartbeat, watch, report.

Each call authenticates with a node token (register: a pool bootstrap
token) and never with a tenant's; a node token speaks only for its node.
"""
from __future__ import annotations

import msgspec
from aiohttp import web

from controlplane import schemas
from controlplane.api.auth import bearer
from controlplane.api.errors import json_response
from controlplane.nodes import NodeService

NODES = web.AppKey("nodes", NodeService)


async def register(request: web.Request) -> web.Response:
    service = request.app[NODES]
    pool = service.pool_of_bootstrap(bearer(request))
    body = schemas.decode(await request.read(), schemas.RegisterBody)
    return json_response(await service.register(pool, body.hostname, msgspec.to_builtins(body.inventory)))


async def heartbeat(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = service.node_of_token(bearer(request))
    body = schemas.decode(await request.read(), schemas.HeartbeatBody)
    raw = msgspec.to_builtins(body)
    return json_response(await service.heartbeat(node, {k: v for k, v in raw.items() if v is not None}))


async def watch(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = service.node_of_token(bearer(request))
    body = schemas.decode(await request.read(), schemas.WatchBody)
    return json_response(await service.watch(node, body.resourceVersion, body.timeoutMs))


async def report(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = service.node_of_token(bearer(request))
    body = schemas.decode(await request.read(), schemas.ReportBody)
    return json_response(await service.report(node, [msgspec.to_builtins(r) for r in body.reports]))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/api/nodes/register", register),
        web.post("/api/nodes/heartbeat", heartbeat),
        web.post("/api/nodes/watch", watch),
        web.post("/api/nodes/report", report),
    ]
