"""The release hold of binding: 'kubernetes', sentence by sentence from the seed, on a fake clock with the node's
reports sent as its agent would: released at once and the devices withdrawn; booked and billed until
AllocationReleased (or the node's loss), DevicesHeld meanwhile, nothing else booking them; carried on past the
window in 5-minute steps, unbilled, at most 24 hours, the node told it is stuck; a booking made in advance takes the
devices at its start; usage shows the held time apart."""
from __future__ import annotations

from tests.controlplane.conftest import HOUR, K8S_BOOT, T0
from tests.controlplane.test_admin_api import ADMIN
from tests.controlplane.test_nodes import inventory, node_call

MIN = 60_000


async def k8s_node(api) -> str:
    status, doc = await node_call(api, "register", K8S_BOOT, {"hostname": "k1.test", "inventory": inventory("k1.test")})
    assert status == 200, doc
    return doc["nodeToken"]


async def active(api, token: str, key: str, **fields) -> dict:
    body = {"poolId": "k8s", "gpuModel": "H100_80GB", "binding": "kubernetes", "gpuCount": 8, "durationHours": 1, **fields}
    status, doc = await api.call("create", "alice", {**body, "idempotencyKey": key})
    assert status == 202, doc
    res = doc["reservation"]
    await api.settle()
    status, doc = await node_call(api, "report", token, {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    assert doc["accepted"] == [res["id"]], doc
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert "active" == got["state"]
    return got


async def report(api, token: str, rid: str, status: str, **extra) -> dict:
    code, doc = await node_call(api, "report", token, {"reports": [{"reservationId": rid, "status": status, **extra}]})
    assert code == 200, doc
    return doc


async def get(api, rid: str) -> dict:
    return await api.ok("get", "alice", {"reservationId": rid})


def condition(res: dict, type_: str) -> dict | None:
    return next((c for c in res.get("conditions", []) if c["type"] == type_), None)


async def wanted(api, token: str) -> dict[str, dict]:
    code, doc = await node_call(api, "watch", token, {"timeoutMs": 0})
    assert code == 200, doc
    return {b["reservationId"]: b for b in doc["bindings"]}


async def usage(api, rid: str) -> list[dict]:
    status, doc = await api.post("/api/compute/usage/list", "alice", {"reservationId": rid})
    assert status == 200, doc
    return doc["lines"]


async def test_a_released_booking_stays_booked_and_billed_while_pods_hold_it_and_frees_on_allocation_released(api):
    token = await k8s_node(api)
    res = await active(api, token, "a")
    assert {"resourceName": "berth.dev/gpu", "released": False} == {
        k: (await wanted(api, token))[res["id"]][k] for k in ("resourceName", "released")}
    await api.settle(10 * MIN)
    status, doc = await api.call("release", "alice", {"reservationId": res["id"]})
    assert status == 202 and "released" == doc["reservation"]["state"]
    got = await get(api, res["id"])
    assert ("True", "ReleaseHold") == (condition(got, "DevicesHeld")["status"], condition(got, "DevicesHeld")["reason"])
    assert (await wanted(api, token))[res["id"]]["released"]  # the node withdraws it and watches its pods

    assert not (await report(api, token, res["id"], "held", holders=["team-a/trainer-0"]))["ignored"]
    assert "team-a/trainer-0" in condition(await get(api, res["id"]), "DevicesHeld")["message"]
    # nothing else can book the devices meanwhile
    status, doc = await api.call("create", "alice", {"poolId": "k8s", "gpuModel": "H100_80GB", "binding": "kubernetes", "gpuCount": 8,
                                                     "durationHours": 1, "idempotencyKey": "b"})
    waiting = doc["reservation"]
    assert "pending" == waiting["state"], waiting
    await api.settle(20 * MIN)
    assert "pending" == (await get(api, waiting["id"]))["state"]

    await report(api, token, res["id"], "unbound")  # AllocationReleased
    await api.settle()
    got = await get(api, res["id"])
    assert ("False", "AllocationReleased") == (condition(got, "DevicesHeld")["status"],
                                               condition(got, "DevicesHeld")["reason"])
    assert res["id"] not in await wanted(api, token)
    assert "placed" in (await get(api, waiting["id"]))["state"] or "binding" in (await get(api, waiting["id"]))["state"]
    lines = await usage(api, res["id"])
    assert [(False, 10 * 60), (True, 20 * 60)] == [(line["held"], line["seconds"]) for line in lines]
    types = [e["type"] for e in await api.events() if e["reservationId"] == res["id"]]
    assert "reservation.hold-ended" in types and "reservation.released" in types


async def test_time_that_held_devices_may_still_bill_counts_against_the_budget(api):
    """A released reservation whose devices pods hold bills on to its window's end: that is what it may still bill,
    so a create that the rest of the budget cannot cover besides it is INSUFFICIENT_FUNDS (it was counted as
    nothing, and the tenant was billed past its budget)."""
    import dataclasses
    from decimal import Decimal
    cp = api.cp
    pools = dict(cp.catalog.current.pools)
    for pool_id, price in (("k8s", "10"), ("budget", "10")):  # acme's budget: 100 USD
        pools[pool_id] = dataclasses.replace(pools[pool_id], price_per_gpu_hour=Decimal(price),
                                             policy=dataclasses.replace(pools[pool_id].policy, budget_check=True))
    cp.catalog.current = cp.catalog.current.with_changes(pools=pools)
    token = await k8s_node(api)
    res = await active(api, token, "a", gpuCount=1)  # 10 USD for its hour
    await api.settle(30 * MIN)
    await api.ok("release", "alice", {"reservationId": res["id"]})
    await report(api, token, res["id"], "held", holders=["team-a/trainer-0"])
    status, doc = await api.call("create", "alice", {"poolId": "budget", "gpuModel": "H100_80GB", "gpuCount": 1,
                                                     "durationHours": 9.6, "idempotencyKey": "b"})  # 96 USD
    assert (status, doc["error"]["code"]) == (402, "INSUFFICIENT_FUNDS"), doc
    assert (doc["error"]["details"]["spentUsd"], doc["error"]["details"]["committedUsd"]) == ("5.000000", "5.000000")
    status, doc = await api.call("create", "alice", {"poolId": "budget", "gpuModel": "H100_80GB", "gpuCount": 1,
                                                     "durationHours": 9, "idempotencyKey": "c"})  # 90 USD: covered
    assert status == 202, doc
    await api.settle(15 * MIN)
    await report(api, token, res["id"], "unbound")  # AllocationReleased: the held time stops billing
    assert "False" == condition(await get(api, res["id"]), "DevicesHeld")["status"]
    assert api.cp.billing.exposure_usd("acme") == Decimal("87.500000")  # only the other create's 8.75 h left
    assert sum(Decimal(line["amountUsd"]) for line in await usage(api, res["id"])) == Decimal("7.500000")


async def test_still_held_at_the_end_the_booking_is_carried_on_unbilled_and_an_advance_booking_takes_the_devices(api):
    token = await k8s_node(api)
    res = await active(api, token, "a")
    later = await api.call("create", "alice", {"poolId": "k8s", "gpuModel": "H100_80GB", "binding": "kubernetes", "gpuCount": 8,
                                               "start": T0 + HOUR + 12 * MIN, "durationHours": 1,
                                               "idempotencyKey": "later"})
    assert "placed" == later[1]["reservation"]["state"]
    await api.settle(30 * MIN)
    await api.call("release", "alice", {"reservationId": res["id"]})
    await report(api, token, res["id"], "held", holders=["team-a/trainer-0"])
    await api.settle(30 * MIN)  # the window's end: carried on 5 minutes
    got = await get(api, res["id"])
    assert "carried on past the window" in condition(got, "DevicesHeld")["message"]
    assert (await wanted(api, token))[res["id"]]["stuck"]  # the node taints itself KubernetesReleaseStuck
    status, doc = await api.post("/api/admin/nodes/get", ADMIN, {"nodeId": "k1"})
    assert [("KubernetesReleaseStuck", [res["id"]])] == [(c["type"], c["reservations"]) for c in doc["node"]["conditions"]]
    await api.settle(5 * MIN)  # a second step, to 10 minutes past the end
    await api.settle(5 * MIN)  # 2 minutes short of the advance booking: the last step stops at its start
    await api.settle(2 * MIN)
    got = await get(api, res["id"])
    assert ("False", "Overtaken") == (condition(got, "DevicesHeld")["status"], condition(got, "DevicesHeld")["reason"])
    assert [] == (await api.post("/api/admin/nodes/get", ADMIN, {"nodeId": "k1"}))[1]["node"]["conditions"]
    assert res["id"] not in await wanted(api, token)
    assert "binding" == (await get(api, later[1]["reservation"]["id"]))["state"]
    # the pod stays (no API access, a disruption budget): the new booking says why it waits
    lid = later[1]["reservation"]["id"]
    why = "Pods of an ended booking still hold the devices. team-a/trainer-0: its disruption budget says no."
    assert [lid] == (await report(api, token, lid, "waiting", holders=["team-a/trainer-0"], message=why))["accepted"]
    waits = condition(await get(api, lid), "DevicesBound")
    assert ("False", "PodsInTheWay", f"node k1: {why}") == (waits["status"], waits["reason"], waits["message"])
    assert [(res["id"], "the reservation is released")] == [
        (i["reservationId"], i["reason"]) for i in (await report(api, token, res["id"], "waiting"))["ignored"]]
    await report(api, token, lid, "bound")
    assert ("active", "Bound") == ((got := await get(api, lid))["state"], condition(got, "DevicesBound")["reason"])
    assert [(lid, "the reservation is bound on this node")] == [
        (i["reservationId"], i["reason"]) for i in (await report(api, token, lid, "waiting"))["ignored"]]
    # billed: 30 minutes active, 30 held; the carry-on not at all
    assert [(False, 30 * 60), (True, 30 * 60)] == [(line["held"], line["seconds"]) for line in await usage(api, res["id"])]
    # the pods the agent evicted for the new booking are named on the old reservation
    await report(api, token, res["id"], "unbound", evicted=["team-a/trainer-0"])
    evicted = [e for e in await api.events() if e["type"] == "reservation.pods-evicted"]
    assert [["team-a/trainer-0"]] == [e["data"]["pods"] for e in evicted]
    types = [e["type"] for e in await api.events() if e["reservationId"] == res["id"]]
    assert "reservation.carried-on" in types


async def test_the_carry_on_stops_after_24_hours_and_a_lost_node_ends_a_hold(api):
    token = await k8s_node(api)
    res = await active(api, token, "a")
    await api.call("release", "alice", {"reservationId": res["id"]})
    await report(api, token, res["id"], "held", holders=["ns/p"])
    for _ in range(12 * 24 + 12 + 2):  # the hour of the window, then 24 h of 5-minute steps
        await api.settle(5 * MIN)
    got = await get(api, res["id"])
    assert ("False", "CarryOnLimit") == (condition(got, "DevicesHeld")["status"], condition(got, "DevicesHeld")["reason"])
    assert "ns/p" in condition(got, "DevicesHeld")["message"]
    assert res["id"] not in await wanted(api, token)
    # the node could not free what it was given back: maintenance, with the reason, until an operator clears it
    status, doc = await api.post("/api/admin/nodes/get", ADMIN, {"nodeId": "k1"})
    assert ("maintenance", False) == (doc["node"]["state"], doc["node"]["placeable"]), doc
    assert doc["node"]["stateReason"].startswith("KubernetesReleaseStuck: pods still held the devices of " + res["id"])
    [event] = [e for e in (await api.post("/api/admin/events/list", ADMIN, {}))[1]["events"]
               if e["type"] == "node.maintenance"]
    assert ("k1", "platform", "KubernetesReleaseStuck") == (event["data"]["nodeId"], event["data"]["by"],
                                                                 event["data"]["reason"])
    status, doc = await api.post("/api/admin/nodes/clear", ADMIN, {"nodeId": "k1"})
    assert (200, "ready", "") == (status, doc["node"]["state"], doc["node"]["stateReason"]), doc

    second = await active(api, token, "b")
    await api.call("release", "alice", {"reservationId": second["id"]})
    api.clock.advance(31_000)
    await api.cp.nodes.check_lost()
    await api.settle()
    got = await get(api, second["id"])
    assert ("False", "NodeLost") == (condition(got, "DevicesHeld")["status"], condition(got, "DevicesHeld")["reason"])
