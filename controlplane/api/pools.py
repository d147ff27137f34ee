"""The tenant's pools: `POST /api/compute/pools/list`, the pools it owns or is offered with their free devices over a
window (counts only; no other tenant's booking is named). Decided as reading the tenant, like usage and events."""
from __future__ import annotations

from aiohttp import web
from msgspec import Struct, field

from controlplane import schemas
from controlplane.api.body import read_json
from controlplane.api.errors import json_response
from controlplane.domain.pricing import money
from controlplane.fleet import OfferedPool, window_of


class PoolsBody(Struct, forbid_unknown_fields=True):
    start: schemas.EpochMs | None = field(default=None, name="from")  # default now
    until: schemas.EpochMs | None = None  # default 7 days after from, at most 62


def offered_to_wire(o: OfferedPool) -> dict:
    p = o.pool
    return {"id": p.id, "region": p.region, "gpuModel": p.gpu_model, "sharing": p.sharing,
            "pricePerGpuHourUsd": money(p.price_per_gpu_hour), "units": o.units,
            "free": [{"at": s.at, "units": s.units} for s in o.free]}


async def list_pools(request: web.Request) -> web.Response:
    from controlplane.api.app import CONTROL_PLANE

    cp = request.app[CONTROL_PLANE]
    body = await read_json(request, PoolsBody)
    principal = request["principal"]
    await cp.reservations.authorize_tenant_read(principal)
    now = cp.clock.compute_now()
    pools = cp.fleet.offered_pools(principal.tenant_id, window_of(now, body.start, body.until))
    return json_response({"pools": [offered_to_wire(o) for o in pools], "now": now})


def routes() -> list[web.RouteDef]:
    return [web.post("/api/compute/pools/list", list_pools)]
