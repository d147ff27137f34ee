"""The admin API (the bootstrap file's `adminToken`): apply a bootstrap document at run time, set a tenant's budget,
release a node's identity (so that a replaced host may register it)."""
from __future__ import annotations

from typing import Annotated

from aiohttp import web
from msgspec import Meta, Struct

from controlplane import schemas
from controlplane.api.auth import bearer
from controlplane.api.body import read_checked, read_json
from controlplane.api.errors import json_response
from controlplane.domain.errors import UNAUTHENTICATED, DomainError, invalid
from controlplane.domain.pricing import money, parse_money


class BudgetBody(Struct, forbid_unknown_fields=True):
    tenantId: schemas.Id
    budgetUsd: Annotated[str, Meta(min_length=1, max_length=32)]


class NodeBody(Struct, forbid_unknown_fields=True):
    nodeId: schemas.Id


def _admin(request: web.Request):
    from controlplane.api.app import CONTROL_PLANE

    cp = request.app[CONTROL_PLANE]
    found = cp.tokens.resolve(bearer(request))
    if found is None or found[0] != "admin":
        raise DomainError(UNAUTHENTICATED, "Authorization: not the admin token (the bootstrap file's adminToken)",
                          {"field": "Authorization"})
    return cp


async def apply_bootstrap(request: web.Request) -> web.Response:
    cp = _admin(request)
    return json_response({"applied": await cp.apply_bootstrap_doc(await read_checked(request))})


async def set_budget(request: web.Request) -> web.Response:
    cp = _admin(request)
    body = await read_json(request, BudgetBody)
    amount = parse_money(body.budgetUsd)
    if amount is None:
        raise invalid("budgetUsd", "must be a non-negative decimal string with at most six decimals, below 10^12")
    await cp.set_budget(body.tenantId, amount)
    return json_response({"tenantId": body.tenantId, "budgetUsd": money(amount)})


async def release_node_identity(request: web.Request) -> web.Response:
    cp = _admin(request)
    body = await read_json(request, NodeBody)
    node = await cp.nodes.release_identity(body.nodeId)
    return json_response({"node": {"id": node.id, "poolId": node.pool_id, "hostname": node.hostname,
                                   "machineId": node.machine_id, "identityReleased": node.identity_released}})


def routes() -> list[web.RouteDef]:
    return [web.post("/api/admin/bootstrap", apply_bootstrap), web.post("/api/admin/tenants/budget", set_budget),
            web.post("/api/admin/nodes/release-identity", release_node_identity)]
