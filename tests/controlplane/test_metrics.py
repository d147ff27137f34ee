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
