"""The operator's fleet service without HTTP: cordon, uncordon, drain and clear as commands in, results out, through
the store port on a real SQLite file; node states survive a restart; operators are decided by Cedar."""
from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from controlplane.catalog import encode_item
from controlplane.commands import Create
from controlplane.domain import node_states
from controlplane.domain.admission import CreateRequest
from controlplane.domain.clock import FakeClock
from controlplane.domain.errors import DomainError
from controlplane.fleet import FLEET_EVENTS, FreeStep, Window
from controlplane.wiring import Config, ControlPlane
from tests.controlplane.conftest import HOUR, T0, bootstrap_doc

OPERATORS = [
    {"id": "olga", "kind": "operator", "token": "token-operator-olga-0001"},  # fleet-wide, as the policies allow
    {"id": "otto", "kind": "operator", "tenant": "acme", "scope": "read", "token": "token-operator-otto-0001"},
]
OPERATOR_POLICIES = """
permit (principal == Operator::"olga", action in [Action::"fleet:nodes:read", Action::"fleet:nodes:cordon"],
        resource is Node) when { resource.region == "eu" };
permit (principal == Operator::"olga", action == Action::"fleet:tenants:read", resource);
"""


def doc_with_operators() -> dict:
    doc = bootstrap_doc()
    doc["principals"] += OPERATORS
    doc["policies"] += OPERATOR_POLICIES
    return doc


def open_plane(path, bootstrap: str) -> ControlPlane:
    return ControlPlane(Config(db=f"sqlite:///{path / 'cp.db'}", bootstrap=bootstrap, clock=FakeClock(T0),
                               synchronous="OFF", reconcile=False)).open()


@pytest.fixture
def cp(tmp_path, bootstrap_file):
    plane = open_plane(tmp_path, bootstrap_file(doc_with_operators()))
    yield plane
    plane.close()


def ask(key: str, gpus: int = 1, start: int | None = None, hours: int = 1) -> Create:
    if start is None:
        request = CreateRequest(pool_id="h100", gpu_model="H100_80GB", gpu_count=gpus, duration_ms=hours * HOUR)
    else:
        request = CreateRequest(pool_id="h100", gpu_model="H100_80GB", gpu_count=gpus, start=start,
                                end=start + hours * HOUR)
    return Create(request, f"fp-{key}", key)


async def book(cp, key: str, **kw):
    return (await cp.reservations.create(cp.catalog.current.principals["alice"], ask(key, **kw))).reservation


def node_of(res) -> str:
    return res.placements[0].node_id


def other(node_id: str) -> str:
    return {"h1": "h2", "h2": "h1"}[node_id]


async def settle(cp) -> None:
    await cp.reconciler.drain()
    await cp.reconciler.settle()
    await cp.reconciler.drain()


# ---- the state table -------------------------------------------------------------------------------

@pytest.mark.parametrize("action, before, after", [
    ("cordon", "ready", "cordoned"), ("cordon", "cordoned", "cordoned"), ("cordon", "draining", "draining"),
    ("cordon", "maintenance", "maintenance"), ("uncordon", "cordoned", "ready"), ("uncordon", "draining", "ready"),
    ("uncordon", "ready", "ready"), ("drain", "ready", "draining"), ("drain", "cordoned", "draining"),
    ("drain", "maintenance", "maintenance"), ("clear", "maintenance", "ready"), ("clear", "ready", "ready"),
    ("uncordon", "maintenance", "refused: clear"), ("uncordon", "cleaning", "refused: wait"),
    ("clear", "cordoned", "refused: uncordon"), ("clear", "draining", "refused: uncordon"),
    ("clear", "cleaning", "refused: wait"),
])
def test_each_action_moves_a_node_state_as_the_table_says(action, before, after):
    got = node_states.apply(action, before)
    assert after == (got if isinstance(got, str) else f"refused: {got.next}")


