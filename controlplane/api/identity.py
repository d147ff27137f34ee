"""`POST /api/iam/whoami`: who the caller's token speaks for (tenant, principal, kind, scope, delegating user).

Needs no decision: a token may always learn what it is. Nothing else about
the tenant is shown.
"""
from __future__ import annotations

from aiohttp import web
from msgspec import Struct

from controlplane.api.body import read_json
from controlplane.api.errors import json_response


class WhoamiBody(Struct, forbid_unknown_fields=True):
    """No fields."""


async def whoami(request: web.Request) -> web.Response:
    await read_json(request, WhoamiBody)
    p = request["principal"]
    return json_response({"principal": {"id": p.id, "tenantId": p.tenant_id, "kind": p.kind, "scope": p.scope,
                                        "delegatedBy": p.delegated_by}})


def routes() -> list[web.RouteDef]:
    return [web.post("/api/iam/whoami", whoami)]
