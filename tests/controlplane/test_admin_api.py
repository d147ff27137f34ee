"""The operator's admin API through real HTTP: nodes (with real agent inventories), cordon, drain, uncordon, clear,
pools, tenants, the fleet's events, operators decided by Cedar; the tenant's pools with free capacity; the
calendar page's files. Every refusal names the field and the rule, with the documented code."""
from __future__ import annotations

import dataclasses
import re

import pytest

from controlplane.state import WriterState

from tests.controlplane.conftest import HOUR, T0, TOKENS, bootstrap_doc, check_memory
from tests.controlplane.test_fleet import OPERATOR_POLICIES, OPERATORS
from tests.controlplane.test_nodes import inventory, node_call, register

ADMIN = "admin-token-for-tests-0001"
OLGA = OPERATORS[0]["token"]
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


async def admin(api, path: str, body: dict | None = None, who: str = ADMIN):
    return await api.post(f"/api/admin/{path}", who, body or {})


async def ok(api, path: str, body: dict | None = None, who: str = ADMIN) -> dict:
    status, doc = await admin(api, path, body, who)
    assert 200 == status, doc
    return doc


async def add_operators(api) -> None:
    doc = bootstrap_doc()
    doc["principals"] += OPERATORS
    doc["policies"] += OPERATOR_POLICIES
    await ok(api, "bootstrap", doc)


async def test_a_node_shows_its_agent_heartbeat_inventory_identity_and_bookings_now_and_next(api):
    status, reg = await node_call(api, "register", "node-token-h100-000001", {
        "hostname": "h1.test", "inventory": inventory("h1.test"), "agentVersion": "0.1.0", "machineId": "a" * 32})
    assert 200 == status, reg
    api.clock.advance(2_000)
    now = (await api.create(key="now", gpuCount=8))[1]["reservation"]  # fills one node
    later = (await api.create(key="later", gpuCount=2, start=T0 + 5 * HOUR, end=T0 + 6 * HOUR))[1]["reservation"]
    got = (await ok(api, "nodes/get", {"nodeId": "h1"}))["node"]
    assert ("h1", "h100", "h1.test", "ready", "ready", False, True) == (
        got["id"], got["poolId"], got["hostname"], got["state"], got["adminState"], got["lost"], got["placeable"])
    assert ("0.1.0", "a" * 32, False, False) == (got["agentVersion"], got["machineId"], got["identityReleased"],
                                                 got["declared"])
    assert ISO.match(got["lastHeartbeat"]) and 2.0 == got["heartbeatAgeSeconds"]
    inv = got["inventory"]
    assert (8, list(range(8)), 8, 223.0) == (inv["gpus"], inv["gpuIndices"], inv["units"], inv["vcpu"])
    assert inv["memoryGiB"] > 0 and "hugepages1Gi" in inv
    listed = {n["id"]: n for n in (await ok(api, "nodes/list", {"poolId": "h100"}))["nodes"]}
    assert {"h1", "h2"} == set(listed)
    mine = [b for n in listed.values() for b in n["bookings"]]
    by_id = {b["reservationId"]: b for b in mine}
    assert (True, False) == (by_id[now["id"]]["current"], by_id[later["id"]]["current"])
    b = by_id[later["id"]]
    assert ("acme", "placed", "hold", False, False, T0 + 5 * HOUR, T0 + 6 * HOUR, 2) == (
        b["tenantId"], b["state"], b["binding"], b["spot"], b["carriedOn"], b["start"], b["end"], len(b["gpus"]))
    assert listed["h2"]["declared"] and listed["h2"]["lastHeartbeat"] is None  # no agent yet
    # a window that ends before the later booking leaves it out
    window = {n["id"]: n for n in (await ok(api, "nodes/list", {"poolId": "h100", "until": T0 + HOUR}))["nodes"]}
    assert [now["id"]] == [b["reservationId"] for n in window.values() for b in n["bookings"]]


