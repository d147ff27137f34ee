"""Operations, quotes, prices, budgets and billing through real HTTP, with the fake clock."""
from __future__ import annotations

import asyncio
from decimal import Decimal

from tests.controlplane.conftest import HOUR, T0
from tests.controlplane.test_nodes import node_call, register


async def make_active(api, **fields) -> dict:
    """Create a reservation starting now and have its nodes' agents report it bound."""
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(**fields))[1]["reservation"]
    await api.settle()
    for p in res["placements"]:
        await node_call(api, "report", nodes[p["nodeId"]]["nodeToken"],
                        {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert got["state"] == "active"
    return got


async def usage(api, who="alice", **body) -> dict:
    status, doc = await api.post("/api/compute/usage/list", who, body)
    assert status == 200, doc
    return doc


# ---- operations -----------------------------------------------------------------------

async def test_operation_get_and_wait_follow_the_create_to_active(api):
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="op", gpuCount=2))[1]["reservation"]
    op_id = res["operation"]["id"]
    status, doc = await api.post("/api/compute/operations/get", "alice", {"operationId": op_id})
    assert doc["operation"]["status"] == "running" and doc["operation"]["kind"] == "create"
    status, doc = await api.post("/api/compute/operations/wait", "alice", {"operationId": op_id, "timeoutMs": 100})
    assert status == 200 and doc["done"] is False  # a bounded wait returns it unfinished

    async def bind_soon():
        await asyncio.sleep(0.1)
        await api.settle()
        node = nodes[res["placements"][0]["nodeId"]]
        await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "bound"}]})

    task = asyncio.ensure_future(bind_soon())
    status, doc = await api.post("/api/compute/operations/wait", "alice", {"operationId": op_id, "timeoutMs": 5000})
    await task
    assert doc["done"] is True and doc["operation"]["status"] == "succeeded"
    status, doc = await api.post("/api/compute/operations/get", "carol", {"operationId": op_id})
    assert status == 404  # another tenant's


async def test_a_refused_create_has_no_operation_and_a_cancelled_one_says_who(api):
    status, doc = await api.create(key="huge", gpuCount=9)
    assert status == 409 and "reservationId" not in doc["error"]["details"]
    res = (await api.create(key="c", start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    await api.ok("cancel", "alice", {"reservationId": res["id"]})
    status, doc = await api.post("/api/compute/operations/get", "alice", {"operationId": res["operation"]["id"]})
    assert doc["operation"]["status"] == "cancelled" and doc["operation"]["failure"]["actor"] == "customer"


async def test_an_extension_a_release_overtook_before_the_nodes_applied_it_is_cancelled_not_succeeded(api):
    res = await make_active(api, key="x", gpuCount=1, durationHours=1)
    ext = (await api.ok("extend", "alice", {"reservationId": res["id"], "by": HOUR}))["operation"]
    assert (ext["kind"], ext["status"]) == ("extend", "running")  # the node has not applied the new end
    await api.ok("release", "alice", {"reservationId": res["id"]})
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    node = nodes[res["placements"][0]["nodeId"]]  # its agent reports the devices unbound
    await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "unbound"}]})
    assert (await api.ok("get", "alice", {"reservationId": res["id"]}))["operation"]["status"] == "succeeded"
    status, doc = await api.post("/api/compute/operations/get", "alice", {"operationId": ext["id"]})
    op = doc["operation"]
    assert (op["status"], op["errorMessage"], op["failure"]["actor"]) == (
        "cancelled", "reservation_ended:release", "customer"), op


# ---- quotes and prices ------------------------------------------------------------------

async def quote(api, who="alice", **fields):
    body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 2, "durationHours": 3, **fields}
    return await api.call("quote", who, body)


async def test_a_quote_prices_the_request_and_holds_nothing(api):
    status, doc = await quote(api)
    q = doc["quote"]
    assert q["totalRunningUsdPerHour"] == "5.000000" and q["totalUsd"] == "15.000000"
    assert q["expiresAt"] == T0 + 120_000 and q["fitsNow"] is True and q["earliestStart"] == T0
    assert api.cp.state.calendar.by_reservation == {} and api.cp.state.ledger.usage("acme") == {}
    status, doc = await api.create(key="q", gpuCount=2, durationHours=3, quoteId=q["id"])
    assert status == 202


