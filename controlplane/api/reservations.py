"""HTTP handlers of the reservations API: parse and validate, call one service method, answer.

create, release, cancel and extend change infrastructure: they answer 202
Accepted with the reservation and the operation of that change, which runs
until the nodes confirm it (a create until the devices are ready); get, list,
renew and events answer 200.
"""
from __future__ import annotations

import time
from dataclasses import replace

from aiohttp import web

from controlplane import schemas
from controlplane.api.body import read_json
from controlplane.api.errors import HTTP_CODES, json_response
from controlplane.domain.errors import INVALID_INPUT, PROVIDER_UNAVAILABLE, DomainError, invalid
from controlplane.metrics import ControlPlaneMetrics
from controlplane.reservations import Answer, ReservationService

SERVICE = web.AppKey("reservations", ReservationService)
METRICS = web.AppKey("metrics", ControlPlaneMetrics)


def _one(answer: Answer, status: int = 200) -> web.Response:
    body = {"reservation": schemas.reservation_to_wire(answer.reservation, answer.operation)}
    if answer.extended is not None:
        body["extended"] = answer.extended
        body["availableUntil"] = answer.available_until
        if answer.not_extended:
            body["reason"] = answer.not_extended
    return json_response(body, status)


async def create(request: web.Request) -> web.Response:
    started, service = time.perf_counter(), request.app[SERVICE]

    def created(outcome: str) -> None:
        if METRICS in request.app:
            request.app[METRICS].created(outcome, time.perf_counter() - started)

    try:
        body = await read_json(request, schemas.CreateBody)
        keys = request.headers.getall("Idempotency-Key", [])
        if len(keys) > 1:  # which one a proxy or a server reads differs: refused rather than guessed (as Authorization)
            raise DomainError(INVALID_INPUT, "Idempotency-Key: send one header, not several",
                              {"field": "Idempotency-Key", "rule": "one header"})
        command = schemas.create_command(body, keys[0] if keys else None)
        # the wait is held below, after the create is counted (a replace only where one was asked: the hot path)
        answer = await service.create(request["principal"], replace(command, wait_ms=0) if command.wait_ms else command)
    except DomainError as exc:
        created(exc.code)
        raise
    except web.HTTPException as exc:  # aiohttp's own refusals (408, 413, 415) leave with the code they carry
        created(HTTP_CODES.get(exc.status, INVALID_INPUT))
        raise
    except Exception:  # answered PROVIDER_UNAVAILABLE at the edge (api/errors.py)
        created(PROVIDER_UNAVAILABLE)
        raise
    created(answer.reservation.state)  # before a requested wait.timeoutMs: that is the client's time, not ours
    return _one(await service.wait_while_pending(answer, command.wait_ms), 202)


async def get(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ReservationRef)
    return _one(await request.app[SERVICE].get(request["principal"], body.reservationId))


async def list_(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ListBody)
    answers, cursor = await request.app[SERVICE].list(request["principal"], schemas.list_query(body))
    return json_response({
        "reservations": [schemas.reservation_to_wire(a.reservation, a.operation) for a in answers],
        "nextCursor": cursor,
    })


async def release(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ReservationRef)
    return _one(await request.app[SERVICE].release(request["principal"], body.reservationId), 202)


async def cancel(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ReservationRef)
    return _one(await request.app[SERVICE].cancel(request["principal"], body.reservationId), 202)


async def extend(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ExtendBody)
    return _one(await request.app[SERVICE].extend(request["principal"], schemas.extend_command(body)), 202)


async def renew(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.ReservationRef)
    return _one(await request.app[SERVICE].renew(request["principal"], body.reservationId))


async def events(request: web.Request) -> web.Response:
    body = await read_json(request, schemas.EventsBody)
    if body.fromEnd:
        if body.after is not None or body.waitMs:
            raise invalid("fromEnd", "asks only for the cursor after the newest event: give it without after or "
                          "waitMs, then list with after set to that cursor")
        return json_response({"events": [], "nextCursor": await request.app[SERVICE].last_event(request["principal"])})
    rows = await request.app[SERVICE].events(request["principal"], body.after, body.limit, body.waitMs)
    return json_response({"events": rows, "nextCursor": rows[-1]["seq"] if rows else body.after})


def routes() -> list[web.RouteDef]:
    base = "/api/compute/reservations/"
    return [
        web.post(base + "create", create),
        web.post(base + "get", get),
        web.post(base + "list", list_),
        web.post(base + "release", release),
        web.post(base + "cancel", cancel),
        web.post(base + "extend", extend),
        web.post(base + "renew", renew),
        web.post("/api/compute/events/list", events),
    ]