async def test_cordon_outlives_the_agents_inventory_and_drain_moves_work_over_http(api):
    node = await register(api, "h1.test")
    await register(api, "h2.test")
    future = (await api.create(key="f", gpuCount=1, start=T0 + 3 * HOUR, end=T0 + 4 * HOUR))[1]["reservation"]
    a = future["placements"][0]["nodeId"]
    b = "h2" if a == "h1" else "h1"
    cordoned = await ok(api, "nodes/cordon", {"nodeId": "h1", "reason": "fan failure"})
    assert (True, "cordoned", False) == (cordoned["changed"], cordoned["node"]["state"], cordoned["node"]["placeable"])
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": inventory("h1.test")})
    assert 200 == status
    assert "cordoned" == api.cp.catalog.current.nodes["h1"].state  # a new inventory keeps the operator's cordon
    await ok(api, "nodes/uncordon", {"nodeId": "h1"})
    drained = await ok(api, "nodes/drain", {"nodeId": a})
    assert [{"reservationId": future["id"], "tenantId": "acme", "fromNodes": [a], "nodes": [b]}] == drained["moved"]
    assert ([], "draining") == (drained["pending"], drained["node"]["adminState"])
    got = await api.ok("get", "alice", {"reservationId": future["id"]})
    assert ("placed", b) == (got["state"], got["placements"][0]["nodeId"])
    moved = [e for e in await api.events() if e["type"] == "reservation.moved"]
    assert [future["id"]] == [e["reservationId"] for e in moved]
    events = (await ok(api, "events/list"))["events"]
    assert ["node.cordoned", "node.uncordoned", "node.drained"] == [e["type"] for e in events]
    assert "fan failure" == events[0]["data"]["reason"]
    page = await ok(api, "events/list", {"after": events[1]["seq"], "limit": 1})
    assert ([events[2]["seq"]], events[2]["seq"]) == ([e["seq"] for e in page["events"]], page["nextCursor"])
    # a cursor past every number handed out (the tenant's stream numbered the reservation's events too)
    newest = api.cp.store.events_numbered()
    assert newest >= events[2]["seq"]
    status, doc = await admin(api, "events/list", {"after": newest + 1})
    assert (400, "after", newest) == (status, doc["error"]["details"]["field"], doc["error"]["details"]["newest"])


async def test_an_extend_after_a_drain_moved_the_reservation_leaves_its_old_booking_ended(api):
    """A drain moves a placed reservation that has not started to another node; its booking on the drained node
    ends where it starts (kept, empty, for history). An extend then moves the end of the live booking only: the
    emptied one used to come back, on the devices booked by others since (PostgreSQL refused it by its exclusion
    constraint, a 503; SQLite kept both)."""
    for host in ("h1.test", "h2.test"):
        await register(api, host)
    start, end = T0 + 3 * HOUR, T0 + 4 * HOUR
    first = (await api.create(key="first", gpuCount=8, start=start, end=end))[1]["reservation"]
    a = first["placements"][0]["nodeId"]
    b = "h2" if a == "h1" else "h1"
    await ok(api, "nodes/drain", {"nodeId": a})
    await ok(api, "nodes/uncordon", {"nodeId": a})
    status, second = await api.create(key="second", gpuCount=8, start=start, end=end)
    assert (202, a) == (status, second["reservation"]["placements"][0]["nodeId"]), second
    status, doc = await api.call("extend", "alice", {"reservationId": first["id"], "by": HOUR})
    assert (202, True) == (status, doc.get("extended")), doc
    live = api.rows("SELECT node_id, end_ms FROM bookings WHERE reservation_id = ? AND end_ms > start_ms",
                    first["id"])
    assert [(b, end + HOUR)] == live
    await check_memory(api)


