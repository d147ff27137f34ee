"""The seeds' rules that held only sometimes: under concurrent admissions, after failures, between reconciler passes.

Each test goes through real HTTP on loopback with a real SQLite file; each failed on the main of stop 8.
"""
from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.controlplane.conftest import HOUR, NODE_ACCESS, T0, TOKENS, bootstrap_doc
from tests.controlplane.test_billing import make_active, quote
from tests.controlplane.test_nodes import node_call, register


def price_pool(api, pool_id: str, usd_per_gpu_hour: str) -> None:
    cp = api.cp
    pool = cp.catalog.current.pools[pool_id]
    cp.catalog.current = cp.catalog.current.with_changes(
        pools={**cp.catalog.current.pools, pool_id: dataclasses.replace(pool, price_per_gpu_hour=Decimal(usd_per_gpu_hour))})


async def set_budget(api, tenant: str, usd: str) -> None:
    status, doc = await api.post("/api/admin/tenants/budget", "admin-token-for-tests-0001",
                                 {"tenantId": tenant, "budgetUsd": usd})
    assert status == 200, doc


# ---- 2. budgets under concurrent admissions --------------------------------------------------------------

async def test_concurrent_creates_never_overspend_the_budget(api):
    price_pool(api, "budget", "10")  # each create below may bill 10 USD
    await set_budget(api, "acme", "70")  # exactly 7 fit
    answers = await asyncio.gather(*(api.create(key=f"c{i}", poolId="budget", gpuCount=1, durationHours=1)
                                     for i in range(20)))
    accepted = [doc for status, doc in answers if status == 202]
    refused = {doc["error"]["code"] for status, doc in answers if status != 202}
    assert (7, {"INSUFFICIENT_FUNDS"}) == (len(accepted), refused)
    exposure = api.cp.billing.exposure_usd("acme")
    assert Decimal("70") == exposure  # the wallet, 70 less what the accepted may bill, never below zero


async def test_concurrent_extends_never_overspend_the_budget(api):
    price_pool(api, "budget", "10")
    await set_budget(api, "acme", "140")
    made = [(await api.create(key=f"e{i}", poolId="budget", gpuCount=1, durationHours=1))[1]["reservation"]
            for i in range(7)]  # 70 USD committed, 70 left: 7 one-hour extensions fit
    answers = await asyncio.gather(*(api.call("extend", "alice", {"reservationId": made[i % 7]["id"], "by": HOUR})
                                     for i in range(20)))
    extended = [doc for status, doc in answers if status == 202 and doc["extended"]]
    assert 7 == len(extended)
    assert {doc["error"]["code"] for status, doc in answers if status != 202} <= {"INSUFFICIENT_FUNDS", "CONFLICT"}
    assert Decimal("140") == api.cp.billing.exposure_usd("acme")


# ---- 3. the original receipt ----------------------------------------------------------------------------

async def test_a_replay_after_a_release_answers_with_the_create_operation(api):
    _, first = await api.create(key="r")
    created = first["reservation"]["operation"]
    await api.ok("release", "alice", {"reservationId": first["reservation"]["id"]})
    status, again = await api.create(key="r")
    assert (202, created["id"], "create") == (status, again["reservation"]["operation"]["id"],
                                              again["reservation"]["operation"]["kind"])


# ---- 4, 5. capacity answers that work -------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpus=st.integers(1, 8), hours=st.integers(1, 4), pool=st.sampled_from(["h100", "k8s"]),
       cents=st.integers(0, 2000))
async def test_the_cheapest_eligible_rate_is_one_the_same_request_is_accepted_at(api, gpus, hours, pool, cents):
    body = dict(poolId=pool, gpuCount=gpus, durationHours=hours, maxHourlyPrice=f"{cents / 100:.2f}")
    status, doc = await api.create(**body)
    if status == 202 or doc["error"]["details"].get("reason") != "price_ceiling":
        return
    cheapest = doc["error"]["details"]["cheapestEligibleUsdPerHour"]
    status, doc = await api.create(**{**body, "maxHourlyPrice": cheapest})
    assert status == 202 or doc["error"]["details"].get("reason") != "price_ceiling", doc