def test_only_a_ready_node_heard_from_is_placeable(cp):
    node = cp.catalog.current.nodes["h1"]
    assert node.placeable
    assert [False] * 5 == [replace(node, state=s).placeable for s in node_states.STORED if s != "ready"] + [
        replace(node, schedulable=False).placeable]


# ---- cordon, uncordon ----------------------------------------------------------------------------------

async def test_a_cordoned_node_takes_no_new_placements_keeps_its_bookings_and_uncordon_wakes_the_pending(cp):
    first = await book(cp, "first", gpus=4)
    held = node_of(first)
    cordoned = await cp.fleet.act(None, held, "cordon", reason="disk replacement")
    assert (True, "cordoned", "cordoned") == (cordoned.changed, cordoned.node.state, cordoned.node.node.state)
    assert [first.id] == [b.reservation_id for b in cordoned.node.bookings]  # existing bookings stay
    again = await cp.fleet.act(None, held, "cordon")
    assert (False, "cordoned") == (again.changed, again.node.state)  # idempotent
    full = await book(cp, "fills-the-other", gpus=8)
    assert other(held) == node_of(full)
    waiting = await book(cp, "would-fit-the-cordoned-one", gpus=4)
    assert "pending" == waiting.state  # 4 GPUs are free on the cordoned node, and placement may not use them
    assert ("placed", held) == (cp.store.reservation(first.id).state, node_of(cp.store.reservation(first.id)))
    uncordoned = await cp.fleet.act(None, held, "uncordon")
    assert (True, "ready") == (uncordoned.changed, uncordoned.node.state)
    await settle(cp)
    now_placed = cp.store.reservation(waiting.id)
    assert (True, held) == (now_placed.state in ("placed", "binding"), node_of(now_placed))
    events = cp.store.events(FLEET_EVENTS, None, 100)
    assert [("node.cordoned", held, "cordoned", "admin", "disk replacement"), ("node.uncordoned", held, "ready", "admin", None)] \
        == [(e["type"], e["data"]["nodeId"], e["data"]["state"], e["data"]["by"], e["data"].get("reason")) for e in events]


async def test_a_node_state_survives_a_restart_that_applies_the_bootstrap_again(tmp_path, bootstrap_file):
    path = bootstrap_file(doc_with_operators())
    plane = open_plane(tmp_path, path)
    await plane.fleet.act(None, "h1", "cordon")
    await plane.fleet.act(None, "h2", "drain")
    plane.close()
    again = open_plane(tmp_path, path)
    try:
        nodes = again.catalog.current.nodes
        assert ("cordoned", "draining", "ready") == (nodes["h1"].state, nodes["h2"].state, nodes["m1"].state)
        assert nodes["h1"].declared  # still the node the file declares, applied again, with its state kept
    finally:
        again.close()


# ---- drain -------------------------------------------------------------------------------------------

