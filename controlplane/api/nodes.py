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
from common.nodewire import MACHINE_ID_HEADER, HeartbeatRequest, RegisterRequest, ReportRequest, WatchRequest
from controlplane.domain.model import Node

NODES = web.AppKey("nodes", NodeService)


async def register(request: web.Request) -> web.Response:
    service = request.app[NODES]
    pool = service.pool_of_bootstrap(bearer(request))
    body = await read_json(request, RegisterRequest)
    return json_response(await service.register(pool, body.hostname, body.inventory, body.agentVersion,
                                                body.machineId))


def _node(request: web.Request) -> Node:
    """The node the call's token speaks for, if the call comes from the host it was issued to."""
    return request.app[NODES].node_of_token(bearer(request), request.headers.get(MACHINE_ID_HEADER, ""))


async def heartbeat(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = _node(request)
    body = await read_json(request, HeartbeatRequest)
    return json_response(await service.heartbeat(node, body.inventory, body.agentVersion))


async def watch(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = _node(request)
    body = await read_json(request, WatchRequest)
    return json_response(await service.watch(node, body.resourceVersion, body.timeoutMs))


async def report(request: web.Request) -> web.Response:
    service = request.app[NODES]
    node = _node(request)
    body = await read_json(request, ReportRequest)
    return json_response(await service.report(node, body.reports))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/api/nodes/register", register),
        web.post("/api/nodes/heartbeat", heartbeat),
        web.post("/api/nodes/watch", watch),
        web.post("/api/nodes/report", report),
    ]