async def test_a_shape_larger_than_the_pool_is_no_stock_with_alternatives(api):
    status, doc = await api.create(poolId="k8s", gpuCount=8, nodeCount=2)
    details = doc["error"]["details"]
    assert (409, "NO_CAPACITY", "no_stock") == (status, doc["error"]["code"], details["reason"])
    assert ["h100"] == [a["poolId"] for a in details["alternatives"]]
    assert 8 == details["maxGpuCountPerNode"]


# ---- 6, 7. operations for every infrastructure mutation ----------------------------------------------

async def test_a_failed_operation_carries_error_message_and_failure(api):
    await api.create(key="full", gpuCount=8, nodeCount=2, durationHours=2)
    _, doc = await api.create(key="late", gpuCount=8, start=T0 + 10 * 60_000, end=T0 + HOUR)  # pending
    await api.settle(HOUR)  # its window passed unplaced
    got = await api.ok("get", "alice", {"reservationId": doc["reservation"]["id"]})
    op = got["operation"]
    assert ("failed", "provider_rejected:no_capacity", "provider") == (
        op["status"], op["errorMessage"], op["failure"]["actor"])
    assert op["errorMessage"] == op["failure"]["code"]


async def test_release_cancel_and_extend_answer_202_with_their_own_operations(api):
    res = (await api.create(key="x", start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    assert (202, "extend", "succeeded") == (status, doc["reservation"]["operation"]["kind"],
                                            doc["reservation"]["operation"]["status"])  # nothing bound: done at once
    status, doc = await api.call("cancel", "alice", {"reservationId": res["id"]})
    assert (202, "cancel", "succeeded") == (status, doc["reservation"]["operation"]["kind"],
                                            doc["reservation"]["operation"]["status"])
    status, doc = await api.call("renew", "alice", {"reservationId": res["id"]})
    assert status == 409  # renew changes no infrastructure (and this one has no lease): not 202


async def test_a_release_runs_until_every_bound_node_reports_unbound(api):
    res = await make_active(api, key="b", gpuCount=8, nodeCount=2, durationHours=3)
    tokens = {n["nodeId"]: n["nodeToken"] for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    for node_id, token in tokens.items():  # the new tokens: a fresh register tells the control plane again
        await node_call(api, "report", token, {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    status, doc = await api.call("release", "alice", {"reservationId": res["id"]})
    op = doc["reservation"]["operation"]
    assert (202, "cluster_terminate", "running", "released") == (status, op["kind"], op["status"], doc["reservation"]["state"])
    cond = next(c for c in doc["reservation"]["conditions"] if c["type"] == "DevicesBound")
    assert ("False", "Unbinding") == (cond["status"], cond["reason"])
    waiting = asyncio.ensure_future(api.post("/api/compute/operations/wait", "alice",
                                             {"operationId": op["id"], "timeoutMs": 5000}))
    first, second = sorted(tokens)
    await node_call(api, "report", tokens[first], {"reports": [{"reservationId": res["id"], "status": "unbound"}]})
    assert "running" == api.cp.store.operation(op["id"]).status  # one node still holds the devices
    await node_call(api, "report", tokens[second], {"reports": [{"reservationId": res["id"], "status": "unbound"}]})
    status, waited = await waiting
    assert (True, "succeeded", "cluster_terminate") == (waited["done"], waited["operation"]["status"],
                                                        waited["operation"]["kind"])
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert not any(c["type"] == "DevicesBound" for c in got["conditions"])  # nothing bound: no DevicesBound=True
    # stored under the kinds every release reads (a replica of the previous one among them); named so on the wire
    assert ["create", "release"] == [op.kind for op in api.cp.store.reservation(res["id"]).operations]
    status, first = await api.post("/api/compute/operations/get", "alice", {"operationId": res["operation"]["id"]})
    assert (200, "cluster_create") == (status, first["operation"]["kind"])


async def test_a_window_that_ends_by_itself_leaves_no_unbinding_condition_once_the_node_unbound(api):
    res = await make_active(api, key="e", gpuCount=1, durationHours=1)
    [node] = [n for n in [await register(api, "h1.test"), await register(api, "h2.test")]
              if n["nodeId"] == res["placements"][0]["nodeId"]]
    await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    await api.settle(HOUR)  # the window's end: released, reason ended, no operation of its own
    ended = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ("released", "ended", "Unbinding") == (
        ended["state"], ended["reason"], next(c["reason"] for c in ended["conditions"] if c["type"] == "DevicesBound"))
    await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "unbound"}]})
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ([], []) == (got["bound"], [c for c in got["conditions"] if c["type"] == "DevicesBound"])


async def test_an_extension_of_a_bound_reservation_runs_until_its_node_applied_the_new_end(api):
    res = await make_active(api, key="x", gpuCount=1, durationHours=2)
    node = await register(api, res["placements"][0]["nodeId"] + ".test")
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    op, new_end = doc["reservation"]["operation"], doc["reservation"]["end"]
    assert (202, "extend", "running") == (status, op["kind"], op["status"])
    await node_call(api, "report", node["nodeToken"],
                    {"reports": [{"reservationId": res["id"], "status": "bound", "end": new_end}]})
    assert "succeeded" == api.cp.store.operation(op["id"]).status


# ---- 9. the clock decides ----------------------------------------------------------------------------

async def test_renew_after_the_lease_deadline_is_invalid_state_before_the_reconciler_runs(api):
    res = (await api.create(key="l", leaseSeconds=60))[1]["reservation"]
    api.clock.advance(61_000)  # no settle: the reconciler has not released it yet
    status, doc = await api.call("renew", "alice", {"reservationId": res["id"]})
    assert (409, "INVALID_STATE") == (status, doc["error"]["code"])
    assert "lease lapsed" in doc["error"]["message"]


async def test_extend_after_the_window_end_is_invalid_state_before_the_reconciler_runs(api):
    res = (await api.create(key="w", durationHours=1))[1]["reservation"]
    api.clock.advance(HOUR + 1)
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    assert (409, "INVALID_STATE") == (status, doc["error"]["code"])


async def test_cancel_after_the_window_start_is_invalid_state_naming_release(api):
    res = (await api.create(key="s", start=T0 + 60_000, end=T0 + HOUR))[1]["reservation"]
    api.clock.advance(61_000)
    status, doc = await api.call("cancel", "alice", {"reservationId": res["id"]})
    assert (409, "INVALID_STATE", "release") == (status, doc["error"]["code"], doc["error"]["details"]["next"])


async def test_an_extend_decided_while_a_release_ran_is_invalid_state(api):
    res = (await api.create(key="d", durationHours=2))[1]["reservation"]
    authorizer = api.cp.authorizer
    gate, entered = asyncio.Event(), asyncio.Event()
    decide = authorizer.decide

    async def slow(request):  # the IAM decision of the extension takes until the release is through
        entered.set()
        await gate.wait()
        return await decide(request)

    authorizer.decide = slow
    try:
        extending = asyncio.ensure_future(api.call("extend", "alice", {"reservationId": res["id"], "by": HOUR}))
        await entered.wait()
        authorizer.decide = decide
        await api.ok("release", "alice", {"reservationId": res["id"]})
        gate.set()
        status, doc = await extending
    finally:
        authorizer.decide = decide
    assert (409, "INVALID_STATE") == (status, doc["error"]["code"])


# ---- 10. the pool-lease placer preempts spot work ---------------------------------------------------

async def test_the_pool_lease_placer_preempts_spot_work_too(api):
    cp = api.cp
    pool = cp.catalog.current.pools["h100"]
    cp.catalog.current = cp.catalog.current.with_changes(pools={
        **cp.catalog.current.pools, "h100": dataclasses.replace(pool, policy=dataclasses.replace(pool.policy, placer="pool-lease"))})
    spot = (await api.create(key="spot", gpuCount=8, nodeCount=2, spot=True))[1]["reservation"]
    status, doc = await api.create(key="firm", gpuCount=8)
    assert (202, "placed") == (status, doc["reservation"]["state"])
    got = await api.ok("get", "alice", {"reservationId": spot["id"]})
    assert ("released", "preempted") == (got["state"], got["reason"])


# ---- 11. whole nodes are seen whole -----------------------------------------------------------------

async def test_a_node_binding_is_seen_whole_by_iam_and_its_hugepages_by_quota(api, bootstrap_file):
    asked = []
    decide_now = api.cp.authorizer.decide_now

    def spy(request):
        asked.append(dict(request.resource.attributes))
        return decide_now(request)

    api.cp.authorizer.decide_now = spy
    try:
        status, doc = await api.create(key="n", binding="node", gpuCount=None, nodeCount=2, access=NODE_ACCESS)
    finally:
        api.cp.authorizer.decide_now = decide_now
    assert 202 == status, doc
    attrs = asked[0]
    assert (128, 2 * (512 + 16)) == (attrs["vcpu"], attrs["memoryGiB"])  # 2 hosts of 64 vcpu, 512 GiB + 16 x 1 GiB
    assert 2 * 16 * 1024 == api.cp.state.ledger.usage("acme")["memory_mib"]  # the hugepages, as memory


# ---- 12. token scopes ---------------------------------------------------------------------------------

async def test_a_read_token_reads_and_every_mutation_is_compute_access_required(aiohttp_client, tmp_path, bootstrap_file,
                                                                                clock):
    from controlplane.api.app import create_app
    from controlplane.wiring import Config
    from tests.controlplane.conftest import Api

    doc = bootstrap_doc()
    doc["principals"].append({"id": "viewer", "tenant": "acme", "token": "token-acme-viewer-00001", "scope": "read"})
    config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(doc), clock=clock,
                    synchronous="NORMAL", reconcile=False)
    api = Api(await aiohttp_client(create_app(config)), clock)
    res = (await api.create("alice", key="a"))[1]["reservation"]
    viewer = "token-acme-viewer-00001"
    for method in ("list", "get"):
        assert 200 == (await api.call(method, viewer, {"reservationId": res["id"]} if method == "get" else {}))[0]
    assert 200 == (await quote(api, viewer))[0]
    assert 200 == (await api.post("/api/compute/operations/get", viewer, {"operationId": res["operation"]["id"]}))[0]
    for method, body in (("create", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}),
                         ("release", {"reservationId": res["id"]}), ("extend", {"reservationId": res["id"], "by": 1}),
                         ("cancel", {"reservationId": res["id"]}), ("renew", {"reservationId": res["id"]})):
        status, doc = await api.call(method, viewer, body)
        assert (403, "COMPUTE_ACCESS_REQUIRED", "manage") == (status, doc["error"]["code"], doc["error"]["details"]["required"])
    assert TOKENS["alice"] != viewer