@pytest.mark.parametrize("path, body, status, code, field", [
    ("nodes/get", {"nodeId": "nope"}, 404, "NOT_FOUND", "nodeId"),
    ("nodes/cordon", {"nodeId": "nope"}, 404, "NOT_FOUND", "nodeId"),
    ("nodes/clear", {"nodeId": "h1", "reason": ""}, 400, "INVALID_INPUT", "reason"),
    ("nodes/list", {"state": "asleep"}, 400, "INVALID_INPUT", "state"),
    ("nodes/list", {"poolId": "nope"}, 404, "NOT_FOUND", "poolId"),
    ("nodes/list", {"from": T0, "until": T0}, 400, "INVALID_INPUT", "until"),
    ("nodes/list", {"from": T0, "until": T0 + 63 * 24 * HOUR}, 400, "INVALID_INPUT", "until"),
    ("nodes/get", {"nodeId": "h1", "from": -1}, 400, "INVALID_INPUT", "from"),
    ("nodes/drain", {}, 400, "INVALID_INPUT", "nodeId"),
    ("pools/get", {"poolId": "nope"}, 404, "NOT_FOUND", "poolId"),
    ("pools/list", {"x": 1}, 400, "INVALID_INPUT", "x"),
    ("tenants/get", {"tenantId": "nope"}, 404, "NOT_FOUND", "tenantId"),
    ("events/list", {"limit": 0}, 400, "INVALID_INPUT", "limit"),
])
async def test_each_refusal_names_its_field_and_rule(api, path, body, status, code, field):
    got_status, doc = await admin(api, path, body)
    assert (status, code, field) == (got_status, doc["error"]["code"], doc["error"]["details"]["field"]), doc


async def test_an_action_the_state_does_not_allow_is_invalid_state_naming_the_command_that_works(api):
    await ok(api, "nodes/cordon", {"nodeId": "h1"})
    status, doc = await admin(api, "nodes/clear", {"nodeId": "h1"})
    err = doc["error"]
    assert (409, "INVALID_STATE", "nodeId", "cordoned", "berth admin nodes uncordon h1") == (
        status, err["code"], err["details"]["field"], err["details"]["state"], err["details"]["next"])
    assert "clear needs a node in ready or maintenance" == err["details"]["rule"]


async def test_tenant_tokens_are_not_operators_and_operators_are_not_tenants(api):
    await add_operators(api)
    # a valid token on an API that does not take it is 403, saying whose it is; an unknown one is 401
    for who, whose in (("alice", "alice's token (a tenant principal)"),
                       ("node-token-h100-000001", "a pool's node bootstrap token")):
        status, doc = await admin(api, "nodes/list", who=who)
        assert (403, "ACCESS_DENIED", "Authorization") == (status, doc["error"]["code"], doc["error"]["details"]["field"])
        assert doc["error"]["message"].startswith(f"Authorization: {whose} is valid, but this API takes the admin "
                                                  "token"), doc
    status, doc = await admin(api, "nodes/list", who="token-nobody-has-0000001")
    assert (401, "UNAUTHENTICATED", True) == (status, doc["error"]["code"],
                                              doc["error"]["message"].startswith("Authorization: unknown token; "))
    for who in (OLGA, ADMIN):
        status, doc = await api.call("list", who, {})
        assert (403, "COMPUTE_ACCESS_REQUIRED", "Authorization") == (status, doc["error"]["code"],
                                                                     doc["error"]["details"]["field"])
        assert "this API takes a tenant principal's token" in doc["error"]["message"]
    assert "olga's token (an operator)" in doc["error"]["message"] or who == ADMIN
    status, doc = await admin(api, "tenants/budget", {"tenantId": "acme", "budgetUsd": "1"}, who=OLGA)
    assert (403, True) == (status, "olga's token (an operator) is valid, but this API takes the admin token "
                                   "(the bootstrap file's adminToken)" in doc["error"]["message"])  # budgets and
    # bootstraps stay the admin token's


async def test_an_operator_does_what_cedar_permits(api):
    await add_operators(api)
    listed = (await ok(api, "nodes/list", who=OLGA))["nodes"]
    assert {"h1", "h2", "b1", "o1", "g1"} == {n["id"] for n in listed}  # the eu nodes only
    assert (await ok(api, "nodes/cordon", {"nodeId": "h1"}, who=OLGA))["changed"]
    status, doc = await admin(api, "nodes/drain", {"nodeId": "h1"}, who=OLGA)
    assert (403, "ACCESS_DENIED", "fleet:nodes:drain") == (status, doc["error"]["code"], doc["error"]["details"]["action"])
    status, doc = await admin(api, "nodes/release-identity", {"nodeId": "h1"}, who=OLGA)
    assert (403, "fleet:nodes:release-identity") == (status, doc["error"]["details"]["action"])
    assert [] == (await ok(api, "pools/list", who=OLGA))["pools"]
    otto = OPERATORS[1]["token"]  # acme's, read-scoped
    status, doc = await admin(api, "nodes/uncordon", {"nodeId": "h1"}, who=otto)
    assert (403, "COMPUTE_ACCESS_REQUIRED") == (status, doc["error"]["code"])
    events = (await ok(api, "events/list", who=otto))["events"]
    assert [("node.cordoned", "olga")] == [(e["type"], e["data"]["by"]) for e in events]