async def test_drain_moves_what_has_not_started_returns_what_fits_nowhere_to_pending_and_lets_started_work_run(cp):
    running = await book(cp, "running", gpus=8, hours=4)  # fills node A from now
    await settle(cp)
    a = node_of(running)
    assert "binding" == cp.store.reservation(running.id).state  # started (a declared node: no agent binds it)
    later = await book(cp, "later", gpus=2, start=T0 + 5 * HOUR)  # on A, after the running one
    blocker = await book(cp, "blocker", gpus=8, start=T0 + 5 * HOUR)  # fills B over the same hour
    last = await book(cp, "last", gpus=1, start=T0 + 7 * HOUR)
    assert (a, other(a), a) == (node_of(later), node_of(blocker), node_of(last))
    used = dict(cp.state.ledger.usage("acme"))

    drained = await cp.fleet.act(None, a, "drain", reason="kernel upgrade")
    assert (True, "draining", False) == (drained.changed, drained.node.state, drained.node.drained)
    assert [(last.id, (a,), (other(a),))] == [(m.reservation_id, m.from_nodes, m.to_nodes) for m in drained.moved]
    assert (later.id,) == drained.pending
    moved, pending, kept = (cp.store.reservation(r.id) for r in (last, later, running))
    assert ("placed", other(a), T0 + 7 * HOUR) == (moved.state, node_of(moved), moved.start)
    assert ("pending", [], "NodeDrained") == (pending.state, pending.placements,
                                             next(c.reason for c in pending.conditions if c.type == "Unschedulable"))
    assert ("binding", a) == (kept.state, node_of(kept))  # runs to its end where it is
    assert used == dict(cp.state.ledger.usage("acme"))  # quota stays held: the pending one waits for capacity
    tenant_events = {(e["reservationId"], e["type"]): e["data"] for e in cp.store.events("acme", None, 500)}
    assert {"nodeId": a, "fromNodes": [a], "nodes": [other(a)], "reason": "drain"}.items() <= \
        tenant_events[(last.id, "reservation.moved")].items()
    assert "drain" == tenant_events[(later.id, "reservation.pending")]["reason"]
    fleet = cp.store.events(FLEET_EVENTS, None, 100)
    assert [("node.drained", [last.id], [later.id], "kernel upgrade")] == [
        (e["type"], e["data"]["moved"], e["data"]["pending"], e["data"]["reason"]) for e in fleet]

    again = await cp.fleet.act(None, a, "drain")
    assert (False, (), ()) == (again.changed, again.moved, again.pending)
    assert 1 == len(cp.store.events(FLEET_EVENTS, None, 100))  # a drain that changed nothing is no event
    assert other(a) == node_of(await book(cp, "new", gpus=1, start=T0 + 9 * HOUR))  # not on the draining node
    assert [] == cp.state.calendar.overlaps()


# ---- clear, maintenance ------------------------------------------------------------------------------------

async def set_state(cp, node_id: str, state: str) -> None:
    """What cleaning (a later issue) does: put the node in a state no operator action sets."""
    def job(tx):
        catalog = cp.catalog.current
        node = replace(catalog.nodes[node_id], state=state)
        tx.put_catalog("node", node_id, encode_item(node))
        cp.catalog.current = catalog.with_changes(nodes={**catalog.nodes, node_id: node})

    await cp.store.call(job)


async def test_clear_returns_a_node_from_maintenance_and_each_refusal_names_what_to_do_instead(cp):
    await set_state(cp, "h1", "maintenance")
    with pytest.raises(DomainError) as refused:
        await cp.fleet.act(None, "h1", "uncordon")
    err = refused.value
    assert ("INVALID_STATE", "nodeId", "maintenance", "berth admin nodes clear h1") == (
        err.code, err.details["field"], err.details["state"], err.details["next"])
    assert "uncordon needs a node in ready or cordoned or draining" == err.details["rule"]
    assert (await cp.fleet.act(None, "h1", "cordon")).changed is False  # already takes no placements
    cleared = await cp.fleet.act(None, "h1", "clear")
    assert (True, "ready") == (cleared.changed, cleared.node.state)
    assert (await cp.fleet.act(None, "h1", "clear")).changed is False
    await cp.fleet.act(None, "h1", "cordon")
    with pytest.raises(DomainError) as refused:
        await cp.fleet.act(None, "h1", "clear")
    assert ("INVALID_STATE", "berth admin nodes uncordon h1") == (refused.value.code, refused.value.details["next"])
    with pytest.raises(DomainError) as missing:
        await cp.fleet.act(None, "nope", "cordon")
    assert ("NOT_FOUND", "nodeId") == (missing.value.code, missing.value.details["field"])


# ---- IAM --------------------------------------------------------------------------------------------------