async def test_an_agent_has_no_more_access_than_the_user_it_acts_for(aiohttp_client, tmp_path, bootstrap_file, clock):
    """An agent with a manage token acting for a read-scoped user: its mutations are COMPUTE_ACCESS_REQUIRED, and
    nothing is left behind (no draft, no confirmation the user could not decide)."""
    from controlplane.api.app import create_app
    from controlplane.wiring import Config
    from tests.controlplane.conftest import Api

    doc = bootstrap_doc()
    doc["principals"] += [{"id": "viewer", "tenant": "acme", "token": "token-acme-viewer-00001", "scope": "read"},
                          {"id": "vagent", "tenant": "acme", "kind": "agent", "delegatedBy": "viewer",
                           "token": "token-acme-vagent-00001"}]
    config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(doc), clock=clock,
                    synchronous="NORMAL", reconcile=False)
    api = Api(await aiohttp_client(create_app(config)), clock)
    res = (await api.create("alice", key="a"))[1]["reservation"]
    vagent = "token-acme-vagent-00001"
    for gpus in (1, 4):  # within the agent's own policy, and beyond it (which asked the user to confirm)
        status, doc = await api.create(vagent, key=f"k{gpus}", gpuCount=gpus)
        assert (403, "COMPUTE_ACCESS_REQUIRED", {"scope": "read", "required": "manage", "delegatedBy": "viewer"}) == (
            status, doc["error"]["code"], doc["error"]["details"])
        assert "vagent acts for viewer, who has read access" in doc["error"]["message"]
    status, doc = await api.call("release", vagent, {"reservationId": res["id"]})
    assert (403, "COMPUTE_ACCESS_REQUIRED") == (status, doc["error"]["code"])
    assert 200 == (await api.call("list", vagent, {}))[0]  # reads stay
    # its quote beyond its own policy promises no confirmation by a user who could not give it
    status, doc = await quote(api, vagent, gpuCount=4)
    assert (403, "ACCESS_DENIED") == (status, doc["error"]["code"]), doc
    assert [] == (await api.post("/api/iam/confirmations/list", "token-acme-viewer-00001", {}))[1]["confirmations"]
    assert ["reservation.placed"] == [e["type"] for e in await api.events()]  # alice's alone