async def test_an_operators_page_of_events_reads_on_past_the_events_it_may_not_read(api, monkeypatch):
    """olga reads the eu nodes only: a page of one after the us node m1's events still holds h1's (it used to come
    back empty, its cursor moved); a page that finds none within the pages read says where it stopped."""
    import controlplane.fleet

    await add_operators(api)
    for action in ("cordon", "uncordon", "cordon", "uncordon"):
        await ok(api, f"nodes/{action}", {"nodeId": "m1"})
    await ok(api, "nodes/cordon", {"nodeId": "h1"})
    page = await ok(api, "events/list", {"limit": 1}, who=OLGA)
    assert ([("node.cordoned", "h1")], page["events"][0]["seq"]) == (
        [(e["type"], e["data"]["nodeId"]) for e in page["events"]], page["nextCursor"])
    assert {"events": [], "nextCursor": page["nextCursor"]} == await ok(
        api, "events/list", {"after": page["nextCursor"], "limit": 1}, who=OLGA)  # the end: the cursor stays
    monkeypatch.setattr(controlplane.fleet, "EVENT_PAGES_READ", 2)  # two pages of one: m1's first two events
    page = await ok(api, "events/list", {"limit": 1}, who=OLGA)
    assert [] == page["events"] and page["nextCursor"] > 0  # moved on: more may follow from there
    seqs = [e["seq"] for e in (await ok(api, "events/list", {}))["events"]]
    assert seqs[1] == page["nextCursor"]


async def test_pools_and_tenants_for_operators(api):
    await api.create(key="a", gpuCount=3)
    await api.post("/api/admin/tenants/budget", ADMIN, {"tenantId": "acme", "budgetUsd": "75.5"})
    pools = {p["id"]: p for p in (await ok(api, "pools/list"))["pools"]}
    h100 = pools["h100"]
    assert ("acme", "eu", "H100_80GB", "exclusive", "2.500000", False, "calendar") == (
        h100["owner"], h100["region"], h100["gpuModel"], h100["sharing"], h100["pricePerGpuHourUsd"],
        h100["archived"], h100["placer"])
    assert ({"total": 16, "booked": 3, "free": 13}, 2, 0) == (h100["gpus"], h100["nodes"]["ready"], h100["pending"])
    assert ({"total": 2, "booked": 0, "free": 2}, 13) == (pools["mig"]["gpus"], pools["mig"]["units"]["total"])
    assert pools["old"]["archived"]
    got = (await ok(api, "pools/get", {"poolId": "slots"}))["pool"]
    assert ({"total": 2, "booked": 0, "free": 2}, 4) == (got["gpus"], got["units"]["total"])
    tenants = {t["id"]: t for t in (await ok(api, "tenants/list"))["tenants"]}
    acme = tenants["acme"]
    assert ({"gpu:H100_80GB": 3}, 64, 32.0, "75.500000", "0.000000", "7.500000", {"placed": 1}) == (
        acme["used"], acme["quota"]["gpu:H100_80GB"], acme["quota"]["vcpu"], acme["budgetUsd"], acme["spentUsd"],
        acme["committedUsd"], acme["reservations"])
    assert {} == (await ok(api, "tenants/get", {"tenantId": "globex"}))["tenant"]["used"]
    # the pool h100's offer to initech limits its vcpu there: that limit is initech's quota too
    assert {"gpu:H100_80GB": 16, "offer:h100:vcpu": 8.0} == tenants["initech"]["quota"]


