"""HTTP handlers of `/api/iam/confirmations/*`: list, get, approve, deny (approve and deny by the delegating user only)."""
from __future__ import annotations

from aiohttp import web

from controlplane import confirmations, schemas
from controlplane.api.body import read_json
from controlplane.api.errors import json_response
from controlplane.confirmations import ConfirmationService

SERVICE = web.AppKey("confirmations", ConfirmationService)


async def list_(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ConfirmationList)
    rows = request.app[SERVICE].list(request["principal"], body.status, body.limit)
    return json_response({"confirmations": [confirmations.to_wire(c) for c in rows]})


async def get(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ConfirmationRef)
    return json_response({"confirmation": confirmations.to_wire(request.app[SERVICE].get(request["principal"], body.confirmationId))})


async def approve(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ConfirmationRef)
    conf = await request.app[SERVICE].decide(request["principal"], body.confirmationId, approve=True)
    return json_response({"confirmation": confirmations.to_wire(conf)})


async def deny(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ConfirmationRef)
    conf = await request.app[SERVICE].decide(request["principal"], body.confirmationId, approve=False)
    return json_response({"confirmation": confirmations.to_wire(conf)})


def routes() -> list[web.RouteDef]:
    base = "/api/iam/confirmations/"
    return [web.post(base + "list", list_), web.post(base + "get", get),
            web.post(base + "approve", approve), web.post(base + "deny", deny)]