async def test_a_quote_answers_what_the_create_would_preemption_iam_and_quota_included(api):
    spots = [(await api.create(key=f"s{i}", gpuCount=4, spot=True))[1]["reservation"] for i in range(4)]
    assert all(s["state"] == "placed" for s in spots)  # the pool's 16 GPUs are taken by spot work
    q = (await quote(api, gpuCount=4))[1]["quote"]
    assert (True, T0, 1) == (q["fitsNow"], q["earliestStart"], q["preemptsSpot"])  # a create would preempt one
    assert [] == api.cp.state.calendar.overlaps() and all(
        api.cp.state.calendar.bookings_of(s["id"]) for s in spots)  # the dry run put every victim back
    spot_q = (await quote(api, gpuCount=4, spot=True))[1]["quote"]
    assert (False, 0) == (spot_q["fitsNow"], spot_q["preemptsSpot"])  # spot does not preempt spot
    res = (await api.create(key="firm", gpuCount=4))[1]["reservation"]
    assert "placed" == res["state"] and res["start"] == q["earliestStart"]
    assert {"required": False, "approver": None} == q["confirmation"]
    # IAM as a dry run: the week cap refuses a quote as it refuses the create; the agent's large ask needs alice
    status, doc = await quote(api, durationHours=200)
    assert (403, "ACCESS_DENIED", "max-week") == (status, doc["error"]["code"], doc["error"]["details"]["policy"])
    status, doc = await quote(api, "agent", gpuCount=4)
    assert 200 == status and {"required": True, "approver": "alice"} == doc["quote"]["confirmation"]
    assert [] == api.cp.store.confirmations("acme", None, None, None, 10)  # none opened
    status, doc = await quote(api, gpuCount=1, resources={"vcpu": 60})
    assert (429, "QUOTA_EXCEEDED") == (status, doc["error"]["code"])  # as the create would answer
    # a price ceiling below the price: NO_CAPACITY price_ceiling, as the create answers it
    status, doc = await quote(api, gpuCount=1, maxHourlyPrice="0.010000")
    created = await api.create(key="ceiling", gpuCount=1, maxHourlyPrice="0.010000")
    assert (409, "NO_CAPACITY", "price_ceiling") == (status, doc["error"]["code"], doc["error"]["details"]["reason"])
    assert doc["error"]["details"]["cheapestEligibleUsdPerHour"] == created[1]["error"]["details"]["cheapestEligibleUsdPerHour"]
    assert 200 == (await quote(api, gpuCount=1, maxHourlyPrice="1000"))[0]  # at or above the price: priced


async def test_a_changed_priced_field_or_price_is_price_changed(api):
    q = (await quote(api))[1]["quote"]
    status, doc = await api.create(key="a", gpuCount=3, durationHours=3, quoteId=q["id"])
    assert (status, doc["error"]["code"]) == (409, "PRICE_CHANGED") and doc["error"]["details"]["changed"] == ["gpuCount"]
    import dataclasses
    cp = api.cp
    pool = cp.catalog.current.pools["h100"]
    cp.catalog.current = cp.catalog.current.with_changes(
        pools={**cp.catalog.current.pools, "h100": dataclasses.replace(pool, price_per_gpu_hour=Decimal("2.75"))})
    status, doc = await api.create(key="b", gpuCount=2, durationHours=3, quoteId=q["id"])
    assert doc["error"]["code"] == "PRICE_CHANGED" and doc["error"]["details"]["totalRunningUsdPerHour"] == "5.500000"


