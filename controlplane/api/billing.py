"""HTTP handlers of operations, quotes and usage: `/api/compute/operations/*`, `reservations/quote`, `usage/list`.

Reads and the quote answer 200.
"""
from __future__ import annotations

from decimal import Decimal

from aiohttp import web

from controlplane import schemas
from controlplane.api.body import read_json
from controlplane.api.errors import json_response
from controlplane.api.reservations import SERVICE as RESERVATIONS
from controlplane.billing import Billing
from controlplane.domain.errors import DomainError, INVALID_INPUT, invalid
from controlplane.domain.pricing import money
from controlplane.operations import OperationService

OPERATIONS = web.AppKey("operations", OperationService)
BILLING = web.AppKey("billing", Billing)


async def operation_get(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.OperationRef)
    op, node_count = await request.app[OPERATIONS].get(request["principal"], body.operationId)
    return json_response({"operation": schemas.operation_to_wire(op, node_count)})


async def operation_wait(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.OperationWait)
    op, node_count = await request.app[OPERATIONS].wait(request["principal"], body.operationId, body.timeoutMs)
    return json_response({"operation": schemas.operation_to_wire(op, node_count),
                          "done": op.status in ("succeeded", "failed", "cancelled")})


async def quote(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.CreateBody)
    command = schemas.create_command(body, None)
    return json_response({"quote": await request.app[RESERVATIONS].quote(request["principal"], command)})


async def usage(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.UsageBody)
    if body.since is not None and body.until is not None and body.until <= body.since:  # an empty range by mistake
        raise invalid("until", "must be after since (the days listed start at or after since and before until)")
    principal = request["principal"]
    service = request.app[RESERVATIONS]
    await service.authorize_tenant_read(principal)
    if body.reservationId is not None:
        await service.get(principal, body.reservationId)
    lines = request.app[BILLING].lines(principal.tenant_id, body.reservationId, body.since, body.until)
    start = 0
    if body.cursor is not None:
        keys = [line.key for line in lines]
        if body.cursor not in keys:
            raise DomainError(INVALID_INPUT, "cursor: not a line of this usage", {"field": "cursor", "rule": "must be a nextCursor"})
        start = keys.index(body.cursor) + 1
    page = lines[start:start + body.limit]
    more = start + body.limit < len(lines)
    per_reservation: dict[str, Decimal] = {}
    for line in lines:
        per_reservation[line.reservation_id] = per_reservation.get(line.reservation_id, Decimal(0)) + line.amount_usd
    return json_response({
        "lines": [line.to_wire() for line in page],
        "pageTotalUsd": money(sum((line.amount_usd for line in page), Decimal(0))),
        "totalUsd": money(sum((line.amount_usd for line in lines), Decimal(0))),
        "byReservation": [{"reservationId": rid, "totalUsd": money(total)} for rid, total in sorted(per_reservation.items())],
        "nextCursor": page[-1].key if more and page else None,
    })


def routes() -> list[web.RouteDef]:
    return [
        web.post("/api/compute/operations/get", operation_get),
        web.post("/api/compute/operations/wait", operation_wait),
        web.post("/api/compute/reservations/quote", quote),
        web.post("/api/compute/usage/list", usage),
    ]
