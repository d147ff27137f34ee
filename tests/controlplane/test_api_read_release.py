"""get, list, release, cancel and the events list through real HTTP."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.controlplane.conftest import HOUR, T0


async def test_get_returns_the_reservation_with_its_operation(api):
    rid = (await api.create(key="a"))[1]["reservation"]["id"]
    res = await api.ok("get", "alice", {"reservationId": rid})
    assert res["id"] == rid and res["operation"]["kind"] == "create"


async def test_get_is_not_found_for_drafts_and_other_tenants(api):
    rid = (await api.create(key="a"))[1]["reservation"]["id"]
    status, doc = await api.call("get", "carol", {"reservationId": rid})
    assert (status, doc["error"]["code"]) == (404, "NOT_FOUND")
    _, doc = await api.create("robot", key="refused", gpuCount=4)  # stays a refused draft
    assert "reservationId" not in doc["error"]["details"]  # a synchronous refusal names no resource
    from controlplane.domain.ids import reservation_id
    draft_id = reservation_id("acme", "robot", "refused")
    status, doc = await api.call("get", "alice", {"reservationId": draft_id})
    assert status == 404


async def test_get_is_access_denied_where_policy_forbids_reading(api):
    rid = (await api.create("alice", key="a"))[1]["reservation"]["id"]
    status, doc = await api.call("get", "bob", {"reservationId": rid})
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")


async def test_list_is_newest_first_pages_with_a_cursor_and_skips_drafts(api):
    ids = []
    for i in range(7):
        ids.append((await api.create(key=f"r{i}", start=T0 + i * HOUR, end=T0 + i * HOUR + HOUR))[1]["reservation"]["id"])
    await api.create("robot", key="refused", gpuCount=4)  # a draft of alice's agent: never listed
    seen, cursor = [], None
    while True:
        body = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = await api.ok("list", "alice", body)
        seen += [r["id"] for r in page["reservations"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]


async def test_list_is_stable_under_concurrent_inserts(api):
    for i in range(4):
        await api.create(key=f"r{i}", start=T0 + i * HOUR, end=T0 + i * HOUR + HOUR)
    page1 = await api.ok("list", "alice", {"limit": 2})
    await api.create(key="new", start=T0 + 9 * HOUR, end=T0 + 10 * HOUR)
    page2 = await api.ok("list", "alice", {"limit": 2, "cursor": page1["nextCursor"]})
    assert page2["nextCursor"] is None
    assert len({r["id"] for r in page1["reservations"] + page2["reservations"]}) == 4


async def test_list_filters_by_state_and_pool(api):
    await api.create(key="h", gpuCount=8, nodeCount=2)
    await api.create(key="p")  # pending: the pool is full
    await api.create(key="m", poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb")
    pending = await api.ok("list", "alice", {"state": "pending"})
    assert [r["state"] for r in pending["reservations"]] == ["pending"]
    mig = await api.ok("list", "alice", {"poolId": "mig"})
    assert [r["poolId"] for r in mig["reservations"]] == ["mig"]
    status, doc = await api.call("list", "alice", {"state": "draft"})
    assert (status, doc["error"]["details"]["field"]) == (400, "state")


async def test_scope_mine_lists_the_callers_own_and_scope_all_checks_each_item(api):
    await api.create("alice", key="a")
    await api.create("bob", key="b")
    mine = await api.ok("list", "bob", {})
    assert [r["principalId"] for r in mine["reservations"]] == ["bob"]
    everyone = await api.ok("list", "alice", {"scope": "all"})
    assert sorted(r["principalId"] for r in everyone["reservations"]) == ["alice", "bob"]
    bob_all = await api.ok("list", "bob", {"scope": "all"})  # bob may not read alice's
    assert [r["principalId"] for r in bob_all["reservations"]] == ["bob"]


@pytest.mark.parametrize("limit", [0, 201, "x"])
async def test_list_limit_is_1_to_200(api, limit):
    status, doc = await api.call("list", "alice", {"limit": limit})
    assert (status, doc["error"]["details"]["field"]) == (400, "limit")


async def test_release_ends_bookings_now_refunds_quota_and_wakes_pending(api):
    big = (await api.create(key="big", gpuCount=8, nodeCount=2))[1]["reservation"]
    waiting = (await api.create(key="wait", gpuCount=2))[1]["reservation"]
    assert waiting["state"] == "pending"
    api.clock.advance(10 * 60_000)
    res = await api.ok("release", "alice", {"reservationId": big["id"]})
    assert (res["state"], res["reason"]) == ("released", "release")
    assert (big["endedAt"], res["endedAt"]) == (None, T0 + 10 * 60_000)  # when it ended; `end` stays the window's
    assert res["end"] == big["end"]
    # a gang is seed 002's cluster: its operations are cluster_create and cluster_terminate
    assert big["operation"]["kind"] == "cluster_create"
    assert res["operation"]["kind"] == "cluster_terminate" and res["operation"]["status"] == "succeeded"
    await api.cp.reconciler.drain()
    woken = await api.ok("get", "alice", {"reservationId": waiting["id"]})
    assert woken["state"] == "placed" and woken["conditions"] == []
    assert api.cp.state.ledger.usage("acme")["gpu:H100_80GB"] == 2
    rows = api.rows("SELECT end_ms FROM bookings WHERE reservation_id = ?", big["id"])
    assert {r[0] for r in rows} == {T0 + 10 * 60_000}
    types = [e["type"] for e in await api.events()]
    assert types == ["reservation.placed", "reservation.pending", "reservation.released", "reservation.placed"]


async def test_release_of_a_pending_reservation_cancels_it_with_reason_release(api):
    await api.create(key="big", gpuCount=8, nodeCount=2)
    rid = (await api.create(key="wait"))[1]["reservation"]["id"]
    res = await api.ok("release", "alice", {"reservationId": rid})
    assert (res["state"], res["reason"]) == ("cancelled", "release")
    events = await api.events()
    assert events[-1]["type"] == "reservation.cancelled" and events[-1]["data"]["reason"] == "release"


async def test_release_of_a_terminal_reservation_returns_it_unchanged(api):
    rid = (await api.create(key="a"))[1]["reservation"]["id"]
    first = await api.ok("release", "alice", {"reservationId": rid})
    api.clock.advance(1000)
    again = await api.ok("release", "alice", {"reservationId": rid})
    assert first == again
    assert [e["type"] for e in await api.events()].count("reservation.released") == 1


async def test_release_of_a_draft_is_invalid_state(api):
    await api.create("robot", key="refused", gpuCount=4)
    from controlplane.domain.ids import reservation_id
    status, doc = await api.call("release", "robot", {"reservationId": reservation_id("acme", "robot", "refused")})
    assert (status, doc["error"]["code"]) == (409, "INVALID_STATE")


async def test_release_of_a_future_booking_frees_it_entirely(api):
    future = (await api.create(key="f", gpuCount=8, nodeCount=2, start=T0 + 5 * HOUR, end=T0 + 6 * HOUR))[1]["reservation"]
    await api.ok("release", "alice", {"reservationId": future["id"]})
    again = (await api.create(key="g", gpuCount=8, nodeCount=2, start=T0 + 5 * HOUR, end=T0 + 6 * HOUR))[1]["reservation"]
    assert again["state"] == "placed"


async def test_cancel_withdraws_pending_or_placed_and_refunds(api):
    placed = (await api.create(key="p", gpuCount=8, nodeCount=2, start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    res = await api.ok("cancel", "alice", {"reservationId": placed["id"]})
    assert (res["state"], res["reason"], res["endedAt"]) == ("cancelled", "cancel", T0)
    # one that ended before the moment was stored (or an older replica rewrote it) answers its last change
    from controlplane.schemas import reservation_to_wire
    import dataclasses
    older = dataclasses.replace(api.cp.store.reservation(placed["id"]), ended_at=None)
    assert T0 == reservation_to_wire(older, None)["endedAt"] == older.updated_at
    assert res["operation"]["kind"] == "cluster_terminate"  # a gang's cancel terminates the cluster too
    create_op = api.cp.store.operation(placed["operation"]["id"])
    assert create_op.kind == "create"  # stored under the kind every release reads; a cluster's on the wire only
    assert create_op.status == "cancelled" and create_op.failure.actor == "customer"
    assert api.cp.state.ledger.usage("acme")["gpu:H100_80GB"] == 0
    again = await api.ok("cancel", "alice", {"reservationId": placed["id"]})
    assert again == res


async def test_cancel_of_a_released_reservation_is_invalid_state_and_drafts_are_not_found(api):
    rid = (await api.create(key="a"))[1]["reservation"]["id"]
    await api.ok("release", "alice", {"reservationId": rid})
    status, doc = await api.call("cancel", "alice", {"reservationId": rid})
    assert (status, doc["error"]["code"]) == (409, "INVALID_STATE")
    assert ("released", None) == (doc["error"]["details"]["state"], doc["error"]["details"].get("next"))  # it ended
    assert "use release" not in doc["error"]["message"]
    started = (await api.create(key="b"))[1]["reservation"]["id"]  # starts now: too late to cancel
    status, doc = await api.call("cancel", "alice", {"reservationId": started})
    assert (409, "release") == (status, doc["error"]["details"]["next"])
    await api.create("robot", key="refused", gpuCount=4)
    from controlplane.domain.ids import reservation_id
    status, doc = await api.call("cancel", "robot", {"reservationId": reservation_id("acme", "robot", "refused")})
    assert status == 404


async def test_cancel_and_release_are_decided_as_release(api):
    rid = (await api.create("alice", key="a"))[1]["reservation"]["id"]
    status, doc = await api.call("cancel", "carol", {"reservationId": rid})
    assert status == 404  # another tenant: it does not exist for them


async def test_events_list_pages_after_a_cursor_newest_last(api):
    for i in range(3):
        await api.create(key=f"e{i}")
    events = await api.events()
    assert [e["type"] for e in events] == ["reservation.placed"] * 3
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    later = await api.events(after=events[0]["seq"])
    assert later == events[1:]
    assert await api.events("carol") == []


async def test_unknown_method_and_wrong_verb_answer_with_the_envelope(api):
    status, doc = await api.post("/api/compute/reservations/frobnicate", "alice", {})
    assert (status, doc["error"]["code"]) == (404, "NOT_FOUND")
    resp = await api.client.get("/api/compute/reservations/get", headers={"Authorization": "Bearer token-acme-alice-000001"})
    doc = await resp.json()
    assert (405, "INVALID_INPUT", "POST") == (resp.status, doc["error"]["code"], resp.headers["Allow"])
    assert "GET is not allowed on /api/compute/reservations/get; use POST" == doc["error"]["message"]
    resp = await api.client.post("/healthz")  # a GET route: the answer names GET, not POST
    doc = await resp.json()
    assert (405, True) == (resp.status, doc["error"]["message"].endswith("; use GET or HEAD")), doc
    assert {"GET", "HEAD"} == {m.strip() for m in resp.headers["Allow"].split(",")}


async def test_events_long_poll_answers_when_an_event_is_committed_and_empty_when_the_wait_ends(api):
    _, first = await api.create(key="a")
    cursor = (await api.post("/api/compute/events/list", "alice", {}))[1]["nextCursor"]
    waiting = asyncio.ensure_future(api.post("/api/compute/events/list", "alice", {"after": cursor, "waitMs": 5000}))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await api.call("release", "alice", {"reservationId": first["reservation"]["id"]})
    status, doc = await asyncio.wait_for(waiting, 2)
    assert 200 == status and ["reservation.released"] == [e["type"] for e in doc["events"]]
    # with nothing new, the wait ends empty with the same cursor
    cursor = doc["nextCursor"]
    status, doc = await api.post("/api/compute/events/list", "alice", {"after": cursor, "waitMs": 300})
    assert (200, [], cursor) == (status, doc["events"], doc["nextCursor"])
    status, doc = await api.post("/api/compute/events/list", "alice", {"waitMs": 30_001})
    assert (400, "waitMs") == (status, doc["error"]["details"]["field"])
    # fromEnd: the cursor after the newest event, in one call
    status, doc = await api.post("/api/compute/events/list", "alice", {"fromEnd": True})
    assert (200, [], cursor) == (status, doc["events"], doc["nextCursor"])
    status, doc = await api.post("/api/compute/events/list", "alice", {"fromEnd": True, "after": 1})
    assert (400, "fromEnd") == (status, doc["error"]["details"]["field"])


async def test_a_cursor_past_every_event_numbered_is_refused_at_once_not_waited_on(api):
    _, first = await api.create(key="a")
    events = await api.events()
    newest = events[-1]["seq"]
    # a cursor at the newest, or below, is a cursor this database gave: an empty page, as before
    status, doc = await api.post("/api/compute/events/list", "alice", {"after": newest})
    assert (200, [], newest) == (status, doc["events"], doc["nextCursor"])
    # another tenant's events count too: its cursor is below the numbers handed out, so it is not refused
    status, doc = await api.post("/api/compute/events/list", "carol", {"after": newest})
    assert (200, []) == (status, doc["events"])
    # past it: a cursor from a database that numbered further (an older copy restored, a failover that lost
    # commits). Listing after it would skip every event numbered up to it, so it is refused, even as a long poll
    started = time.monotonic()
    status, doc = await api.post("/api/compute/events/list", "alice", {"after": newest + 5, "waitMs": 5000})
    assert time.monotonic() - started < 2
    assert (400, "INVALID_INPUT", "after", newest) == (status, doc["error"]["code"], doc["error"]["details"]["field"],
                                                       doc["error"]["details"]["newest"])
    assert f"at or below {newest}" in doc["error"]["message"]
    # and the refusal changed nothing: the next event is numbered after the newest and listed after it
    await api.call("release", "alice", {"reservationId": first["reservation"]["id"]})
    assert ["reservation.released"] == [e["type"] for e in await api.events(after=newest)]


async def test_whoami_says_who_the_token_speaks_for_and_nothing_for_an_operator(api):
    assert {"id": "alice", "tenantId": "acme", "kind": "user", "scope": "manage", "delegatedBy": None} == \
        (await api.post("/api/iam/whoami", "alice", {}))[1]["principal"]
    agent = (await api.post("/api/iam/whoami", "agent", {}))[1]["principal"]
    assert ("agent", "alice") == (agent["kind"], agent["delegatedBy"])
    status, doc = await api.post("/api/iam/whoami", "alice", {"x": 1})
    assert (400, "x") == (status, doc["error"]["details"]["field"])
    status, doc = await api.post("/api/iam/whoami", "admin-token-for-tests-0001", {})
    assert (403, "COMPUTE_ACCESS_REQUIRED", "Authorization") == (status, doc["error"]["code"], doc["error"]["details"]["field"])