async def test_a_create_that_restates_what_its_quote_said_is_not_price_changed(api):
    """Priced fields are compared as admission reads them: the pool's own sharing, the quote's own resources and
    resources below the per-GPU share (or {}) book what the quote priced."""
    q = (await quote(api))[1]["quote"]
    for i, same in enumerate(({"sharing": "exclusive"}, {"resources": q["resources"]}, {"resources": {}},
                              {"resources": {"vcpu": 1}}, {"binding": "hold", "nodeCount": 1, "spot": False})):
        status, doc = await api.create(key=f"same{i}", gpuCount=2, durationHours=3, quoteId=q["id"], **same)
        assert 202 == status, (same, doc)
        assert 202 == (await api.call("release", "alice", {"reservationId": doc["reservation"]["id"]}))[0]
    # the quote keeps the fields as they were sent, the shape a replica of the previous release compares
    import json
    stored = json.loads(api.cp.store.quote(q["id"])[2])["priced"]
    assert (None, None, 2) == (stored["sharing"], stored["resources"], stored["gpuCount"])
    # fewer GPUs change gpuCount alone (the share follows it); more than the share changes what is booked and its price
    status, doc = await api.create(key="fewer", gpuCount=1, durationHours=3, quoteId=q["id"], sharing="exclusive")
    assert (409, "PRICE_CHANGED", ["gpuCount"]) == (status, doc["error"]["code"], doc["error"]["details"]["changed"])
    more = {k: v * 2 for k, v in q["resources"].items() if k != "hugepages1Gi"}
    status, doc = await api.create(key="more", gpuCount=2, durationHours=3, quoteId=q["id"], resources=more)
    assert (409, "PRICE_CHANGED") == (status, doc["error"]["code"]) and "resources" in doc["error"]["details"]["changed"]


async def test_an_expired_or_unknown_quote_is_quote_expired(api):
    q = (await quote(api))[1]["quote"]
    api.clock.advance(120_001)
    status, doc = await api.create(key="a", gpuCount=2, durationHours=3, quoteId=q["id"])
    assert (status, doc["error"]["code"]) == (410, "QUOTE_EXPIRED")
    status, doc = await api.create(key="b", gpuCount=2, durationHours=3, quoteId="qt_nope")
    assert doc["error"]["code"] == "QUOTE_EXPIRED"
    status, doc = await api.create("carol", key="c", gpuCount=2, durationHours=3, quoteId=q["id"])
    assert doc["error"]["code"] == "QUOTE_EXPIRED"  # another tenant's quote


async def test_a_price_ceiling_below_the_price_is_no_capacity_with_the_cheapest_eligible_rate(api):
    status, doc = await api.create(key="a", gpuCount=2, maxHourlyPrice="4.000000")
    err = doc["error"]
    assert (status, err["code"], err["details"]["reason"]) == (409, "NO_CAPACITY", "price_ceiling")
    # the cheapest rate at which THIS request (pool h100, 2 x 2.50) is accepted; cheaper pools are alternatives
    assert err["details"]["cheapestEligibleUsdPerHour"] == "5.000000"
    alts = err["details"]["alternatives"]
    assert [a["poolId"] for a in alts] == ["budget", "k8s"]  # cheapest first (the budget pool is free)
    assert alts[0]["region"] == "eu" and "totalRunningUsdPerHour" in alts[0]
    assert err["details"]["earliestStart"] == T0
    status, doc = await api.create(key="b", gpuCount=2, maxHourlyPrice="5.000000")
    assert status == 202
    status, doc = await api.create(key="c", gpuCount=2, maxHourlyPrice="5.0000001")
    assert (status, doc["error"]["details"]["field"]) == (400, "maxHourlyPrice")


async def test_no_capacity_says_the_earliest_start_in_the_asked_pool(api):
    await api.create(key="full", gpuCount=8, nodeCount=2, durationHours=2)
    status, doc = await api.create(key="a", gpuCount=2, maxHourlyPrice="1.000000")
    assert doc["error"]["details"]["earliestStart"] == T0 + 2 * HOUR
    q = (await quote(api))[1]["quote"]
    assert (q["fitsNow"], q["earliestStart"]) == (False, T0 + 2 * HOUR)


# ---- billing ---------------------------------------------------------------------------------

async def test_billing_runs_from_active_to_release_prorated_to_the_second(api):
    res = await make_active(api, key="b", gpuCount=2, durationHours=2)  # 2 x 2.5 USD/h
    api.clock.advance(90 * 60_000 + 1_500)  # 1.5 h and 1.5 s
    await api.ok("release", "alice", {"reservationId": res["id"]})
    api.clock.advance(HOUR)  # nothing accrues after the release
    doc = await usage(api)
    [line] = doc["lines"]
    assert line["seconds"] == 5401 and line["amountUsd"] == "7.501389" and doc["totalUsd"] == "7.501389"


