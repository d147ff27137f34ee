"""The tenant's pools: `POST /api/compute/pools/list` and `/get`, the pools it owns or is offered: what can be booked
there (model, sharing, MIG profiles or slots, binding kinds, price, the per-GPU share, node sizes) and its free
devices over a window, now and at each change (counts only; no other tenant's booking is named). Decided as reading
the tenant, like usage and events."""
from __future__ import annotations

from aiohttp import web
from msgspec import Struct, field

from controlplane import schemas
from controlplane.api.body import read_json
from controlplane.api.errors import json_response
from controlplane.domain.errors import not_found
from controlplane.domain.pricing import money
from controlplane.fleet import OfferedPool, window_of


class PoolsBody(Struct, forbid_unknown_fields=True):
    start: schemas.EpochMs | None = field(default=None, name="from")  # default now
    until: schemas.EpochMs | None = None  # default 7 days after from, at most 62


class PoolGetBody(Struct, forbid_unknown_fields=True):
    poolId: schemas.Id
    start: schemas.EpochMs | None = field(default=None, name="from")
    until: schemas.EpochMs | None = None


def offered_to_wire(o: OfferedPool) -> dict:
    p = o.pool
    free = [{"at": s.at, "units": s.units} for s in o.free]
    return {"id": p.id, "region": p.region, "gpuModel": p.gpu_model, "sharing": p.sharing,
            "owned": o.owned, "bindings": list(o.bindings),
            "migProfiles": [{"profile": name, "units": n} for name, n in o.profiles] if p.sharing == "mig" else None,
            "slotsPerGpu": p.policy.slots_per_gpu if p.sharing == "slots" else None,
            "pricePerGpuHourUsd": money(p.price_per_gpu_hour),
            "perGpu": o.per_gpu.to_wire() if p.sharing == "exclusive" else None,
            "nodes": sum(n for _, n in o.node_shapes),
            "nodeSizes": [{"gpus": gpus, "nodes": n} for gpus, n in o.node_shapes],
            "units": o.units, "freeNow": free[0]["units"], "nextChange": free[1] if len(free) > 1 else None,
            "free": free,
            # node bindings: the account to log in to, how the node is cleaned after, how long that keeps it
            "tenantRoot": {"user": p.policy.root_user, "cleaning": p.policy.cleaning,
                           "turnaroundMinutes": p.policy.turnaround_ms // 60_000} if p.policy.tenant_root else None}


async def _offered(request: web.Request, body: PoolsBody | PoolGetBody) -> tuple[list[OfferedPool], int]:
    from controlplane.api.app import CONTROL_PLANE

    cp = request.app[CONTROL_PLANE]
    principal = request["principal"]
    await cp.reservations.authorize_tenant_read(principal)
    now = cp.clock.compute_now()
    return cp.fleet.offered_pools(principal.tenant_id, window_of(now, body.start, body.until)), now


async def list_pools(request: web.Request) -> web.Response:
    pools, now = await _offered(request, await read_json(request, PoolsBody))
    return json_response({"pools": [offered_to_wire(o) for o in pools], "now": now})


async def get_pool(request: web.Request) -> web.Response:
    body = await read_json(request, PoolGetBody)
    pools, now = await _offered(request, body)
    found = next((o for o in pools if o.pool.id == body.poolId), None)
    if found is None:  # not there, or neither owned nor offered: the same answer, naming no other tenant's pool
        raise not_found("pool", body.poolId, field="poolId")
    return json_response({"pool": offered_to_wire(found), "now": now})


def routes() -> list[web.RouteDef]:
    return [web.post("/api/compute/pools/list", list_pools), web.post("/api/compute/pools/get", get_pool)]
