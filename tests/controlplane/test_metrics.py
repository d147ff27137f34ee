"""The control plane's /metrics through real HTTP, read back with prometheus-client's own parser: reservations by
pool and state, nodes by pool and state, heartbeat age and bindings per node, create latency by outcome, store
group sizes, reconciler pass durations."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.controlplane.test_admin_api import ok
from tests.controlplane.test_nodes import register

ADMIN = "admin-token-for-tests-0001"


async def scrape(api) -> dict[str, dict[tuple, float]]:
    resp = await api.client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert 200 == resp.status and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_metrics_show_reservations_nodes_bindings_and_how_fast_creates_and_passes_went(api):
    await register(api)
    api.clock.advance(1_500)
    status, created = await api.create(key="a", gpuCount=1)
    assert 202 == status, created
    status, refused = await api.create(key="b", gpuCount=0)
    assert 400 == status and "INVALID_INPUT" == refused["error"]["code"]
    await api.settle(0)
    await ok(api, "nodes/cordon", {"nodeId": "h2", "reason": "fan"})
    m = await scrape(api)

    state = created["reservation"]["state"]  # as the create answered; it may have moved on since
    now = api.cp.store.reservation(created["reservation"]["id"]).state
    assert {(("pool", "h100"), ("state", now)): 1} == {k: v for k, v in m["berth_reservations"].items() if v}
    assert 1 == m["berth_nodes"][(("pool", "h100"), ("state", "ready"))]
    assert 1 == m["berth_nodes"][(("pool", "h100"), ("state", "cordoned"))]
    assert 1.5 <= m["berth_node_heartbeat_age_seconds"][(("node", "h1"), ("pool", "h100"))] < 60
    assert (("node", "h2"), ("pool", "h100")) not in m["berth_node_heartbeat_age_seconds"]  # never heard from
    bound = m["berth_node_bindings"]
    assert sum(v for k, v in bound.items() if ("state", "bound") in k) == (1 if now in ("binding", "active") else 0)
    creates = m["berth_create_duration_seconds_count"]
    assert (1, 1) == (creates[(("outcome", state),)], creates[(("outcome", "INVALID_INPUT"),)])
    assert m["berth_create_duration_seconds_sum"][(("outcome", state),)] > 0
    assert m["berth_store_group_jobs_count"][()] >= 3 and m["berth_store_group_jobs_sum"][()] >= 3
    assert m["berth_store_groups_total"][()] == m["berth_store_group_jobs_count"][()]
    assert m["berth_reconciler_passes_total"][()] >= 1
    assert m["berth_reconciler_pass_duration_seconds_count"][()] == m["berth_reconciler_passes_total"][()]
    assert "berth_reconciler_transitions_total" in m
    assert 0 == m["berth_reconciler_timer_failures_total"][()]


async def test_create_latency_counts_the_create_not_the_wait_asked_for_and_refusals_by_their_code(api):
    await api.create(key="all", gpuCount=8, nodeCount=2)  # the pool is full: the next create waits, pending
    status, doc = await api.create(key="waits", gpuCount=1, wait={"timeoutMs": 400})
    assert (202, "pending") == (status, doc["reservation"]["state"])
    resp = await api.client.post("/api/compute/reservations/create", data=b"{}", headers={
        "Authorization": "Bearer token-acme-alice-000001", "Content-Type": "text/plain"})
    assert 415 == resp.status
    status, refused = await api.create("robot", key="big", gpuCount=4)  # the agents' forbid: its draft stays
    assert (403, "ACCESS_DENIED") == (status, refused["error"]["code"])
    m = await scrape(api)
    creates = m["berth_create_duration_seconds_count"]
    assert (1, 1) == (creates[(("outcome", "pending"),)], creates[(("outcome", "INVALID_INPUT"),)])
    assert m["berth_create_duration_seconds_sum"][(("outcome", "pending"),)] < 0.3  # not the 0.4 s it was held
    assert "error" not in {dict(k).get("outcome") for k in creates}
    # the refused create's draft is kept for its key, but it is no reservation
    assert {"placed", "pending"} == {dict(k)["state"] for k, v in m["berth_reservations"].items() if v}


async def test_a_client_that_resets_mid_body_is_a_refusal_not_a_failure(api):
    """No error line, no traceback, no 503 counted: the client went away, nothing of ours failed."""
    import asyncio
    import socket
    import struct

    import structlog

    server = api.client.server
    head = (b"POST /api/compute/reservations/create HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer token-acme-alice-000001\r\nContent-Length: 100\r\n\r\n{")
    with structlog.testing.capture_logs() as logged:
        sock = socket.create_connection((server.host, server.port))
        sock.sendall(head)
        await asyncio.sleep(0.2)  # the handler is reading the body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
        await asyncio.sleep(0.3)
    assert [] == [x for x in logged if x.get("log_level") in ("error", "warning")], logged
    creates = (await scrape(api))["berth_create_duration_seconds_count"]
    assert {(("outcome", "INVALID_INPUT"),): 1} == creates


async def test_build_info_names_the_release_the_engine_and_the_schema(api, db_url):
    """Which release a control plane runs, on which engine and at which schema version of its database (the
    migrations applied at start): what a rolling upgrade of replicas is watched by."""
    from common.version import VERSION
    from controlplane.store import pg_schema, sqlite

    engine, schema = ("postgresql", pg_schema.LATEST) if db_url.startswith("postgresql://") else \
        ("sqlite", sqlite.SCHEMA_VERSION)
    m = await scrape(api)
    assert {(("engine", engine), ("schema", str(schema)), ("version", VERSION)): 1} == \
        m["berth_controlplane_build_info"]


async def test_every_metric_the_control_plane_serves_is_listed_in_the_operations_guide(api):
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    await register(api)
    status, _ = await api.create(key="listed")
    assert 202 == status
    resp = await api.client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    served = {s.name for family in text_string_to_metric_families(await resp.text()) for s in family.samples}
    # a histogram is listed by its name; a counter by its name with _total, as it is scraped
    names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_created")
             for n in served}
    assert names and all(n.startswith("berth_") for n in names), names
    assert [] == sorted(n for n in names if f"`{n}`" not in guide)


async def test_a_scrape_counts_the_reservations_while_the_api_loop_serves(api, monkeypatch):
    """The count runs over every reservation ever made (seconds on a long history: 0.6 s of a stalled loop per
    scrape with 500,000 released ones, before): it is read off the API's loop, which answers meanwhile. Here the
    count cannot finish until a request has been answered; read on the loop, it would never be."""
    import asyncio
    import threading

    answered = threading.Event()  # the count (below) holds on until the loop has served a request
    if api.engine == "sqlite":
        apart = api.cp.store._state_counts_apart

        def held():
            assert answered.wait(10), "the loop did not serve while the count ran"
            return apart()

        monkeypatch.setattr(api.cp.store, "_state_counts_apart", held)
    else:
        read_async = api.cp.store.read_async

        async def held_async(fn):
            async def wait_then(c):
                await asyncio.get_running_loop().run_in_executor(None, answered.wait, 10)
                return await fn(c)
            return await read_async(wait_then)

        monkeypatch.setattr(api.cp.store, "read_async", held_async)
    await api.create(key="one", gpuCount=1)
    scraping = asyncio.ensure_future(scrape(api))
    await asyncio.sleep(0.05)
    resp = await api.client.get("/healthz")
    assert 200 == resp.status and not scraping.done()  # answered while the count is still on its way
    answered.set()
    m = await asyncio.wait_for(scraping, 10)
    assert 1 == sum(m["berth_reservations"].values())


async def test_a_scrape_while_the_database_is_away_answers_with_the_last_counts(api, monkeypatch):
    """The counts are the one figure read from the database: with it away a scrape failed whole (503 on the API's
    listener, 500 on --metrics-listen), when the other figures matter most."""
    from controlplane.store.groups import unavailable

    await api.create(key="one", gpuCount=1)
    assert 1 == sum((await scrape(api))["berth_reservations"].values())

    async def away():
        raise unavailable("the database is unavailable (ConnectionRefusedError); retry shortly")

    monkeypatch.setattr(api.cp.store, "state_counts", away)
    m = await scrape(api)
    assert 1 == sum(m["berth_reservations"].values()) and m["berth_nodes"]
