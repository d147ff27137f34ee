"""Properties of random interleavings of create, extend, release, cancel, renew, lease lapse and clock advances.

Invariants after every step: no device is booked twice at once; quota held
equals the live reservations' charges; memory equals a rebuild from the
database; no reservation leaves a terminal state; every state change has
its event, in an order the state machine allows.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from decimal import Decimal

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain import states
from controlplane.domain import pricing
from controlplane.domain.clock import FakeClock
from controlplane.domain.errors import DomainError
from controlplane.schemas import CreateBody, ExtendBody, Resources, create_command, extend_command
from controlplane.state import WriterState
from controlplane.store import move, pg_schema
from controlplane.wiring import Config, ControlPlane
from common.nodewire import Report
from tests import dbrows
from tests.controlplane.conftest import HOUR, T0, bootstrap_doc

create_op = st.fixed_dictionaries({
    "op": st.just("create"),
    "who": st.sampled_from(["alice", "bob", "dave", "carol"]),
    "gpus": st.integers(1, 8),
    "nodes": st.integers(1, 2),
    "offset_h": st.integers(0, 6),
    "hours": st.integers(1, 4),
    "vcpu": st.sampled_from([None, 4, 12, 20]),
    "key": st.integers(0, 12),  # small key space: replays and conflicts happen
    "spot": st.booleans(),
    "lease": st.sampled_from([None, None, 60, 600]),
})
end_op = st.fixed_dictionaries({"op": st.sampled_from(["release", "cancel", "renew"]), "pick": st.integers(0, 1000)})
extend_op = st.fixed_dictionaries({"op": st.just("extend"), "pick": st.integers(0, 1000), "hours": st.integers(1, 3)})
tick_op = st.fixed_dictionaries({"op": st.just("tick"), "minutes": st.integers(1, 360)})
# carol's creates (globex's offer of h100 checks budgets) arriving at once, in one writer group
burst_op = st.fixed_dictionaries({"op": st.just("burst"), "n": st.integers(2, 8), "gpus": st.integers(1, 4),
                                  "hours": st.integers(1, 6), "key": st.integers(0, 1000)})
bind_op = st.fixed_dictionaries({"op": st.just("bind"), "pick": st.integers(0, 1000)})  # the nodes report bound
lose_op = st.fixed_dictionaries({"op": st.just("lose"), "node": st.sampled_from(["h1", "h2"])})  # a node is lost
GLOBEX_BUDGET = "60"  # h100 bills 2.50 per GPU-hour: a few of carol's creates fit, a burst of them does not
ops = st.lists(st.one_of(create_op, create_op, end_op, extend_op, tick_op, tick_op, burst_op, bind_op, bind_op, lose_op),
               min_size=1, max_size=50)


def check_invariants(cp: ControlPlane) -> None:
    now = cp.clock.compute_now()
    live, live_bookings = cp.store.call_sync(lambda tx: (tx.live_reservations(now), tx.live_bookings(now)))
    # No device is booked twice at once, in the database...
    rows = dbrows.store_rows(cp.store,
        "SELECT b.node_id, b.units, b.start_ms, b.end_ms, b.reservation_id FROM bookings b"
        " JOIN reservations r ON r.id = b.reservation_id WHERE r.state IN ('placed','binding','active') AND b.end_ms > b.start_ms"
    )
    per_device: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for node_id, units, start, end, _ in rows:
        for unit in dbrows.units_of(units):
            per_device.setdefault((node_id, unit), []).append((start, end))
    for spans in per_device.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    # ...nor in memory.
    assert cp.state.calendar.overlaps() == []
    # Quota held equals the charges of the live reservations.
    expected: dict[str, Counter] = {}
    # Nothing bills behind a failed create: billed time implies the create succeeded.
    for tenant in ("acme", "globex", "initech"):
        for rid, _pool, _hourly, start, end in cp.store.billing(tenant):
            billed_ms = (end if end is not None else cp.clock.compute_now()) - start
            create_op = cp.store.reservation(rid).create_operation()
            assert billed_ms <= 0 or create_op.status == "succeeded", (rid, create_op)
    # A budget is never overspent, also by admissions that arrived together: what was billed plus what the
    # live reservations may still bill stays within it (globex's every reservation is budget-checked).
    exposure = sum((pricing.exposure(r.hourly_usd, r.duration_ms or 0) if r.state == states.PENDING and r.asap
                    else pricing.exposure(r.hourly_usd, max(0, (r.end or 0) - max(now, r.start or now)))
                    for r in live
                    if r.tenant_id == "globex" and r.state in states.CHARGED), Decimal(0))
    assert cp.billing.spent_usd("globex") + exposure <= Decimal(GLOBEX_BUDGET)
    for res in live:
        if res.state in states.CHARGED:
            expected.setdefault(res.tenant_id, Counter()).update(res.charge)
    for tenant in ("acme", "initech"):
        assert +cp.state.ledger.usage(tenant) == +expected.get(tenant, Counter())
    # Memory is exactly what a rebuild from the database gives.
    # Terminal states are never left, and the events of each reservation follow the state machine.
    path: dict[str, list[str]] = {}
    for rid, data in dbrows.store_rows(cp.store, "SELECT reservation_id, data FROM events WHERE type LIKE 'reservation.%' ORDER BY seq"):
        state = json.loads(bytes(data))["state"]
        path.setdefault(rid, []).append(state)
    for rid, seen in path.items():
        steps = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
        assert steps[0] in (states.PENDING, states.PLACED, states.AWAITING_CONFIRMATION, states.DRAFT), steps
        for a, b in zip(steps, steps[1:]):
            assert a not in states.TERMINAL, (rid, steps)
            assert states.can_move(a, b) or (a, b) == (states.AWAITING_CONFIRMATION, states.DRAFT), (rid, steps)
    for rid, state in dbrows.store_rows(cp.store, "SELECT id, state FROM reservations WHERE state NOT IN ('draft', 'awaiting-confirmation')"):
        assert path[rid][-1] == state, (rid, path[rid], state)
    fresh = WriterState()
    fresh.rebuild(cp.catalog.current, live, live_bookings)
    mine = {k: sorted((b.node_id, b.units, b.start, b.end) for b in v) for k, v in cp.state.calendar.by_reservation.items()}
    theirs = {k: sorted((b.node_id, b.units, b.start, b.end) for b in v) for k, v in fresh.calendar.by_reservation.items()}
    assert mine == theirs


async def run(cp: ControlPlane, steps: list[dict]) -> None:
    svc = cp.reservations
    principals = cp.catalog.current.principals
    made: list[tuple[str, str]] = []
    for step in steps:
        try:
            if step["op"] == "create":
                now = cp.clock.compute_now()
                start = now + step["offset_h"] * HOUR
                body = CreateBody(
                    poolId="h100", gpuModel="H100_80GB", gpuCount=step["gpus"], nodeCount=step["nodes"],
                    start=start if step["offset_h"] else None,
                    end=start + step["hours"] * HOUR if step["offset_h"] else None,
                    durationHours=None if step["offset_h"] else step["hours"],
                    resources=Resources(vcpu=step["vcpu"]) if step["vcpu"] else None,
                    spot=step["spot"], leaseSeconds=step["lease"],
                )
                answer = await svc.create(principals[step["who"]], create_command(body, f"k{step['key']}"))
                made.append((step["who"], answer.reservation.id))
            elif step["op"] in ("release", "cancel", "renew") and made:
                who, rid = made[step["pick"] % len(made)]
                await getattr(svc, step["op"])(principals[who], rid)
            elif step["op"] == "extend" and made:
                who, rid = made[step["pick"] % len(made)]
                await svc.extend(principals[who], extend_command(ExtendBody(reservationId=rid, by=step["hours"] * HOUR)))
            elif step["op"] == "burst":
                bodies = [CreateBody(poolId="h100", gpuModel="H100_80GB", gpuCount=step["gpus"],
                                     durationHours=step["hours"]) for _ in range(step["n"])]
                answers = await asyncio.gather(*(svc.create(principals["carol"], create_command(b, f"b{step['key']}-{i}"))
                                                 for i, b in enumerate(bodies)), return_exceptions=True)
                made.extend(("carol", a.reservation.id) for a in answers if not isinstance(a, BaseException))
            elif step["op"] == "bind" and made:
                _, rid = made[step["pick"] % len(made)]
                await cp.reconciler.settle()  # a window due now starts binding first
                res = cp.store.reservation(rid)
                if res is not None and res.state == states.BINDING:
                    for p in res.placements:
                        await cp.nodes.report(cp.catalog.current.nodes[p.node_id], (Report(rid, "bound"),))
            elif step["op"] == "lose":
                for pool_id in await cp.store.call(lambda tx: cp.nodes._lose(tx, step["node"])):
                    cp.reconciler.capacity_freed(pool_id)
            elif step["op"] == "tick":
                cp.clock.advance(step["minutes"] * 60_000)
                await cp.reconciler.drain()
                await cp.reconciler.settle()
        except DomainError:
            pass
        await cp.reconciler.drain()
        check_invariants(cp)


@pytest.fixture(scope="module")
def pg_database(pg_cluster):
    """One database for the module's PostgreSQL examples, migrated once and emptied before each (a new database
    per example, made and migrated, cost more than the example's own steps)."""
    name = f"berth_{uuid.uuid4().hex[:12]}"
    dsn = pg_cluster.createdb(name)

    async def migrated() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await pg_schema.migrate(conn)
        finally:
            await conn.close()

    asyncio.run(migrated())
    yield dsn
    pg_cluster.psql(f'DROP DATABASE "{name}" WITH (FORCE)')


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops)
@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_random_sequences_keep_the_calendar_and_quota_consistent(tmp_path_factory, request, engine, steps):
    path = tmp_path_factory.mktemp("prop")
    db = f"sqlite:///{path / 'cp.db'}"
    if engine == "postgresql":
        db = request.getfixturevalue("pg_database")
        dbrows.rows(db, f"TRUNCATE {', '.join(move.EMPTIED)} RESTART IDENTITY")  # what a control plane holds
    doc = bootstrap_doc()
    next(t for t in doc["tenants"] if t["id"] == "globex")["budgetUsd"] = GLOBEX_BUDGET
    (path / "b.json").write_text(json.dumps(doc))
    cp = ControlPlane(Config(db=db, bootstrap=str(path / "b.json"),
                             clock=FakeClock(T0), synchronous="OFF")).open()
    try:
        asyncio.run(run(cp, steps))
    finally:
        cp.close()