async def test_a_tenant_reads_its_pools_with_the_free_devices_over_a_window(api):
    await api.create(key="a", gpuCount=3)
    status, doc = await api.post("/api/compute/pools/list", "alice", {"until": T0 + 2 * HOUR})
    assert 200 == status, doc
    pools = {p["id"]: p for p in doc["pools"]}
    assert {"h100", "mig", "k8s", "slots", "budget"} == set(pools)  # owned or offered, not archived
    assert (16, [{"at": T0, "units": 13}, {"at": T0 + HOUR, "units": 16}], "2.500000", T0) == (
        pools["h100"]["units"], pools["h100"]["free"], pools["h100"]["pricePerGpuHourUsd"], doc["now"])
    h100 = pools["h100"]
    assert (True, ["hold", "node"], "exclusive", None, None, 2, [{"gpus": 8, "nodes": 2}], 13,
            {"at": T0 + HOUR, "units": 16}) == (
        h100["owned"], h100["bindings"], h100["sharing"], h100["migProfiles"], h100["slotsPerGpu"], h100["nodes"],
        h100["nodeSizes"], h100["freeNow"], h100["nextChange"])
    assert {"vcpu", "memoryGiB", "hugepages1Gi"} == set(h100["perGpu"]) and h100["perGpu"]["vcpu"] > 0
    assert {"user": "root", "cleaning": "inband", "turnaroundMinutes": 30} == h100["tenantRoot"]
    assert None is pools["mig"]["tenantRoot"]
    assert [{"profile": "1g.10gb", "units": 12}, {"profile": "2g.20gb", "units": 1}] == pools["mig"]["migProfiles"]
    assert (2, None) == (pools["slots"]["slotsPerGpu"], pools["slots"]["perGpu"])
    assert ["hold", "kubernetes"] == pools["k8s"]["bindings"]
    status, doc = await api.post("/api/compute/pools/list", "carol", {"until": T0 + HOUR})
    assert {"h100", "k8s", "globex-own"} == {p["id"] for p in doc["pools"]}
    carols = {p["id"]: p for p in doc["pools"]}
    assert (False, ["hold"]) == (carols["k8s"]["owned"], carols["k8s"]["bindings"])  # kubernetes: the owner only
    status, doc = await api.post("/api/compute/pools/get", "alice", {"poolId": "mig"})
    assert (200, "mig", 13) == (status, doc["pool"]["id"], doc["pool"]["units"])
    for who, pool in (("alice", "nope"), ("carol", "mig")):  # unknown, and not offered to carol: the same answer
        status, doc = await api.post("/api/compute/pools/get", who, {"poolId": pool})
        assert (404, "NOT_FOUND", "poolId") == (status, doc["error"]["code"], doc["error"]["details"]["field"])
    status, doc = await api.post("/api/compute/pools/get", "alice", {})
    assert (400, "poolId") == (status, doc["error"]["details"]["field"])
    status, doc = await api.post("/api/compute/pools/list", "alice", {"until": 1})
    assert (400, "until") == (status, doc["error"]["details"]["field"])


async def test_the_calendar_page_is_served_with_a_strict_content_policy(api):
    resp = await api.client.get("/ui/")
    body = await resp.text()
    assert (200, "text/html") == (resp.status, resp.content_type)
    assert '<script src="app.js" defer></script>' in body and 'id="token"' in body
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        resp = await api.client.get(f"/ui/{name}")
        assert (200, kind) == (resp.status, resp.content_type)
    resp = await api.client.get("/ui", allow_redirects=False)
    assert (302, "/ui/") == (resp.status, resp.headers["Location"])
    for path in ("/ui/nope.js", "/ui/..%2Fpools.py", "/ui/__init__.py"):
        resp = await api.client.get(path)
        assert 404 == resp.status, path
        assert "NOT_FOUND" == (await resp.json())["error"]["code"]