async def test_a_lease_that_lapsed_while_nobody_looked_bills_until_its_deadline(api):
    """A control plane that was down when a lease lapsed sees the lapse at its restart: billing stops at the
    deadline, as it stops at a window's end seen late, not at the moment the lapse was seen."""
    res = await make_active(api, key="lease", gpuCount=1, durationHours=2, leaseSeconds=60)
    bound_at = api.clock.now_ms
    api.clock.advance(45 * 60_000)  # nobody ran the timers meanwhile
    await api.settle()
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert (got["state"], got["reason"]) == ("released", "lease-lapsed")
    [line] = (await usage(api))["lines"]
    assert (line["from"], line["to"]) == (bound_at, res["leaseDeadline"]) and line["seconds"] == 60


async def test_a_create_that_never_became_active_bills_nothing(api):
    res = (await api.create(key="n", start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    await api.settle(3 * HOUR)  # declared nodes: bound never, released at the end
    assert (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"] == "released"
    doc = await usage(api)
    assert doc["lines"] == [] and doc["totalUsd"] == "0.000000"


async def test_usage_lines_per_reservation_and_day_add_up_to_the_cent_and_page(api):
    start = T0 - T0 % 86_400_000 + 86_400_000 - 30 * 60_000  # 23:30 UTC
    api.clock.now_ms = start
    a = await make_active(api, key="a", gpuCount=1, durationHours=3)
    b = (await api.create(key="b", gpuCount=3, durationHours=3))[1]["reservation"]
    await api.settle()
    node = await register(api, "h1.test") if b["placements"][0]["nodeId"] == "h1" else await register(api, "h2.test")
    await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": b["id"], "status": "bound"}]})
    api.clock.advance(2 * HOUR + 17_000)
    doc = await usage(api)
    assert len(doc["lines"]) == 4  # two reservations over two UTC days
    assert Decimal(doc["totalUsd"]) == sum(Decimal(line["amountUsd"]) for line in doc["lines"])
    assert sum(Decimal(r["totalUsd"]) for r in doc["byReservation"]) == Decimal(doc["totalUsd"])
    pages, cursor = [], None
    while True:
        page = await usage(api, limit=1, **({"cursor": cursor} if cursor else {}))
        pages += page["lines"]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert pages == doc["lines"]
    only_a = await usage(api, reservationId=a["id"])
    assert {line["reservationId"] for line in only_a["lines"]} == {a["id"]}
    day = start - start % 86_400_000
    status, refused = await api.post("/api/compute/usage/list", "alice", {"since": day, "until": day})
    assert (400, "until") == (status, refused["error"]["details"]["field"])  # an empty range is a mistake, said so


# ---- budgets --------------------------------------------------------------------------------------

async def test_spent_budget_is_spend_limit_reached_and_an_uncoverable_exposure_insufficient_funds(api):
    # the budget pool checks budgets; acme has 100 USD. It is free, so price it at 10 USD per GPU-hour.
    import dataclasses
    cp = api.cp
    pool = cp.catalog.current.pools["budget"]
    cp.catalog.current = cp.catalog.current.with_changes(
        pools={**cp.catalog.current.pools, "budget": dataclasses.replace(pool, price_per_gpu_hour=Decimal("10"))})
    status, doc = await api.create(key="big", poolId="budget", gpuCount=2, durationHours=6)  # 120 USD > 100 left
    assert (status, doc["error"]["code"]) == (402, "INSUFFICIENT_FUNDS")
    assert doc["error"]["details"]["exposureUsd"] == "120.000000"
    status, doc = await api.create(key="ok", poolId="budget", gpuCount=1, durationHours=6)  # 60 USD
    assert status == 202
    status, doc = await api.create(key="more", poolId="budget", gpuCount=1, durationHours=5)  # 50 > 40 left
    assert doc["error"]["code"] == "INSUFFICIENT_FUNDS" and doc["error"]["details"]["committedUsd"] == "60.000000"
    cp.billing.spent_usd = lambda tenant: Decimal("100")
    status, doc = await api.create(key="any", poolId="budget", gpuCount=1, durationHours=1)
    assert (status, doc["error"]["code"]) == (402, "SPEND_LIMIT_REACHED")


async def test_a_window_of_a_fraction_of_a_second_is_quoted_exactly_and_its_exposure_counts_every_tick_it_touches(
        api):
    """Billing counts the clock's whole-second ticks, so 5.9 s from x.100 bills six: the budget check counts six (it
    counted five, and the tenant was billed past its budget), while the quote prorates the 5.9 s exactly."""
    import dataclasses
    cp = api.cp
    pool = cp.catalog.current.pools["budget"]
    cp.catalog.current = cp.catalog.current.with_changes(  # 0.001 USD a second
        pools={**cp.catalog.current.pools, "budget": dataclasses.replace(pool, price_per_gpu_hour=Decimal("3.6"))})
    window = {"poolId": "budget", "gpuCount": 1, "start": T0 + HOUR + 100, "end": T0 + HOUR + 6_000}
    status, doc = await api.call("quote", "alice", {"gpuModel": "H100_80GB", **window})
    assert (status, doc["quote"]["totalUsd"]) == (200, "0.005900"), doc
    cp.billing.spent_usd = lambda tenant: Decimal("100") - Decimal("0.0059")  # 0.0059 left
    status, doc = await api.create(key="frac", **window)
    assert (status, doc["error"]["code"], doc["error"]["details"]["exposureUsd"]) == (
        402, "INSUFFICIENT_FUNDS", "0.006000"), doc
    cp.billing.spent_usd = lambda tenant: Decimal("100") - Decimal("0.006")  # what the six ticks bill
    status, doc = await api.create(key="frac", **window)
    assert status == 202, doc


async def test_a_window_cut_at_midnight_bills_its_whole_time_rounded_once_so_a_budget_it_fills_holds(api):
    """4 s across a UTC midnight at 1.333333 USD/h is 0.001481 rounded once, which the budget check counts; each
    day's line rounded on its own billed 0.000741 twice, 0.001482, past the budget the create had exactly filled."""
    import dataclasses
    from tests.controlplane.test_admin_api import ADMIN
    cp = api.cp
    pool = cp.catalog.current.pools["h100"]
    cp.catalog.current = cp.catalog.current.with_changes(pools={**cp.catalog.current.pools, "h100": dataclasses.replace(
        pool, price_per_gpu_hour=Decimal("1.333333"), policy=dataclasses.replace(pool.policy, budget_check=True))})
    status, doc = await api.post("/api/admin/tenants/budget", ADMIN, {"tenantId": "acme", "budgetUsd": "0.001481"})
    assert status == 200, doc
    midnight = T0 - T0 % 86_400_000 + 86_400_000
    api.clock.now_ms = midnight - 2_000
    status, quoted = await api.call("quote", "alice", {"gpuModel": "H100_80GB", "poolId": "h100", "gpuCount": 1,
                                                       "start": midnight - 2_000, "end": midnight + 2_000})
    assert (status, quoted["quote"]["totalUsd"]) == (200, "0.001481"), quoted
    res = await make_active(api, key="m", poolId="h100", gpuCount=1, start=midnight - 2_000, end=midnight + 2_000)
    await api.settle(10_000)
    doc = await usage(api)
    assert [(line["seconds"], line["amountUsd"]) for line in doc["lines"]] == [(2, "0.000741"), (2, "0.000740")]
    assert doc["totalUsd"] == "0.001481" == quoted["quote"]["totalUsd"]
    assert (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"] == "released"
    status, refused = await api.create(key="more", poolId="h100", gpuCount=1, durationHours=1)
    assert (status, refused["error"]["code"]) == (402, "SPEND_LIMIT_REACHED"), refused


async def test_a_lease_that_lapsed_before_the_devices_were_reported_bound_bills_nothing_and_ends_no_earlier(api):
    """A restarted control plane may hear an agent's bound report before its reconciler ends an already lapsed
    lease: billing then begins after the deadline, and the line must not end before it begins."""
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="late", gpuCount=1, durationHours=2, leaseSeconds=60))[1]["reservation"]
    await api.settle()  # binding
    api.clock.advance(120_000)  # past the deadline, no timer run yet
    await node_call(api, "report", nodes[res["placements"][0]["nodeId"]]["nodeToken"],
                    {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    await api.settle()
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert (got["state"], got["reason"]) == ("released", "lease-lapsed")
    stored = api.cp.store.reservation(res["id"])
    assert stored.billing_start is not None and stored.billing_end == stored.billing_start  # not before it
    assert [] == (await usage(api))["lines"]