async def test_operators_may_do_what_the_cedar_policies_permit_and_nothing_else(cp):
    olga, otto = (cp.catalog.current.principals[p] for p in ("olga", "otto"))
    window = Window(T0, T0 + HOUR)
    eu = {n.id for n in cp.catalog.current.nodes.values() if cp.catalog.current.pools[n.pool_id].region == "eu"}
    assert eu == {v.node.id for v in await cp.fleet.list_nodes(olga, window)}
    assert (await cp.fleet.act(olga, "h1", "cordon")).changed
    for action, node in (("drain", "h1"), ("cordon", "m1")):  # no permit for drain; m1 is in us
        with pytest.raises(DomainError) as refused:
            await cp.fleet.act(olga, node, action)
        assert ("ACCESS_DENIED", node) == (refused.value.code, refused.value.details["resource"])
    with pytest.raises(DomainError) as refused:
        await cp.fleet.get_node(olga, "m1", window)
    assert "ACCESS_DENIED" == refused.value.code
    assert [] == await cp.fleet.list_pools(olga)
    assert {"acme", "globex", "initech"} == {t.tenant.id for t in await cp.fleet.list_tenants(olga)}
    # otto belongs to acme: the tests' policy (principal.tenant == resource.tenant) lets it read acme's pools and
    # their nodes; its token is read-scoped, so it changes nothing
    assert {p.id for p in cp.catalog.current.pools.values() if p.owner == "acme"} == {
        v.pool.id for v in await cp.fleet.list_pools(otto)}
    with pytest.raises(DomainError) as refused:
        await cp.fleet.act(otto, "h2", "cordon")
    assert ("COMPUTE_ACCESS_REQUIRED", "manage") == (refused.value.code, refused.value.details["required"])
    fleet = cp.store.events(FLEET_EVENTS, None, 10)
    assert [("node.cordoned", "olga")] == [(e["type"], e["data"]["by"]) for e in fleet]
    rows, cursor = await cp.fleet.events(otto, None, 10)  # h1 is in a pool of acme's: otto reads its events
    assert ([fleet[0]["seq"]], fleet[-1]["seq"]) == ([r["seq"] for r in rows], cursor)


# ---- pools, tenants, free capacity ----------------------------------------------------------------------------

async def test_pools_count_devices_in_use_and_free_now_and_tenants_show_quota_budget_and_spend(cp):
    used = node_of(await book(cp, "now", gpus=3))
    await book(cp, "later", gpus=8, start=T0 + 2 * HOUR)
    await cp.fleet.act(None, other(used), "cordon")
    pool = await cp.fleet.get_pool(None, "h100")
    assert ({"ready": 1, "cordoned": 1}, (16, 3, 5)) == (
        {k: v for k, v in pool.nodes.items() if v}, (pool.gpus.total, pool.gpus.booked, pool.gpus.free))
    acme = await cp.fleet.get_tenant(None, "acme")
    assert ({"gpu:H100_80GB": 11}, 0, {"placed": 2}) == (dict(acme.used), acme.spent_usd, dict(acme.reservations))
    assert Decimal("27.5") == acme.committed_usd  # one hour each of 3 and 8 GPUs at $2.5 per GPU-hour
    with pytest.raises(DomainError) as missing:
        await cp.fleet.get_tenant(None, "nope")
    assert ("NOT_FOUND", "tenantId") == (missing.value.code, missing.value.details["field"])


async def test_a_tenant_sees_the_free_devices_of_its_pools_as_steps_over_the_window(cp):
    used = node_of(await book(cp, "now", gpus=3))
    assert used == node_of(await book(cp, "later", gpus=8, start=T0 + 2 * HOUR))  # the node in use fills first
    await cp.fleet.act(None, other(used), "cordon")  # 8 devices fewer to book
    pools = {p.pool.id: p for p in cp.fleet.offered_pools("acme", Window(T0, T0 + 4 * HOUR))}
    h100 = pools["h100"]
    assert 8 == h100.units
    assert (FreeStep(T0, 5), FreeStep(T0 + HOUR, 8), FreeStep(T0 + 2 * HOUR, 0), FreeStep(T0 + 3 * HOUR, 8)) == h100.free
    assert "old" not in pools and "globex-own" not in pools  # archived; another tenant's
    assert {"h100", "k8s"} <= set(p.pool.id for p in cp.fleet.offered_pools("globex", Window(T0, T0 + HOUR)))
