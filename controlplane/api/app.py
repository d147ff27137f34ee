"""The app factory: `create_app(config)` wires the control plane into an aiohttp Application.

The control plane is opened in a cleanup context (before `yield`) and
closed after; handlers reach it through AppKeys, never through globals.
`/metrics` on the API needs the admin token; `create_metrics_app(api)` serves
it without one, for the `--metrics-listen` address.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from common import metrics as common_metrics
from controlplane.api import admin as admin_api
from controlplane.api.access_log import AccessLog
from controlplane.api import billing as billing_api
from controlplane.api import confirmations as confirmation_api
from controlplane.api import guard
from controlplane.api import identity as identity_api
from controlplane.api import nodes as node_api
from controlplane.api import openapi
from controlplane.api import pools as pool_api
from controlplane.api import reservations as reservation_api
from controlplane.api import ui as ui_api
from controlplane.api.auth import ADMIN_ONLY, admin_of, known_first, manage_access, principal_of
from controlplane.api.errors import answer_errors
from controlplane.domain import node_states
from controlplane.wiring import Config, ControlPlane

CONTROL_PLANE = web.AppKey("control_plane", ControlPlane)
ACCESS_LOG = web.AppKey("access_log", AccessLog)

TENANT_PATHS = ("/api/compute/", "/api/iam/")  # authenticated with a tenant's token
# What a read-scoped token may not call: every method that changes something.
MUTATIONS = frozenset(f"/api/compute/reservations/{m}" for m in ("create", "release", "cancel", "extend", "renew")) | \
    frozenset(f"/api/iam/confirmations/{m}" for m in ("approve", "deny"))
# Mutations decided from this replica's memory before they run (a create is decided inside the writer's locked group,
# after the memory caught up with the database): with other replicas the memory first catches up with what they
# committed before the request came, so a token or a permit another replica's bootstrap took away a moment ago is not
# honoured here (docs/scale-out.md). On SQLite there is nothing to catch up with.
DECIDED_FRESH = (MUTATIONS - {"/api/compute/reservations/create"}) | frozenset(
    f"/api/admin/{m}" for m in ("bootstrap", "tenants/budget", "nodes/release-identity",
                                *(f"nodes/{action}" for action in node_states.ACTIONS)))


@web.middleware
async def api_middleware(request: web.Request, handler):
    """One middleware (each layer costs every request): the tenant's principal from the token, then the handler,
    with every refusal as the error envelope; meanwhile the connection guard counts the connection busy."""

    async def call():
        cp = request.app.get(CONTROL_PLANE)
        if cp is not None and request.path in DECIDED_FRESH:
            await cp.replicas.caught_up()
        elif cp is not None and "Authorization" in request.headers:
            await known_first(request, cp.tokens, cp.replicas.caught_up)
        if request.path.startswith(TENANT_PATHS):
            principal = request["principal"] = principal_of(request, cp.tokens, cp.catalog.current.principals)
            if request.path in MUTATIONS:
                manage_access(principal, cp.catalog.current.principals, request.path)
        return await handler(request)

    conn = guard.begin(request)
    started = time.perf_counter()
    try:
        response = await answer_errors(request, call)
    finally:
        guard.end(conn)
    access = request.app.get(ACCESS_LOG)
    if access is not None:
        await access.line(request, response, time.perf_counter() - started)
    return response


def _leads(request: web.Request) -> bool:
    cp = request.app.get(CONTROL_PLANE)
    return bool(cp is not None and cp.replicas.leads())


async def healthz(request: web.Request) -> web.Response:
    """Alive, for a load balancer; `leads`: this replica drives the timers (always, on SQLite; docs/scale-out.md)."""
    return web.json_response({"status": "ok", "leads": _leads(request)})


async def healthz_leader(request: web.Request) -> web.Response:
    """The same answer, 200 from the replica that leads and 503 from the others: for a balancer that reads only
    the status (a cloud's target group, a TCP-level proxy's HTTP check) to send every request to the leader."""
    leads = _leads(request)
    return web.json_response({"status": "ok", "leads": leads}, status=200 if leads else 503)


async def metrics(request: web.Request) -> web.Response:
    """/metrics on the API's listener: for the admin token only (it names every node)."""
    cp = request.app[CONTROL_PLANE]
    admin_of(request, cp.tokens, cp.catalog.current.principals,
             ADMIN_ONLY + "; or scrape the address of --metrics-listen, which needs none")
    return await metrics_response(cp, request)


async def metrics_response(cp: ControlPlane, request: web.Request) -> web.Response:
    """One scrape of the control plane's registry (controlplane/metrics.py; every metric in docs/operations.md)."""
    await cp.metrics.read_store(cp)
    return common_metrics.scrape(cp.metrics.registry, request)


def create_app(config: Config, control_plane: ControlPlane | None = None,
               limits: guard.Limits | None = None, access_log: AccessLog | None = None) -> web.Application:
    app = web.Application(middlewares=[api_middleware], client_max_size=1 << 20)
    app[guard.LIMITS] = limits or guard.Limits()
    if access_log is not None:
        app[ACCESS_LOG] = access_log

    async def lifecycle(app: web.Application):
        cp = control_plane or await asyncio.to_thread(lambda: ControlPlane(config).open())
        app[CONTROL_PLANE] = cp
        app[reservation_api.SERVICE] = cp.reservations
        app[confirmation_api.SERVICE] = cp.confirmations
        app[billing_api.OPERATIONS] = cp.operations
        app[billing_api.BILLING] = cp.billing
        app[node_api.NODES] = cp.nodes
        app[reservation_api.METRICS] = cp.metrics
        await cp.start_replica()
        tasks = [asyncio.ensure_future(cp.reconciler.run()), asyncio.ensure_future(cp.nodes.run_monitor())] \
            if config.reconcile else []
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await cp.stop_replica()
        await cp.reconciler.drain()
        if hasattr(cp.authorizer, "close"):
            await cp.authorizer.close()
        if control_plane is None:
            await asyncio.to_thread(cp.close)

    app.cleanup_ctx.append(lifecycle)

    async def stop_long_polls(app: web.Application) -> None:
        if CONTROL_PLANE in app:
            app[CONTROL_PLANE].nodes.close()
            app[CONTROL_PLANE].reservations.close()
            app[CONTROL_PLANE].operations.close()

    app.on_shutdown.append(stop_long_polls)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/healthz/leader", healthz_leader)
    app.add_routes(reservation_api.routes())
    app.add_routes(confirmation_api.routes())
    app.add_routes(billing_api.routes())
    app.add_routes(node_api.routes())
    app.add_routes(admin_api.routes())
    app.add_routes(pool_api.routes())
    app.add_routes(identity_api.routes())
    app.add_routes(ui_api.routes())
    app.router.add_get("/metrics", metrics)
    openapi.setup(app)
    return app


def create_metrics_app(api: web.Application) -> web.Application:
    """`/metrics` alone and without a token, for the `--metrics-listen` address (loopback or a scrape network)."""
    app = web.Application(middlewares=[guard.track])

    async def scrape(request: web.Request) -> web.Response:
        return await metrics_response(api[CONTROL_PLANE], request)

    app.router.add_get("/metrics", scrape)
    return app
