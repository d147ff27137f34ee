"""The admin API: the operator's calls, with the bootstrap file's `adminToken` or an operator principal's token.

Apply a bootstrap document at run time and set a tenant's budget (the admin
token only: they rewrite who may do what); and, decided by IAM for an
operator (every one allowed for the admin token): nodes (list, get, cordon,
uncordon, drain, clear, release-identity), pools and tenants (list, get) and
the fleet's events. The request bodies and the answers' shapes are defined
here, once (docs/admin-api.md).
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from common.times import iso
from controlplane import schemas
from controlplane.api.auth import admin_of, operator_of
from controlplane.api.body import read_checked, read_json
from controlplane.api.errors import json_response
from controlplane.domain import node_states
from controlplane.domain.errors import invalid
from common.money import parse_money
from controlplane.domain.pricing import money
from controlplane.domain.quota import wire_amount, wire_key
from controlplane.fleet import ActionResult, BookingView, Count, NodeView, PoolView, TenantView, window_of

# ---- request bodies -----------------------------------------------------------------------------

NodeState = Literal["ready", "cordoned", "draining", "cleaning", "maintenance", "lost"]
assert set(NodeState.__args__) == set(node_states.SHOWN)  # type: ignore[attr-defined]
Reason = Annotated[str, Meta(min_length=1, max_length=200)]


class BudgetBody(Struct, forbid_unknown_fields=True):
    tenantId: schemas.Id
    budgetUsd: Annotated[str, Meta(min_length=1, max_length=32)]


class NodeBody(Struct, forbid_unknown_fields=True):
    nodeId: schemas.Id


class NodeListBody(Struct, forbid_unknown_fields=True):
    poolId: schemas.Id | None = None
    state: NodeState | None = None
    start: schemas.EpochMs | None = msgspec.field(default=None, name="from")  # bookings shown: default now
    until: schemas.EpochMs | None = None  # default 7 days after from, at most 62


class NodeGetBody(Struct, forbid_unknown_fields=True):
    nodeId: schemas.Id
    start: schemas.EpochMs | None = msgspec.field(default=None, name="from")
    until: schemas.EpochMs | None = None


class NodeActionBody(Struct, forbid_unknown_fields=True):
    nodeId: schemas.Id
    reason: Reason | None = None  # recorded in the event and the log


class PoolBody(Struct, forbid_unknown_fields=True):
    poolId: schemas.Id


class TenantBody(Struct, forbid_unknown_fields=True):
    tenantId: schemas.Id


class Nothing(Struct, forbid_unknown_fields=True):
    """A list of everything the caller may read: no fields."""


# ---- answers ------------------------------------------------------------------------------------

def booking_to_wire(b: BookingView, now: int) -> dict:
    return {"reservationId": b.reservation_id, "tenantId": b.tenant_id, "state": b.state, "binding": b.binding,
            "spot": b.spot, "carriedOn": b.carried_on, "start": b.start, "end": b.end, "devices": list(b.units),
            "gpus": list(b.gpus), "current": b.covers(now)}


def node_to_wire(v: NodeView, now: int) -> dict:
    n = v.node
    migs: dict[str, int] = {}
    for u in n.units:
        if u.mig_profile:
            migs[u.mig_profile] = migs.get(u.mig_profile, 0) + 1
    return {
        "id": n.id, "poolId": n.pool_id, "hostname": n.hostname,
        "state": v.state, "adminState": n.state, "stateReason": n.state_reason, "lost": v.lost,
        "placeable": n.placeable, "conditions": node_conditions(v),
        "declared": n.declared, "agentVersion": v.agent_version or None,
        "lastHeartbeat": iso(v.heartbeat.at) if v.heartbeat else None,
        "heartbeatAgeSeconds": round(v.heartbeat.age_s, 3) if v.heartbeat else None,
        "inventory": {"gpus": n.gpu_count, "gpuIndices": sorted({u.gpu_index for u in n.units}),
                      "units": len(n.units), "migProfiles": migs, **n.capacity.to_wire()},
        "machineId": n.machine_id, "identityReleased": n.identity_released,
        "drained": v.drained,
        "bookings": [booking_to_wire(b, now) for b in v.bookings],
    }


def node_conditions(v: NodeView) -> list[dict]:
    """Berth's node conditions: KubernetesReleaseStuck while pods hold the devices of a released booking past its
    window (the node's Kubernetes Node carries a NoSchedule taint of that name meanwhile)."""
    if not v.stuck:
        return []
    return [{"type": "KubernetesReleaseStuck", "status": "True", "reservations": list(v.stuck),
             "message": f"pods still hold the devices of released {', '.join(v.stuck)}: carried on in 5-minute "
                        "steps, unbilled, for at most 24 h; then the node goes to maintenance"}]


def action_to_wire(r: ActionResult, now: int) -> dict:
    return {"node": node_to_wire(r.node, now), "changed": r.changed,
            "moved": [{"reservationId": m.reservation_id, "tenantId": m.tenant_id, "fromNodes": list(m.from_nodes),
                       "nodes": list(m.to_nodes)} for m in r.moved],
            "pending": list(r.pending)}


def _count(c: Count) -> dict:
    return {"total": c.total, "booked": c.booked, "free": c.free}


def pool_to_wire(v: PoolView) -> dict:
    p = v.pool
    return {"id": p.id, "owner": p.owner, "region": p.region, "gpuModel": p.gpu_model, "sharing": p.sharing,
            "pricePerGpuHourUsd": money(p.price_per_gpu_hour), "archived": p.archived, "placer": p.policy.placer,
            "nodes": dict(v.nodes), "gpus": _count(v.gpus), "units": _count(v.units), "pending": v.pending}


def _amounts(rows) -> dict:
    return {wire_key(k): wire_amount(k, amount) for k, amount in sorted(rows.items())}


def tenant_to_wire(v: TenantView) -> dict:
    t = v.tenant
    return {"id": t.id, "quota": _amounts(v.limits), "used": _amounts(v.used),
            "budgetUsd": money(t.budget_usd) if t.budget_usd is not None else None,
            "spentUsd": money(v.spent_usd), "committedUsd": money(v.committed_usd),
            "reservations": dict(v.reservations)}


# ---- handlers -----------------------------------------------------------------------------------

def _plane(request: web.Request):
    from controlplane.api.app import CONTROL_PLANE

    return request.app[CONTROL_PLANE]


def _admin(request: web.Request):
    """The admin token only (bootstrap and budgets rewrite who may do what)."""
    cp = _plane(request)
    admin_of(request, cp.tokens, cp.catalog.current.principals)
    return cp


def _operator(request: web.Request):
    """(the control plane, the caller: None for the admin token, else an operator principal)."""
    cp = _plane(request)
    return cp, operator_of(request, cp.tokens, cp.catalog.current.principals)


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
    cp, actor = _operator(request)
    body = await read_json(request, NodeBody)
    node = await cp.fleet.release_identity(actor, body.nodeId)
    return json_response({"node": {"id": node.id, "poolId": node.pool_id, "hostname": node.hostname,
                                   "machineId": node.machine_id, "identityReleased": node.identity_released}})


async def list_nodes(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    body = await read_json(request, NodeListBody)
    now = cp.clock.compute_now()
    views = await cp.fleet.list_nodes(actor, window_of(now, body.start, body.until), body.poolId, body.state)
    return json_response({"nodes": [node_to_wire(v, now) for v in views], "now": now})


async def get_node(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    body = await read_json(request, NodeGetBody)
    now = cp.clock.compute_now()
    view = await cp.fleet.get_node(actor, body.nodeId, window_of(now, body.start, body.until))
    return json_response({"node": node_to_wire(view, now), "now": now})


def _node_action(action: str):
    async def handle(request: web.Request) -> web.Response:
        cp, actor = _operator(request)
        body = await read_json(request, NodeActionBody)
        result = await cp.fleet.act(actor, body.nodeId, action, body.reason)
        return json_response(action_to_wire(result, cp.clock.compute_now()))

    handle.__name__ = f"{action}_node"
    return handle


async def list_pools(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    await read_json(request, Nothing)
    return json_response({"pools": [pool_to_wire(v) for v in await cp.fleet.list_pools(actor)],
                          "now": cp.clock.compute_now()})


async def get_pool(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    body = await read_json(request, PoolBody)
    return json_response({"pool": pool_to_wire(await cp.fleet.get_pool(actor, body.poolId))})


async def list_tenants(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    await read_json(request, Nothing)
    return json_response({"tenants": [tenant_to_wire(v) for v in await cp.fleet.list_tenants(actor)]})


async def get_tenant(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    body = await read_json(request, TenantBody)
    return json_response({"tenant": tenant_to_wire(await cp.fleet.get_tenant(actor, body.tenantId))})


async def list_events(request: web.Request) -> web.Response:
    cp, actor = _operator(request)
    body = await read_json(request, schemas.EventsPage)
    rows, cursor = await cp.fleet.events(actor, body.after, body.limit)
    return json_response({"events": rows, "nextCursor": cursor})


def routes() -> list[web.RouteDef]:
    base = "/api/admin/"
    return [
        web.post(base + "bootstrap", apply_bootstrap), web.post(base + "tenants/budget", set_budget),
        web.post(base + "nodes/release-identity", release_node_identity),
        web.post(base + "nodes/list", list_nodes), web.post(base + "nodes/get", get_node),
        *[web.post(base + f"nodes/{action}", _node_action(action)) for action in node_states.ACTIONS],
        web.post(base + "pools/list", list_pools), web.post(base + "pools/get", get_pool),
        web.post(base + "tenants/list", list_tenants), web.post(base + "tenants/get", get_tenant),
        web.post(base + "events/list", list_events),
    ]
