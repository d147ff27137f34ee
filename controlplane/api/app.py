"""The app factory: `create_app(config)` wires the control plane into an aiohttp Application.

The control plane is opened in a cleanup context (before `yield`) and
closed after; handlers reach it through AppKeys, never through globals.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from controlplane.api import billing as billing_api
from controlplane.api import confirmations as confirmation_api
from controlplane.api import reservations as reservation_api
from controlplane.api.auth import principal_of
from controlplane.api.errors import error_middleware
from controlplane.wiring import Config, ControlPlane

CONTROL_PLANE = web.AppKey("control_plane", ControlPlane)

PUBLIC_PATHS = frozenset({"/healthz"})


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if request.path.startswith("/api/compute/") or request.path.startswith("/api/iam/"):
        cp = request.app[CONTROL_PLANE]
        request["principal"] = principal_of(request, cp.tokens, cp.catalog.current.principals)
    return await handler(request)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def create_app(config: Config, control_plane: ControlPlane | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=1 << 20)

    async def lifecycle(app: web.Application):
        cp = control_plane or await asyncio.to_thread(lambda: ControlPlane(config).open())
        app[CONTROL_PLANE] = cp
        app[reservation_api.SERVICE] = cp.reservations
        app[confirmation_api.SERVICE] = cp.confirmations
        app[billing_api.OPERATIONS] = cp.operations
        app[billing_api.BILLING] = cp.billing
        loop_task = asyncio.ensure_future(cp.reconciler.run()) if config.reconcile else None
        yield
        if loop_task is not None:
            loop_task.cancel()
            await asyncio.gather(loop_task, return_exceptions=True)
        await cp.reservations.drain()
        if hasattr(cp.authorizer, "close"):
            await cp.authorizer.close()
        if control_plane is None:
            await asyncio.to_thread(cp.close)

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/healthz", healthz)
    app.add_routes(reservation_api.routes())
    app.add_routes(confirmation_api.routes())
    app.add_routes(billing_api.routes())
    return app
