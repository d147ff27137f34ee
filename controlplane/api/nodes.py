"""HTTP handlers of the node API (docs/node-api.md): register, heartbeat, watch, report.

Each call authenticates with a node token (register: a pool bootstrap
token) and never with a tenant's; a node token speaks only for its node.
"""
from __future__ import annotations

from aiohttp import web

from controlplane.api.auth import bearer
from controlplane.api.body import read_json
from controlplane.api.errors import json_response
from controlplane.nodes import NodeService
from common.nodewire import HeartbeatRequest, RegisterRequest, ReportRequest, WatchRequest

NODES = web.AppKey("nodes", NodeService)


async def register(request: web.Request) -> web.Response:
    service = request.app[NODES]
    pool = service.pool_of_bootstrap(bearer(request))
    body = await read_json(request, RegisterRequest)
    return json_response(await service.register(pool, body.hostname, body.inventory, body.agentVersion,
                                                body.machineId))


async def heartbeat(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = service.node_of_token(bearer(request))
    body = await read_json(request, HeartbeatRequest)
    return json_response(await service.heartbeat(node, body.inventory))


async def watch(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = service.node_of_token(bearer(request))
    body = await read_json(request, WatchRequest)
    return json_response(await service.watch(node, body.resourceVersion, body.timeoutMs))


async def report(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = service.node_of_token(bearer(request))
    body = await read_json(request, ReportRequest)
    return json_response(await service.report(node, body.reports))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/api/nodes/register", register),
        web.post("/api/nodes/heartbeat", heartbeat),
        web.post("/api/nodes/watch", watch),
        web.post("/api/nodes/report", report),
    ]
