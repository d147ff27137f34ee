"""The reconciler, the placers, extend and renew through real HTTP, with the fake clock."""
from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal

import pytest

from controlplane.reconciler import Reconciler
from controlplane.store.groups import unavailable
from tests.controlplane.conftest import HOUR, T0

MIN = 60_000


async def states_of(api, rid: str, who: str = "alice") -> str:
    return (await api.ok("get", who, {"reservationId": rid}))["state"]


async def event_types(api, rid: str, who: str = "alice") -> list[str]:
    return [e["type"] for e in await api.events(who) if e["reservationId"] == rid]


# ---- the reconciler ------------------------------------------------------------------

async def test_placed_becomes_binding_at_start_and_released_at_end(api):
    res = (await api.create(key="w", start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    await api.settle(HOUR - 1)
    assert await states_of(api, res["id"]) == "placed"
    await api.settle(1)
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert got["state"] == "binding"
    cond = next(c for c in got["conditions"] if c["type"] == "DevicesBound")
    assert (cond["status"], cond["reason"]) == ("False", "NoAgent")  # a declared node: no agent to bind
    await api.settle(HOUR)
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert (got["state"], got["reason"]) == ("released", "ended")
    op = api.cp.store.operation(res["operation"]["id"])
    assert op.status == "failed" and op.failure.actor == "platform"  # the devices were never bound
    assert await event_types(api, res["id"]) == ["reservation.placed", "reservation.binding", "reservation.released"]
    assert api.cp.state.ledger.usage("acme")["gpu:H100_80GB"] == 0


async def test_a_timer_whose_handling_fails_is_set_aside_and_the_other_windows_go_on(api, monkeypatch):
    """A defect in handling one reservation (here one made to raise) once failed every pass, for every pool, in a
    hot loop: its timer is now set aside for a minute, named in the log, and the other windows start meanwhile."""
    from controlplane import reconciler

    bad, good = [(await api.create(key=k, start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
                 for k in ("bad", "good")]
    moves = api.cp.reconciler.moves
    start_binding = moves.start_binding

    def broken(tx, res, now):
        if res.id == bad["id"]:
            raise RuntimeError("a defect")
        return start_binding(tx, res, now)

    monkeypatch.setattr(moves, "start_binding", broken)
    await api.settle(HOUR)
    assert ("placed", "binding") == (await states_of(api, bad["id"]), await states_of(api, good["id"]))
    assert (1, {("start", bad["id"]): T0 + HOUR + reconciler.SET_ASIDE_MS}) == (
        api.cp.reconciler.failures, api.cp.reconciler.set_aside)
    monkeypatch.setattr(moves, "start_binding", start_binding)  # the defect gone (a fix, a restart)
    await api.settle(reconciler.SET_ASIDE_MS - 1)
    assert "placed" == await states_of(api, bad["id"])  # set aside until then
    await api.settle(1)
    assert ("binding", {}) == (await states_of(api, bad["id"]), api.cp.reconciler.set_aside)


async def test_a_database_error_met_handling_a_timer_is_no_fault_of_that_timer(api, monkeypatch):
    """A full disk (or a database that went away) met while a window starts fails the pass, which the loop tries
    again after a tick: the timer is not set aside for a minute nor counted as a defect."""
    import sqlite3

    import asyncpg

    from controlplane.domain.errors import DomainError

    res = (await api.create(key="w", start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    moves = api.cp.reconciler.moves
    start_binding = moves.start_binding
    full = sqlite3.OperationalError("database or disk is full") if api.engine == "sqlite" else \
        asyncpg.DiskFullError("could not extend file: No space left on device")

    def once(tx, r, now):
        monkeypatch.setattr(moves, "start_binding", start_binding)
        raise full

    monkeypatch.setattr(moves, "start_binding", once)
    api.clock.advance(HOUR)
    with pytest.raises(DomainError):
        await api.cp.reconciler.run_once()
    assert (0, {}) == (api.cp.reconciler.failures, api.cp.reconciler.set_aside)
    await api.settle()  # the next pass
    assert "binding" == await states_of(api, res["id"])


async def test_a_lapsed_lease_releases_and_renew_moves_the_deadline(api):
    res = (await api.create(key="l", leaseSeconds=60))[1]["reservation"]
    assert res["leaseDeadline"] == T0 + 60_000
    api.clock.advance(50_000)
    renewed = await api.ok("renew", "alice", {"reservationId": res["id"]})
    assert renewed["leaseDeadline"] == T0 + 110_000
    await api.settle(55_000)  # past the first deadline, before the renewed one
    assert await states_of(api, res["id"]) == "binding"
    await api.settle(10_000)
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert (got["state"], got["reason"]) == ("released", "lease-lapsed")
    assert "reservation.renewed" not in await event_types(api, res["id"])  # renewing emits no event


async def test_renew_needs_a_lease_and_a_live_state(api):
    plain = (await api.create(key="p"))[1]["reservation"]
    status, doc = await api.call("renew", "alice", {"reservationId": plain["id"]})
    assert (status, doc["error"]["code"]) == (409, "INVALID_STATE")
    await api.ok("release", "alice", {"reservationId": plain["id"]})
    await api.create(key="full", gpuCount=8, nodeCount=2, durationHours=3)
    pending = (await api.create(key="q", leaseSeconds=60))[1]["reservation"]
    assert pending["state"] == "pending"
    status, doc = await api.call("renew", "alice", {"reservationId": pending["id"]})
    assert (status, doc["error"]["code"]) == (409, "INVALID_STATE")


async def test_a_pending_fixed_window_whose_end_passed_is_cancelled_as_expired(api):
    await api.create(key="full", gpuCount=8, nodeCount=2, durationHours=3)
    late = (await api.create(key="late", start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    assert late["state"] == "pending"
    await api.settle(2 * HOUR)
    got = await api.ok("get", "alice", {"reservationId": late["id"]})
    assert (got["state"], got["reason"]) == ("cancelled", "expired")
    assert api.cp.store.operation(late["operation"]["id"]).failure.actor == "provider"


async def test_pending_is_retried_every_30_seconds(api):
    cp = api.cp
    catalog = cp.catalog.current
    lost = {k: dataclasses.replace(v, schedulable=False) if k == "h1" else v for k, v in catalog.nodes.items()}
    cp.catalog.current = catalog.with_changes(nodes=lost)
    await api.create(key="full", gpuCount=8, durationHours=5)  # h2 is full, h1 is lost
    res = (await api.create(key="r"))[1]["reservation"]
    assert res["state"] == "pending"
    cp.catalog.current = catalog  # h1 comes back without any event
    await api.settle(29_000)
    assert await states_of(api, res["id"]) == "pending"
    await api.settle(1_000)
    assert await states_of(api, res["id"]) in ("placed", "binding")


async def test_the_window_end_frees_capacity_for_pending_at_once(api):
    await api.create(key="full", gpuCount=8, nodeCount=2, durationHours=1)
    waiting = (await api.create(key="w", durationHours=1))[1]["reservation"]
    await api.settle(HOUR)
    got = await api.ok("get", "alice", {"reservationId": waiting["id"]})
    assert got["state"] in ("placed", "binding") and got["start"] == T0 + HOUR


async def test_two_reconcilers_at_once_move_each_reservation_once(api):
    ids = [(await api.create(key=f"r{i}", start=T0 + MIN, end=T0 + 2 * MIN))[1]["reservation"]["id"] for i in range(5)]
    cp = api.cp
    other = Reconciler(cp.store, cp.clock, cp.state, cp.moves)
    api.clock.advance(MIN)
    await asyncio.gather(cp.reconciler.run_once(), other.run_once(), cp.reconciler.run_once())
    events = await api.events()
    assert sorted(e["reservationId"] for e in events if e["type"] == "reservation.binding") == sorted(ids)


# ---- placers ------------------------------------------------------------------------------

async def test_a_request_that_is_not_spot_preempts_only_the_spot_work_it_needs(api):
    spots = [(await api.create(key=f"s{i}", gpuCount=4, spot=True))[1]["reservation"] for i in range(4)]
    assert all(s["state"] == "placed" for s in spots)
    res = (await api.create(key="firm", gpuCount=4))[1]["reservation"]
    assert res["state"] == "placed"
    states = {s["id"]: await states_of(api, s["id"]) for s in spots}
    assert sorted(states.values()) == ["placed", "placed", "placed", "released"]
    victim = next(rid for rid, st in states.items() if st == "released")
    got = await api.ok("get", "alice", {"reservationId": victim})
    assert got["reason"] == "preempted"
    events = await api.events()
    assert any(e["type"] == "reservation.released" and e["reservationId"] == victim and e["data"]["reason"] == "preempted"
               for e in events)
    assert api.cp.state.ledger.usage("acme")["gpu:H100_80GB"] == 16  # the victim's 4 were refunded
    assert api.cp.state.calendar.overlaps() == []


async def test_spot_does_not_preempt_spot(api):
    for i in range(4):
        await api.create(key=f"s{i}", gpuCount=4, spot=True)
    res = (await api.create(key="another-spot", gpuCount=4, spot=True))[1]["reservation"]
    assert res["state"] == "pending"


async def test_pool_lease_queues_in_order_and_places_as_capacity_frees(api, bootstrap_file):
    cp = api.cp
    mig = cp.catalog.current.pools["mig"]
    acme = cp.catalog.current.tenants["acme"]
    cp.catalog.current = cp.catalog.current.with_changes(
        pools={**cp.catalog.current.pools, "mig": dataclasses.replace(mig, policy=dataclasses.replace(mig.policy, placer="pool-lease"))},
        tenants={**cp.catalog.current.tenants, "acme": dataclasses.replace(acme, quota={**acme.quota, "gpu:A100_80GB:1g.10gb": 100})},
    )
    body = dict(poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb")
    first = (await api.create(key="a", gpuCount=7, **body))[1]["reservation"]
    second = (await api.create(key="b", gpuCount=5, **body))[1]["reservation"]
    assert (first["state"], second["state"]) == ("placed", "placed")
    big = (await api.create(key="big", gpuCount=6, **body))[1]["reservation"]
    small = (await api.create(key="small", gpuCount=1, **body))[1]["reservation"]
    assert big["state"] == small["state"] == "pending"
    assert [c["type"] for c in big["conditions"]] == ["Queued"] and "number 1" in big["conditions"][0]["message"]
    assert "number 2" in small["conditions"][0]["message"]
    assert "reservation.queued" in await event_types(api, big["id"])
    await api.ok("release", "alice", {"reservationId": second["id"]})  # 5 free: small fits, but big is first
    await api.settle()
    assert (await states_of(api, big["id"]), await states_of(api, small["id"])) == ("pending", "pending")
    await api.ok("release", "alice", {"reservationId": first["id"]})
    await api.settle()
    assert {await states_of(api, big["id"]), await states_of(api, small["id"])} == {"binding"}  # placed, then started


async def test_wait_holds_the_answer_while_queued_and_a_timeout_returns_it_queued(api):
    full = (await api.create(key="full", gpuCount=8, nodeCount=2))[1]["reservation"]
    t = asyncio.get_running_loop().time()
    status, doc = await api.create(key="w1", wait={"timeoutMs": 200})
    assert status == 202 and doc["reservation"]["state"] == "pending"
    assert asyncio.get_running_loop().time() - t >= 0.19

    async def release_soon():
        await asyncio.sleep(0.1)
        await api.ok("release", "alice", {"reservationId": full["id"]})

    task = asyncio.ensure_future(release_soon())
    status, doc = await api.create(key="w2", wait={"timeoutMs": 5000})
    await task
    assert status == 202 and doc["reservation"]["state"] == "placed"


# ---- extend --------------------------------------------------------------------------------

async def test_extend_by_and_until_move_the_end_and_say_so(api):
    res = (await api.create(key="e"))[1]["reservation"]
    doc = await api.ok("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    assert (doc["end"], doc["operation"]["kind"]) == (T0 + 2 * HOUR, "extend")
    status, full = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    assert full["extended"] is True and full["reservation"]["end"] == T0 + 3 * HOUR
    assert full["reservation"]["operation"]["kind"] == "extend"
    status, again = await api.call("extend", "alice", {"reservationId": res["id"], "until": T0 + 3 * HOUR})
    assert (again["extended"], again["reservation"]["end"]) == (False, T0 + 3 * HOUR)  # a repeated until is safe
    ends = [e["data"]["end"] for e in await api.events() if e["type"] == "reservation.extended"]
    assert ends == [T0 + 2 * HOUR, T0 + 3 * HOUR]
    rows = api.rows("SELECT end_ms FROM bookings WHERE reservation_id = ?", res["id"])
    assert rows == [(T0 + 3 * HOUR,)]


async def test_extend_is_all_or_nothing_when_another_booking_starts_before_the_new_end(api):
    gang = (await api.create(key="g", gpuCount=8, nodeCount=2))[1]["reservation"]
    await api.create(key="next", gpuCount=1, start=T0 + 3 * HOUR, end=T0 + 4 * HOUR)
    status, doc = await api.call("extend", "alice", {"reservationId": gang["id"], "until": T0 + 5 * HOUR})
    assert status == 202 and doc["extended"] is False and doc["availableUntil"] == T0 + 3 * HOUR
    assert (T0 + HOUR, "no-room") == (doc["reservation"]["end"], doc["reason"])
    status, doc = await api.call("extend", "alice", {"reservationId": gang["id"], "until": T0 + HOUR // 2})
    assert (202, False, "already-reached") == (status, doc["extended"], doc["reason"])  # earlier: nothing moves
    got = await api.ok("get", "alice", {"reservationId": gang["id"]})
    assert got["operation"] == doc["reservation"]["operation"] is not None  # its latest operation, never null
    ok = await api.ok("extend", "alice", {"reservationId": gang["id"], "until": T0 + 3 * HOUR})
    assert ok["end"] == T0 + 3 * HOUR


async def test_extend_needs_exactly_one_of_until_or_by_and_a_live_state(api):
    res = (await api.create(key="e"))[1]["reservation"]
    for body in ({}, {"until": T0 + 2 * HOUR, "by": HOUR}):
        status, doc = await api.call("extend", "alice", {"reservationId": res["id"], **body})
        assert (status, doc["error"]["code"]) == (400, "INVALID_INPUT")
    await api.ok("release", "alice", {"reservationId": res["id"]})
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    assert (status, doc["error"]["code"]) == (409, "INVALID_STATE")


async def test_a_policy_that_caps_duration_caps_extensions_and_the_refusal_clears_the_change(api):
    res = (await api.create(key="e", durationHours=160))[1]["reservation"]
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": 9 * HOUR})
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    stored = api.cp.store.reservation(res["id"])
    assert stored.pending_change is None and stored.end == T0 + 160 * HOUR
    ok = await api.ok("extend", "alice", {"reservationId": res["id"], "by": 8 * HOUR})
    assert ok["end"] == T0 + 168 * HOUR


async def test_extend_is_spend_limited_like_create(api):
    res = (await api.create(key="b", poolId="budget"))[1]["reservation"]
    api.cp.billing.spent_usd = lambda tenant: Decimal("100")
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    assert (status, doc["error"]["code"]) == (402, "SPEND_LIMIT_REACHED")


async def test_a_second_extend_while_one_is_decided_is_conflict(api):
    res = (await api.create(key="e"))[1]["reservation"]
    authorizer = api.cp.reservations.authorizer
    real = authorizer.decide

    async def slow(request):
        await asyncio.sleep(0.3)
        return await real(request)

    authorizer.decide = slow
    try:
        first = asyncio.ensure_future(api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR}))
        await asyncio.sleep(0.1)
        status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
        assert (status, doc["error"]["code"], doc["error"]["details"]["reason"]) == (409, "CONFLICT", "extend-in-flight")
        assert doc["error"]["details"]["retryAfterSeconds"] >= 1
        # an until the reservation already reaches is answered without a decision, in flight or not (seed 000:
        # "so a retried until is safe")
        status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "until": res["end"]})
        assert (status, doc["extended"], doc.get("reason")) == (202, False, "already-reached"), doc
        status, done = await first
        assert done["extended"] is True
    finally:
        authorizer.decide = real


@pytest.mark.parametrize("failure, level, traceback", [
    (lambda: unavailable("the database is unavailable (ConnectionDoesNotExistError); retry shortly"), "warning",
     False),
    (lambda: RuntimeError("a bug"), "error", True),
])
async def test_a_background_pass_the_database_puts_off_is_a_warning_and_a_fault_keeps_its_traceback(
        api, failure, level, traceback):
    """The reconciler's and the node monitor's passes met a database outage as a fault: an error with a traceback
    at every pass (and the tenant's 'retry with the same idempotency key' in the operator's log)."""
    import structlog

    async def fails(*_a, **_kw):
        raise failure()

    cp = api.cp
    cp.reconciler.run_once, cp.nodes.check_lost = fails, fails
    with structlog.testing.capture_logs() as logged:
        tasks = [asyncio.ensure_future(cp.reconciler.run()), asyncio.ensure_future(cp.nodes.run_monitor(0.01))]
        await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for what in ("reconciler pass", "node monitor pass"):
        passes = [e for e in logged if e["event"].startswith(what)]
        assert passes and all(e["log_level"] == level and ("exc_info" in e) == traceback for e in passes), logged


async def test_a_replica_that_does_not_lead_does_not_spin_on_due_timers(api):
    """A replica that does not lead takes no timer off the heap, and a due one made its loop wait 0 s: a core at
    100% on every standby replica once any window started."""
    res = (await api.create(key="due", start=T0 + 60_000, durationHours=1))[1]["reservation"]
    assert res["state"] == "placed"
    api.clock.advance(120_000)  # its start is due; nobody takes it off here
    passes = 0

    def leads() -> bool:
        nonlocal passes
        passes += 1
        return False

    rec = api.cp.reconciler
    rec.leads, rec.tick_s = leads, 0.05
    task = asyncio.ensure_future(rec.run())
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert passes <= 2 * (0.3 / 0.05) + 4, passes  # a tick at a time (leads is asked twice a pass)


async def test_a_failed_pass_that_wakes_the_loop_is_tried_again_a_tick_later_not_at_once(api):
    """A failed commit rebuilds the memory, and the rebuild wakes the reconciler: on a full disk the loop retried
    about 1,200 times a second, each try a whole rebuild."""
    rec = api.cp.reconciler
    tries = 0

    async def fails(*_a, **_kw):
        nonlocal tries
        tries += 1
        rec.wake()  # as the rebuild after a failed commit does
        raise unavailable("the store could not commit: database or disk is full")

    rec.run_once, rec.tick_s = fails, 0.05
    task = asyncio.ensure_future(rec.run())
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert tries <= 0.3 / 0.05 + 2, tries


async def test_closing_the_sqlite_store_while_groups_run_waits_for_the_one_in_flight_and_answers_the_rest(api):
    """A stop (SIGTERM) closed the connection from a worker thread while the loop ran a group on it: two threads
    on one sqlite3 connection, which segfaulted or hung the server. Close now waits for the group in flight, and
    later jobs are answered PROVIDER_UNAVAILABLE."""
    if api.engine != "sqlite":
        pytest.skip("SQLite's writer")
    writer = api.cp.store.writer
    creates = [asyncio.ensure_future(api.create(key=f"c{i}")) for i in range(60)]
    await asyncio.sleep(0.01)
    await asyncio.to_thread(writer.close)
    answers = await asyncio.gather(*creates)
    assert {s for s, _ in answers} <= {202, 503}, answers
    assert all(d["error"]["code"] == "PROVIDER_UNAVAILABLE" for s, d in answers if s == 503)
    status, doc = await api.create(key="after")
    assert (503, "PROVIDER_UNAVAILABLE") == (status, doc["error"]["code"]), doc