async def test_a_bootstrap_that_would_strand_bookings_on_a_node_is_refused_and_changes_nothing(api):
    """A declared node re-declared into another pool kept its bookings where no placement looks: the new pool's
    tenant booked the same GPUs for the same window (two reservations on one device). Shrinking its GPUs left
    bookings on devices that no longer existed. Both are refused now, naming the node and what to do; a node
    without bookings may be re-declared, and once its bookings are gone, so may this one."""
    from tests.controlplane.conftest import h100_node

    res = (await api.create(key="on-h2", gpuCount=8, start=T0 + HOUR, durationHours=1))[1]["reservation"]
    node = res["placements"][0]["nodeId"]
    other = {"h1": "h2", "h2": "h1"}[node]
    before = api.cp.catalog.current
    for change in ({"pool": "globex-own"}, {"gpus": [{"numaNode": 0}] * 4}, {"vcpu": 1}):
        doc = bootstrap_doc()
        doc["nodes"] = [n if n["id"] != node else {**h100_node(node), **change} for n in doc["nodes"]]
        status, got = await admin(api, "bootstrap", doc)
        assert (409, "INVALID_STATE", "nodes") == (status, got["error"]["code"], got["error"]["details"]["field"]), got
        assert f"node {node} " in got["error"]["message"] and res["id"] in got["error"]["message"]
        assert f"berth admin nodes drain {node}" in got["error"]["message"]
        assert api.cp.catalog.current == before  # nothing applied
    doc = bootstrap_doc()  # a node with nothing booked moves freely
    doc["nodes"] = [n if n["id"] != other else h100_node(other, pool="globex-own") for n in doc["nodes"]]
    await ok(api, "bootstrap", doc)
    assert "globex-own" == api.cp.catalog.current.nodes[other].pool_id
    await api.ok("cancel", "alice", {"reservationId": res["id"]})
    doc["nodes"] = [n if n["id"] != node else h100_node(node, pool="globex-own") for n in doc["nodes"]]
    await ok(api, "bootstrap", doc)  # its booking gone: it moves too
    assert "globex-own" == api.cp.catalog.current.nodes[node].pool_id
    assert [] == api.cp.state.calendar.overlaps()


async def test_a_partial_bootstrap_that_moves_a_user_away_from_its_agent_is_refused_naming_the_user(api):
    """A whole document with an agent acting for a user of another tenant is refused when read; a partial one
    moved the user alone (to another tenant, or made it an operator) and left the agent acting for it."""
    tenants = {t["id"]: t for t in bootstrap_doc()["tenants"]}
    before = api.cp.catalog.current
    for alice, field in (({"id": "alice", "tenant": "globex", "token": TOKENS["alice"]}, "principals[0].tenant"),
                         ({"id": "alice", "kind": "operator", "token": TOKENS["alice"]}, "principals[0].kind")):
        status, got = await admin(api, "bootstrap", {"tenants": [tenants["globex"]], "principals": [alice]})
        assert (400, "INVALID_INPUT", field) == (status, got["error"]["code"], got["error"]["details"]["field"]), got
        assert "agent 'agent' of tenant 'acme'" in got["error"]["message"]
        assert api.cp.catalog.current == before  # nothing applied
    moved = {"tenants": [tenants["globex"]], "principals": [  # moved with its agent: fine
        {"id": "alice", "tenant": "globex", "token": TOKENS["alice"]},
        {"id": "agent", "tenant": "globex", "kind": "agent", "delegatedBy": "alice", "token": TOKENS["agent"]}]}
    await ok(api, "bootstrap", moved)
    assert ("globex", "globex") == tuple(api.cp.catalog.current.principals[p].tenant_id for p in ("alice", "agent"))


async def test_a_drained_reservation_takes_its_place_in_the_pool_lease_queue_again(api):
    """A reservation a drain sent back to a pool-lease queue went to its tail, while a restart's rebuild put it by
    creation (and a newer one at the head was placed first until then, another after): it takes its place again
    (the order of admission, queue_key), as the rebuild does, so the order is one across restarts and replicas."""
    cp = api.cp
    pool = cp.catalog.current.pools["h100"]
    cp.catalog.current = cp.catalog.current.with_changes(pools={
        **cp.catalog.current.pools, "h100": dataclasses.replace(pool, policy=dataclasses.replace(pool.policy, placer="pool-lease"))})
    for host in ("h1.test", "h2.test"):
        await register(api, host)
    window = dict(gpuCount=8, start=T0 + 3 * HOUR, end=T0 + 4 * HOUR)
    first = (await api.create(key="first", **window))[1]["reservation"]
    await api.create(key="beside", **window)
    later = (await api.create(key="later", **window))[1]["reservation"]
    assert "pending" == later["state"] and "number 1" in later["conditions"][0]["message"]
    drained = await ok(api, "nodes/drain", {"nodeId": first["placements"][0]["nodeId"]})
    assert [first["id"]] == drained["pending"]
    got = await api.ok("get", "alice", {"reservationId": first["id"]})
    assert "number 1 in pool h100's queue" in got["conditions"][0]["message"], got["conditions"]
    assert [first["id"], later["id"]] == list(cp.state.queue("h100"))

    def rebuilt(tx):
        now = cp.clock.compute_now()
        state = WriterState()
        state.rebuild(cp.catalog.current, tx.live_reservations(now), tx.live_bookings(now), now)
        return list(state.queue("h100"))

    assert list(cp.state.queue("h100")) == await cp.store.call(rebuilt)  # one order, whatever the memory's history
    await api.settle()
    got = await api.ok("get", "alice", {"reservationId": later["id"]})
    assert "number 2 in pool h100's queue" in got["conditions"][0]["message"], got["conditions"]
    await ok(api, "nodes/uncordon", {"nodeId": first["placements"][0]["nodeId"]})
    await api.settle()
    states_now = [(await api.ok("get", "alice", {"reservationId": r["id"]}))["state"] for r in (first, later)]
    assert ["placed", "pending"] == states_now  # the head, not the one behind it


async def test_a_create_decided_again_later_queues_behind_what_was_queued_meanwhile(api):
    """A create refused QUOTA_EXCEEDED keeps its draft (and its creation's place in the store); retried once the
    quota was raised, it went ahead of a reservation queued meanwhile, which then waited behind it though it fit.
    The queue is in the order of admission."""
    def with_quota(slots: int) -> dict:
        doc = bootstrap_doc()
        next(p for p in doc["pools"] if p["id"] == "mig")["policy"] = {"placer": "pool-lease"}
        doc["tenants"][0]["quota"]["gpu:A100_80GB:1g.10gb"] = slots
        return doc

    await ok(api, "bootstrap", with_quota(100))
    body = dict(poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb")
    await api.create(key="a", gpuCount=7, **body)
    b = (await api.create(key="b", gpuCount=5, **body))[1]["reservation"]  # the pool's 12 slots are booked
    await ok(api, "bootstrap", with_quota(17))
    status, refused = await api.create(key="x", gpuCount=6, **body)
    assert "QUOTA_EXCEEDED" == refused["error"]["code"], refused
    api.clock.advance(1_000)
    queued = (await api.create(key="y", gpuCount=5, **body))[1]["reservation"]
    assert "number 1 in pool mig's queue" in queued["conditions"][0]["message"]
    await ok(api, "bootstrap", with_quota(100))
    api.clock.advance(1_000)
    status, again = await api.create(key="x", gpuCount=6, **body)
    assert (202, "pending") == (status, again["reservation"]["state"]), again
    assert "number 2 in pool mig's queue" in again["reservation"]["conditions"][0]["message"]
    await api.ok("release", "alice", {"reservationId": b["id"]})  # 5 slots: the head fits
    await api.settle()
    got = [(await api.ok("get", "alice", {"reservationId": r["id"]}))["state"] for r in (queued, again["reservation"])]
    assert ["binding", "pending"] == got


async def test_a_document_removes_nothing_and_a_principal_named_with_a_new_token_loses_its_old_one(api):
    """README, "The bootstrap file": what the file no longer names is kept (bob, taken out of it, still calls); to
    take a principal's access away, give it a new token in the file: the old one is refused, the new one works."""
    doc = bootstrap_doc()
    before = await ok(api, "bootstrap", doc)
    new = "token-acme-alice-rotated-0001"
    doc["principals"] = [{**p, "token": new} if p["id"] == "alice" else p for p in doc["principals"] if p["id"] != "bob"]
    after = await ok(api, "bootstrap", doc)
    assert before == after  # the stored catalog's counts: nothing removed
    assert 401 == (await api.call("list", TOKENS["alice"], {}))[0]
    assert 200 == (await api.call("list", new, {}))[0]
    assert 200 == (await api.call("list", TOKENS["bob"], {}))[0]
