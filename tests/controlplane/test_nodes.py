"""The node API through real HTTP: register, take-over, tokens, watch, report, loss, inventory changes."""
from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import msgspec
import pytest

from agent.discovery import Discovery
from agent.host import KernelHost
from agent.simulate import SimulatedGpus, SimulatedHost
from controlplane.api.app import create_app
from controlplane.wiring import Config
from tests.controlplane.conftest import HOUR, MIG_BOOT, T0, Api

ROOT = Path(__file__).resolve().parents[2]
BOOT = "node-token-h100-000001"
ADMIN = "admin-token-for-tests-0001"


def inventory(hostname: str, topology: str = "h100x8.json") -> dict:
    gpus = SimulatedGpus(ROOT / "examples" / "topologies" / topology)
    doc = Discovery(gpus=gpus, host=SimulatedHost(gpus, fallback=KernelHost())).discover().to_wire()
    doc["hostname"] = hostname
    return doc


async def node_call(api, method: str, token: str, body: dict):
    return await api.post(f"/api/nodes/{method}", token, body)


async def register(api, hostname: str = "h1.test", inv: dict | None = None) -> dict:
    """Register hostname as an agent would, once: asked again (its agent is alive), the answer of the first time."""
    known = api.registered
    if hostname in known and inv is None:
        return known[hostname]
    if hostname in known:  # a new inventory for a registered node: its heartbeat carries it
        status, doc = await node_call(api, "heartbeat", known[hostname]["nodeToken"], {"inventory": inv})
        assert status == 200, doc
        return known[hostname]
    status, doc = await node_call(api, "register", BOOT, {"hostname": hostname, "inventory": inv or inventory(hostname)})
    assert status == 200, doc
    known[hostname] = doc
    return doc


async def test_an_agent_takes_over_the_declared_node_with_its_hostname(api):
    doc = await register(api, "h1.test")
    assert doc["nodeId"] == "h1" and doc["poolId"] == "h100"
    node = api.cp.catalog.current.nodes["h1"]
    assert not node.declared and len(node.units) == 8 and node.units[0].uuid.startswith("GPU-")
    assert node.capacity.vcpu_milli == 223_000  # 224 CPUs less the 1 reserved
    fresh = await register(api, "gpu-new.test")
    assert fresh["nodeId"] == "h100-gpu-new.test"


async def test_tokens_speak_only_for_their_side(api):
    doc = await register(api)
    status, _ = await node_call(api, "heartbeat", "alice", {})  # a tenant token
    assert status == 401
    status, _ = await node_call(api, "heartbeat", BOOT, {})  # a bootstrap token cannot heartbeat
    assert status == 401
    status, body = await api.call("list", doc["nodeToken"], {})  # a node token on the tenant API: valid, not its
    assert (403, "COMPUTE_ACCESS_REQUIRED") == (status, body["error"]["code"])  # API's
    assert body["error"]["message"].startswith("Authorization: a node's token is valid, but this API takes")
    status, _ = await node_call(api, "register", "alice", {"hostname": "x", "inventory": {}})
    assert status == 401
    # registering again while its agent is alive is refused (409 naming the node); once an operator released
    # the node's identity, it issues a new token and the old one stops working
    body = {"hostname": "h1.test", "inventory": inventory("h1.test")}
    status, refused = await node_call(api, "register", BOOT, body)
    assert (409, "CONFLICT", "h1") == (status, refused["error"]["code"], refused["error"]["details"]["nodeId"])
    assert "berth admin nodes release-identity h1" in refused["error"]["message"]
    status, _ = await api.post("/api/admin/nodes/release-identity", "alice", {"nodeId": "h1"})
    assert status == 403  # a tenant's token on the admin API
    status, released = await api.post("/api/admin/nodes/release-identity", ADMIN, {"nodeId": "h1"})
    assert (200, True) == (status, released["node"]["identityReleased"])
    status, again = await node_call(api, "register", BOOT, body)
    assert status == 200, again
    assert not api.cp.catalog.current.nodes["h1"].identity_released  # used up by that registration
    status, _ = await node_call(api, "heartbeat", doc["nodeToken"], {})
    assert status == 401
    status, _ = await node_call(api, "heartbeat", again["nodeToken"], {})
    assert status == 200
    status, missing = await api.post("/api/admin/nodes/release-identity", ADMIN, {"nodeId": "nope"})
    assert (404, "nodeId") == (status, missing["error"]["details"]["field"])


MACHINE_A, MACHINE_B = "a" * 32, "b" * 32


async def test_a_lost_node_is_taken_over_only_from_its_own_machine_unless_released(api):
    body = {"hostname": "h1.test", "inventory": inventory("h1.test"), "machineId": MACHINE_A}
    status, first = await node_call(api, "register", BOOT, body)
    assert status == 200 and MACHINE_A == api.cp.catalog.current.nodes["h1"].machine_id
    status, doc = await node_call(api, "register", BOOT, {**body, "machineId": MACHINE_B})
    assert (409, "live_agent") == (status, doc["error"]["details"]["rule"])  # alive: refused whoever asks
    api.clock.advance(31_000)
    assert await api.cp.nodes.check_lost() == ["h1"]
    for other in (MACHINE_B, ""):  # lost: another machine, or one that sends none, may not take it
        status, doc = await node_call(api, "register", BOOT, {**body, "machineId": other})
        assert (409, "machineId", "h1") == (status, doc["error"]["details"]["field"], doc["error"]["details"]["nodeId"])
        assert f"machine id {MACHINE_A}" in doc["error"]["message"]
    status, doc = await node_call(api, "register", BOOT, {**body, "machineId": "not-hex"})
    assert (400, "machineId") == (status, doc["error"]["details"]["field"])
    status, same = await node_call(api, "register", BOOT, body)  # the same machine (its state dir lost)
    assert status == 200 and same["nodeToken"] != first["nodeToken"]
    assert not api.cp.nodes.live["h1"].lost
    # a replaced host: the operator releases the identity, and the new machine's id is recorded
    api.clock.advance(31_000)
    await api.cp.nodes.check_lost()
    await api.post("/api/admin/nodes/release-identity", ADMIN, {"nodeId": "h1"})
    status, _ = await node_call(api, "register", BOOT, {**body, "machineId": MACHINE_B})
    assert status == 200 and MACHINE_B == api.cp.catalog.current.nodes["h1"].machine_id


async def test_watch_answers_the_whole_set_at_once_and_within_100_ms_of_a_change(api):
    node = await register(api)
    token = node["nodeToken"]
    status, first = await node_call(api, "watch", token, {"timeoutMs": 0})
    assert first["bindings"] == []
    rv = first["resourceVersion"]

    async def book():
        await asyncio.sleep(0.2)
        await api.create(key="n", gpuCount=8)  # fills a node: h1 or h2
        await api.create(key="n2", gpuCount=8)
        await api.settle()

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(book())
    t = loop.time()
    status, changed = await node_call(api, "watch", token, {"resourceVersion": rv, "timeoutMs": 5000})
    await task
    assert changed["changed"] and changed["resourceVersion"] != rv
    assert loop.time() - t < 0.2 + 0.5
    status, now = await node_call(api, "watch", token, {"resourceVersion": rv, "timeoutMs": 5000})
    [binding] = now["bindings"]
    assert binding["kind"] == "hold" and len(binding["units"]) == 8
    assert binding["units"][0]["uuid"].startswith("GPU-") and binding["units"][0]["gpuIndex"] is not None
    assert binding["share"]["vcpuMilli"] > 0
    t = loop.time()
    status, idle = await node_call(api, "watch", token, {"resourceVersion": now["resourceVersion"], "timeoutMs": 150})
    assert idle["changed"] is False and loop.time() - t >= 0.14


async def test_bound_reports_from_every_node_make_it_active_and_get_shows_them(api):
    nodes = [await register(api, "h1.test"), await register(api, "h2.test")]
    res = (await api.create(key="g", gpuCount=4, nodeCount=2))[1]["reservation"]
    await api.settle()
    for i, node in enumerate(nodes):
        status, doc = await node_call(api, "report", node["nodeToken"], {"reports": [
            {"reservationId": res["id"], "status": "bound", "cgroup": f"/sys/fs/cgroup/berth/rsv-{i}", "devices": ["/dev/nvidia0"]}]})
        assert doc["accepted"] == [res["id"]]
        state = (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]
        assert state == ("binding" if i == 0 else "active")
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert sorted(b["nodeId"] for b in got["bound"]) == ["h1", "h2"]
    op = api.cp.store.operation(res["operation"]["id"])
    assert op.status == "succeeded"
    assert api.cp.store.billing("acme")[0][0] == res["id"]  # billing started at confirmed readiness


async def test_a_heartbeat_answer_says_the_nodes_state(api):
    """An agent learns so that an operator cleared its node after a cleaning that failed (agent/nodebinding.py)."""
    node = await register(api, "h1.test")
    status, doc = await node_call(api, "heartbeat", node["nodeToken"], {})
    assert (200, "ready") == (status, doc["nodeState"])
    status, _ = await api.post("/api/admin/nodes/cordon", ADMIN, {"nodeId": node["nodeId"]})
    assert status == 200
    status, doc = await node_call(api, "heartbeat", node["nodeToken"], {})
    assert "cordoned" == doc["nodeState"]


async def test_a_binding_says_whether_its_node_was_heard_bound_at_its_end(api):
    """A `bound` lost with a killed agent (or by a restore) left the reservation binding for good: each binding now
    says whether the control plane heard this node report it bound at its end, so the node's holder says it again."""
    node = await register(api, "h1.test")
    other = await register(api, "h2.test")
    res = (await api.create(key="aw", gpuCount=8, durationHours=2))[1]["reservation"]
    await api.settle()
    holder = node if res["placements"][0]["nodeId"] == node["nodeId"] else other

    async def awaiting() -> bool:
        status, doc = await node_call(api, "watch", holder["nodeToken"], {"timeoutMs": 0})
        [binding] = [b for b in doc["bindings"] if b["reservationId"] == res["id"]]
        return binding["awaitingBound"]

    assert await awaiting()
    end = res["end"]
    for report in ({"status": "bound", "end": end}, {"status": "bound", "end": end}):  # (a repeat changes nothing)
        await node_call(api, "report", holder["nodeToken"], {"reports": [{"reservationId": res["id"], **report}]})
        assert not await awaiting()
        assert "active" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]
    await api.ok("extend", "alice", {"reservationId": res["id"], "by": HOUR})
    await api.settle()
    assert await awaiting()  # the new end not applied there yet
    await node_call(api, "report", holder["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "bound", "end": end + HOUR}]})
    assert not await awaiting()


async def test_an_oom_kill_count_that_grows_sets_the_condition_and_an_event_once_per_growth(api):
    node = await register(api, "h1.test")
    res = (await api.create(key="o", gpuCount=8))[1]["reservation"]
    await api.settle()
    bound = {"reservationId": res["id"], "status": "bound", "cgroup": "/sys/fs/cgroup/berth/rsv-o",
             "devices": ["/dev/nvidia0"]}

    async def report(**extra):
        status, doc = await node_call(api, "report", node["nodeToken"], {"reports": [{**bound, **extra}]})
        assert (200, [res["id"]]) == (status, doc["accepted"]), doc
        got = await api.ok("get", "alice", {"reservationId": res["id"]})
        _, events = await api.post("/api/compute/events/list", "alice", {"limit": 500})
        ooms = [e for e in events["events"] if e["type"] == "reservation.oom-killed"]
        return {c["type"]: c for c in got["conditions"]}.get("OOMKilled"), ooms, got

    cond, ooms, got = await report()
    assert (None, [], "active") == (cond, ooms, got["state"])
    for count, events in ((1, 1), (1, 1), (3, 2), (0, 2)):  # a repeat or an older count changes nothing
        cond, ooms, got = await report(oomKills=count)
        assert events == len(ooms), (count, ooms)
    assert ("True", "MemoryLimit") == (cond["status"], cond["reason"])
    assert "ended 3 process(es)" in cond["message"] and "--memory-gib" in cond["message"]
    assert {"nodeId": "h1", "oomKills": 3, "new": 2}.items() <= ooms[-1]["data"].items()
    assert "active" == got["state"] and ["h1"] == [b["nodeId"] for b in got["bound"]]
    status, doc = await node_call(api, "report", node["nodeToken"], {"reports": [{**bound, "oomKills": -1}]})
    assert (400, "reports[0].oomKills") == (status, doc["error"]["details"]["field"])


async def test_failed_and_foreign_reports(api):
    n1, n2 = await register(api, "h1.test"), await register(api, "h2.test")
    res = (await api.create(key="a", gpuCount=8))[1]["reservation"]
    await api.settle()
    holder = res["placements"][0]["nodeId"]
    mine, other = (n1, n2) if holder == "h1" else (n2, n1)
    status, doc = await node_call(api, "report", other["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    assert doc["accepted"] == [] and doc["ignored"][0]["reason"] == "not a reservation of this node"
    await node_call(api, "report", mine["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "failed", "message": "no hugetlb"}]})
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    cond = next(c for c in got["conditions"] if c["type"] == "DevicesBound")
    assert cond["reason"] == "BindFailed" and "no hugetlb" in cond["message"]


async def test_an_active_reservation_bound_again_after_a_failure_says_it_is_bound(api):
    """A GPU lost and back: the node reported failed, then bound again with the same cgroup and devices, which was
    taken for a repeated report, and DevicesBound stayed BindFailed ("will not resolve by itself") for good."""
    node = await register(api, "h1.test")
    await register(api, "h2.test")
    res = (await api.create(key="a", gpuCount=8))[1]["reservation"]
    await api.settle()
    token = node["nodeToken"] if res["placements"][0]["nodeId"] == "h1" else (await register(api, "h2.test"))["nodeToken"]
    bound = {"reservationId": res["id"], "status": "bound", "cgroup": "/berth/x", "devices": ["/dev/nvidia0"]}
    await node_call(api, "report", token, {"reports": [bound]})
    assert "active" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]
    await node_call(api, "report", token, {"reports": [{"reservationId": res["id"], "status": "failed",
                                                        "message": "GPU-1 is gone"}]})
    cond = next(c for c in (await api.ok("get", "alice", {"reservationId": res["id"]}))["conditions"]
                if c["type"] == "DevicesBound")
    assert (cond["status"], cond["reason"]) == ("False", "BindFailed")
    status, doc = await node_call(api, "report", token, {"reports": [bound]})
    assert doc["accepted"] == [res["id"]], doc
    cond = next(c for c in (await api.ok("get", "alice", {"reservationId": res["id"]}))["conditions"]
                if c["type"] == "DevicesBound")
    assert (cond["status"], cond["reason"]) == ("True", "Bound")


async def test_a_silent_node_is_lost_after_the_grace_and_back_on_its_heartbeat(api):
    n1 = await register(api, "h1.test")
    n2 = await register(api, "h2.test")
    res = (await api.create(key="a", gpuCount=8))[1]["reservation"]
    await api.settle()
    holder = next(n for n in (n1, n2) if n["nodeId"] == res["placements"][0]["nodeId"])
    other = n2 if holder is n1 else n1
    api.clock.advance(20_000)
    await node_call(api, "heartbeat", other["nodeToken"], {})
    api.clock.advance(15_000)  # the holder has been silent 35 s > 30 s
    assert await api.cp.nodes.check_lost() == [holder["nodeId"]]
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    # still binding when its node was lost: the create fails, and the reservation ends with it (nothing bills)
    assert ("released", "node-lost") == (got["state"], got["reason"])
    op = api.cp.store.operation(res["operation"]["id"])
    assert ("failed", "platform", "node_lost") == (op.status, op.failure.actor, op.failure.code)
    assert got["operation"]["errorMessage"] == "node_lost"
    fill = (await api.create(key="b", gpuCount=8))[1]["reservation"]
    assert fill["placements"][0]["nodeId"] == other["nodeId"]  # the lost node takes no new bookings
    late = (await api.create(key="c", gpuCount=8))[1]["reservation"]
    assert late["state"] == "pending"
    await node_call(api, "heartbeat", holder["nodeToken"], {})
    assert api.cp.catalog.current.nodes[holder["nodeId"]].schedulable
    status, doc = await node_call(api, "report", holder["nodeToken"],
                                  {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    assert doc["ignored"] == [{"reservationId": res["id"], "reason": "the reservation is released"}]
    assert [] == api.cp.store.billing("acme")  # a late report of the failed create bills nothing


async def test_a_reservation_whose_node_is_lost_as_its_window_starts_fails_at_its_start_as_node_lost(api):
    """A gang whose node was lost as its window started went binding at the start and stayed so for its whole window
    (the other node holding the devices), and failed devices_not_bound at the end. It now fails at its start as one
    lost while binding does: released, node-lost, nothing billed."""
    n1, n2 = await register(api, "h1.test"), await register(api, "h2.test")
    res = (await api.create(key="gang", gpuCount=8, nodeCount=2, start=T0 + 35_000, durationHours=1))[1]["reservation"]
    assert "placed" == res["state"]
    api.clock.advance(20_000)
    await node_call(api, "heartbeat", n1["nodeToken"], {})
    api.clock.advance(15_000)  # h2 silent 35 s, and the window starts now: too late to move it
    assert [n2["nodeId"]] == await api.cp.nodes.check_lost()
    assert "placed" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]
    await api.settle()
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ("released", "node-lost") == (got["state"], got["reason"]), got
    op = api.cp.store.operation(res["operation"]["id"])
    assert ("failed", "platform", "node_lost") == (op.status, op.failure.actor, op.failure.code)
    assert [] == api.cp.store.billing("acme")


async def test_a_reservation_placed_ahead_on_a_node_that_is_lost_moves_to_another_node(api):
    """A reservation placed ahead stayed on its lost node until its window started, and then failed node-lost while
    another node was free all along: it moves at once, as on a drain."""
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="ahead", gpuCount=8, start=T0 + HOUR, durationHours=1))[1]["reservation"]
    lost = res["placements"][0]["nodeId"]
    other = next(nid for nid in nodes if nid != lost)
    api.clock.advance(20_000)
    await node_call(api, "heartbeat", nodes[other]["nodeToken"], {})
    api.clock.advance(15_000)
    assert [lost] == await api.cp.nodes.check_lost()
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ("placed", [other]) == (got["state"], [p["nodeId"] for p in got["placements"]]), got
    moved = [e for e in await api.events() if e["type"] == "reservation.moved"]
    assert [(lost, [lost], [other], "lost")] == [
        (e["data"]["nodeId"], e["data"]["fromNodes"], e["data"]["nodes"], e["data"]["reason"]) for e in moved]
    api.clock.advance(HOUR - 35_000 - 5_000)
    await node_call(api, "heartbeat", nodes[other]["nodeToken"], {})
    await api.settle(5_000)  # the window starts on the node that is heard
    await node_call(api, "report", nodes[other]["nodeToken"],
                    {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    assert "active" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]


async def test_a_gang_placed_ahead_on_a_lost_node_that_fits_nowhere_else_stays_and_binds_when_the_node_is_back(api):
    """Sent back to pending, it could lose the node's capacity to a create made while the node was lost; it stays
    placed, says NodeLost, and binds if the node is back by its window's start."""
    n1, n2 = await register(api, "h1.test"), await register(api, "h2.test")
    res = (await api.create(key="gang", gpuCount=8, nodeCount=2, start=T0 + HOUR, durationHours=1))[1]["reservation"]
    api.clock.advance(20_000)
    await node_call(api, "heartbeat", n1["nodeToken"], {})
    api.clock.advance(15_000)  # h2 silent 35 s
    assert [n2["nodeId"]] == await api.cp.nodes.check_lost()
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    cond = {c["type"]: c for c in got["conditions"]}.get("NodeLost")
    assert ("placed", ["h1", "h2"]) == (got["state"], sorted(p["nodeId"] for p in got["placements"])), got
    assert cond is not None and "stays placed there, and fails at its window's start" in cond["message"], cond
    assert "reservation.node-lost" in [e["type"] for e in await api.events() if e.get("reservationId") == res["id"]]
    status, doc = await api.create(key="meanwhile", gpuCount=8)  # a create meanwhile does not take its devices
    assert (202, "pending") == (status, doc["reservation"]["state"]), doc
    await node_call(api, "heartbeat", n2["nodeToken"], {})  # back
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ("placed", []) == (got["state"], [c for c in got["conditions"] if c["type"] == "NodeLost"]), got
    for node in (n1, n2):
        await node_call(api, "heartbeat", node["nodeToken"], {})
    await api.settle(HOUR - 35_000)  # the window starts with both nodes heard
    for node in (n1, n2):
        await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    assert "active" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]


async def test_a_reservation_ended_while_its_node_is_lost_does_not_say_so_for_ever(api):
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="nl", gpuCount=8))[1]["reservation"]
    await api.settle()
    holder = nodes[res["placements"][0]["nodeId"]]
    other = next(n for n in nodes.values() if n is not holder)
    await node_call(api, "report", holder["nodeToken"], {"reports": [{"reservationId": res["id"], "status": "bound"}]})
    api.clock.advance(20_000)
    await node_call(api, "heartbeat", other["nodeToken"], {})
    api.clock.advance(15_000)
    await api.cp.nodes.check_lost()
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ["NodeLost"] == [c["type"] for c in got["conditions"] if c["type"] == "NodeLost"]
    await api.ok("release", "alice", {"reservationId": res["id"]})
    await node_call(api, "heartbeat", holder["nodeToken"], {})  # back
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert not [c for c in got["conditions"] if c["type"] == "NodeLost"], got["conditions"]


async def test_a_pool_whose_every_node_is_lost_refuses_with_provider_unavailable(api):
    n1, n2 = await register(api, "h1.test"), await register(api, "h2.test")
    api.clock.advance(31_000)
    await api.cp.nodes.check_lost()
    status, doc = await api.create(key="x")
    assert (status, doc["error"]["code"], doc["error"]["details"]["actor"]) == (503, "PROVIDER_UNAVAILABLE", "platform")


async def test_a_gpu_that_disappears_is_not_bookable_and_its_reservation_says_so(api):
    inv = inventory("h1.test")
    node = await register(api, "h1.test", inv)
    await register(api, "h2.test")
    res = (await api.create(key="a", gpuCount=8))[1]["reservation"]
    if res["placements"][0]["nodeId"] != "h1":
        pytest.skip("placement chose h2")
    smaller = copy.deepcopy(inv)
    smaller["gpus"] = smaller["gpus"][:7]
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": smaller})
    assert status == 200
    assert len(api.cp.catalog.current.nodes["h1"].units) == 7
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert any(c["type"] == "DevicesLost" and "gpu7" in c["message"] for c in got["conditions"])
    # the GPU back (a driver reloaded): the condition goes; it stayed True for ever before
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": inv})
    assert 200 == status and 8 == len(api.cp.catalog.current.nodes["h1"].units)
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert not [c for c in got["conditions"] if c["type"] == "DevicesLost"], got["conditions"]


async def test_a_pools_counts_are_of_the_devices_its_nodes_have_now_never_below_zero(api):
    """Bookings of GPUs a node stopped reporting stay on the calendar, but the pool's units and free steps counted
    them against the GPUs left: 6 booked of 8, 4 left, showed 6 units booked where 2 GPUs were, and -2 free."""
    from tests.controlplane.test_admin_api import ok
    inv = inventory("h1.test")
    node = await register(api, "h1.test", inv)
    await ok(api, "nodes/cordon", {"nodeId": "h2", "reason": "only h1 here"})
    res = (await api.create(key="six", gpuCount=6))[1]["reservation"]
    assert ["h1"] == [p["nodeId"] for p in res["placements"]], res
    booked = {int(u[3:]) for u in res["placements"][0]["devices"]}
    fewer = copy.deepcopy(inv)
    fewer["gpus"] = [g for g in inv["gpus"] if g["index"] not in sorted(booked)[:4]]  # 4 of the 6 booked go
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": fewer})
    assert status == 200
    pool = (await ok(api, "pools/get", {"poolId": "h100"}))["pool"]
    assert {"total": 12, "booked": 2, "free": 2} == {k: pool["units"][k] for k in ("total", "booked", "free")} == {
        k: pool["gpus"][k] for k in ("total", "booked", "free")}, pool
    seen = (await api.post("/api/compute/pools/get", "alice", {"poolId": "h100"}))[1]["pool"]
    assert (seen["units"], seen["freeNow"]) == (4, 2), seen
    assert all(step["units"] >= 0 for step in seen["free"]), seen["free"]


async def test_a_reservation_moved_off_a_node_that_lost_its_devices_no_longer_says_it_lost_them(api):
    from tests.controlplane.test_admin_api import ok

    inv = inventory("h1.test")
    nodes = {n["nodeId"]: (n, i) for n, i in [(await register(api, "h1.test", inv), inv),
                                               (await register(api, "h2.test"), None)]}
    res = (await api.create(key="later", gpuCount=8, start=T0 + HOUR, durationHours=1))[1]["reservation"]
    on = res["placements"][0]["nodeId"]
    if on != "h1":
        pytest.skip("placement chose h2")
    smaller = copy.deepcopy(inv)
    smaller["gpus"] = smaller["gpus"][:7]
    await node_call(api, "heartbeat", nodes["h1"][0]["nodeToken"], {"inventory": smaller})
    assert "DevicesLost" in [c["type"] for c in (await api.ok("get", "alice", {"reservationId": res["id"]}))["conditions"]]
    await ok(api, "nodes/drain", {"nodeId": "h1", "reason": "gpu7 gone"})
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert ["h2"] == [p["nodeId"] for p in got["placements"]]
    assert not [c for c in got["conditions"] if c["type"] == "DevicesLost"], got["conditions"]


async def test_node_api_bodies_are_validated_naming_the_field(api):
    status, doc = await node_call(api, "register", BOOT, {"hostname": "x"})
    assert (status, doc["error"]["details"]["field"]) == (400, "inventory")
    node = await register(api)
    status, doc = await node_call(api, "watch", node["nodeToken"], {"timeoutMs": 40_000})
    assert (status, doc["error"]["details"]["field"]) == (400, "timeoutMs")
    status, doc = await node_call(api, "report", node["nodeToken"], {"reports": [{"reservationId": "x", "status": "done"}]})
    assert (status, doc["error"]["details"]["field"]) == (400, "reports[0].status")


async def test_metrics_are_prometheus_text(api):
    await register(api)
    await api.create(key="a")
    resp = await api.client.get("/metrics", headers={"Authorization": "Bearer admin-token-for-tests-0001"})
    text = await resp.text()
    assert 'berth_reservations{pool="h100",state="placed"} 1.0' in text
    assert 'berth_nodes{pool="h100",state="ready"} 2.0' in text


async def test_mig_devices_recreated_in_place_update_the_units_uuids_and_a_later_hold_booking_names_them(api):
    """A node binding's in-band clean recreates MIG devices the tenant destroyed: same slots, new UUIDs. The
    agent's next inventory carries them; the node's units (keyed by slot) take the new UUIDs, so the next hold
    booking on them names devices that exist and the agent can bind it."""
    import uuid as uuidlib

    from agent.bindspec import BindError, devices_of
    from common.inventory import Inventory
    from common.nodewire import Binding

    inv = inventory("m1.test", "a100-mig.json")  # takes over the declared m1, the mig pool's only node
    status, doc = await node_call(api, "register", MIG_BOOT, {"hostname": "m1.test", "inventory": inv})
    assert 200 == status, doc
    token = doc["nodeToken"]

    async def hold_booking(key: str) -> dict:
        res = (await api.create(key=key, poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb", gpuCount=7))[1]
        await api.settle()
        status, watched = await node_call(api, "watch", token, {"timeoutMs": 0})
        return next(b for b in watched["bindings"] if b["reservationId"] == res["reservation"]["id"])

    first = await hold_booking("before")
    old = [m["uuid"] for m in inv["gpus"][0]["migDevices"]]
    assert sorted(old) == sorted(u["uuid"] for u in first["units"])
    status, _ = await api.call("release", "alice", {"reservationId": first["reservationId"]})
    assert status == 202
    renewed = copy.deepcopy(inv)
    for m in renewed["gpus"][0]["migDevices"]:
        m["uuid"] = f"MIG-{uuidlib.uuid4()}"
    status, _ = await node_call(api, "heartbeat", token, {"inventory": renewed})
    assert status == 200
    new = [m["uuid"] for m in renewed["gpus"][0]["migDevices"]]
    units = api.cp.catalog.current.nodes["m1"].units
    assert ([f"gpu0/mig{i}" for i in range(7)], new) == ([u.id for u in units], [u.uuid for u in units])
    later = await hold_booking("after")
    assert sorted(new) == sorted(u["uuid"] for u in later["units"])
    live = Inventory.from_wire(renewed)
    assert 14 == len(devices_of(msgspec.convert(later, Binding), live)[1])  # the agent finds each device's caps
    with pytest.raises(BindError):  # what a binding naming the old UUIDs would have met
        devices_of(msgspec.convert(first, Binding), live)


@pytest.mark.parametrize("field", ["uuid", "pciBusId", "index"])
async def test_an_inventory_where_two_gpus_share_an_identity_is_refused_naming_the_field(api, field):
    """The agent finds a booked unit's device by its uuid: two GPUs with one would give a booking the other's. A unit
    is named by its GPU's index: two GPUs of one index were one unit booked twice (every create there a 503)."""
    inv = {**inventory("dup.test"), "source": "nvml"}  # as a real host's driver would report it
    inv["gpus"][3][field] = inv["gpus"][1][field]
    status, doc = await node_call(api, "register", BOOT, {"hostname": "dup.test", "inventory": inv})
    assert (400, "INVALID_INPUT", f"inventory.gpus[3].{field}") == (status, doc["error"]["code"],
                                                                    doc["error"]["details"]["field"])
    assert f"each GPU has its own {field}" == doc["error"]["details"]["rule"]  # as every INVALID_INPUT names it
    assert doc["error"]["message"].startswith(f"inventory.gpus[3].{field}: {inv['gpus'][1][field]} duplicates "
                                              "gpus[1]'s")
    assert "h100-dup.test" not in api.cp.catalog.current.nodes
    node = await register(api, "h1.test")  # and on a heartbeat: the node keeps its last good units
    status, doc = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": inv})
    assert (400, f"inventory.gpus[3].{field}") == (status, doc["error"]["details"]["field"])
    assert 8 == len({u.uuid for u in api.cp.catalog.current.nodes["h1"].units})


@pytest.mark.parametrize("change, field", [
    (lambda gpus: gpus[0]["migDevices"][2].update(index=gpus[0]["migDevices"][0]["index"]),
     "inventory.gpus[0].migDevices[2].index"),
    (lambda gpus: gpus[0]["migDevices"][4].update(uuid=gpus[0]["migDevices"][3]["uuid"]),
     "inventory.gpus[0].migDevices[4].uuid"),
    (lambda gpus: gpus[0]["migDevices"][1].update(uuid=gpus[0]["uuid"]), "inventory.gpus[0].migDevices[1].uuid"),
])
async def test_mig_devices_sharing_a_slot_or_a_uuid_are_refused_naming_the_field(api, change, field):
    inv = inventory("migdup.test", "a100-mig.json")
    change(inv["gpus"])
    status, doc = await node_call(api, "register", MIG_BOOT, {"hostname": "migdup.test", "inventory": inv})
    assert (400, "INVALID_INPUT", field) == (status, doc["error"]["code"], doc["error"]["details"]["field"]), doc


async def test_a_simulated_inventory_of_an_earlier_release_with_repeated_pci_ids_still_registers(api):
    """Its --simulate gave GPU 16 the PCI id of GPU 0 (and so on); its uuids were distinct, and it must still
    register: PCI ids are checked as NVML reports them only."""
    inv = inventory("old-sim.test")
    inv["gpus"][3]["pciBusId"] = inv["gpus"][1]["pciBusId"]
    status, doc = await node_call(api, "register", BOOT, {"hostname": "old-sim.test", "inventory": inv})
    assert 200 == status, doc


@pytest.mark.parametrize("hostname, inventory_hostname, field", [
    ("bad host\nname", "bad host\nname", "hostname"),
    ("ok.test", "bad host\nname", "inventory.hostname"),
    ("ok.test", "-lead.test", "inventory.hostname"),
    ("a" * 64 + ".test", "ok.test", "hostname"),
])
async def test_a_hostname_that_is_not_a_host_name_is_refused(api, hostname, inventory_hostname, field):
    """Before: node id `h100-bad host\\nname`."""
    inv = inventory(inventory_hostname)
    status, doc = await node_call(api, "register", BOOT, {"hostname": hostname, "inventory": inv})
    assert (400, "INVALID_INPUT", field) == (status, doc["error"]["code"], doc["error"]["details"]["field"])
    assert "is not a host name" in doc["error"]["message"]
    assert doc["error"]["details"]["rule"].startswith("a host name")
    assert {"h1", "h2", "m1"} <= set(api.cp.catalog.current.nodes) and not any(
        n.startswith("h100-") for n in api.cp.catalog.current.nodes)


async def test_a_registered_node_whose_gpus_are_all_in_mig_mode_counts_them(api):
    """Before: gpus 0 (only whole GPUs were counted), where the declared node it took over counted every GPU."""
    assert 2 == api.cp.catalog.current.nodes["m1"].gpu_count  # declared: two GPUs listed
    status, doc = await node_call(api, "register", MIG_BOOT, {"hostname": "m1.test",
                                                               "inventory": inventory("m1.test", "a100-mig.json")})
    assert 200 == status, doc
    node = api.cp.catalog.current.nodes["m1"]
    assert (1, 7) == (node.gpu_count, len(node.units))
    status, got = await api.post("/api/admin/nodes/get", ADMIN, {"nodeId": "m1"})
    assert (200, 1, [0]) == (status, got["node"]["inventory"]["gpus"], got["node"]["inventory"]["gpuIndices"])


async def test_a_node_token_used_from_another_host_is_refused_naming_the_copied_state_directory(api):
    """A state directory copied to another host (a cloned image) carries the node token: its agent heartbeated,
    watched and bound every reservation of the node a second time, unnoticed. Each call now names the agent's host
    (its machine id), and a token used from another host than the one it was issued to is refused."""
    here, there = "a" * 32, "b" * 32
    status, reg = await node_call(api, "register", BOOT, {"hostname": "h1.test", "inventory": inventory("h1.test"),
                                                          "machineId": here})
    assert 200 == status, reg
    token = reg["nodeToken"]
    for method, body in (("heartbeat", {}), ("watch", {"resourceVersion": 0, "timeoutMs": 0}), ("report", {"reports": []})):
        status, doc = await api.post(f"/api/nodes/{method}", token, body, headers={"Berth-Machine-Id": there})
        assert (409, "CONFLICT", "Berth-Machine-Id") == (status, doc["error"]["code"], doc["error"]["details"]["field"])
        assert "Remove node.json from this host's state directory" in doc["error"]["message"]
        status, doc = await api.post(f"/api/nodes/{method}", token, body, headers={"Berth-Machine-Id": here})
        assert 200 == status, doc
        status, doc = await api.post(f"/api/nodes/{method}", token, body)  # an agent of an earlier release
        assert 200 == status, doc


async def test_the_agent_names_its_host_on_every_call(aiohttp_server):
    """What the agent's node client sends: the machine id it registered with, also with the node token."""
    from aiohttp import web

    from agent.nodeclient import NodeClient

    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Berth-Machine-Id"))
        return web.json_response({"resourceVersion": 1, "graceSeconds": 30, "reportStatuses": []})

    app = web.Application()
    app.router.add_post("/api/nodes/heartbeat", answer)
    server = await aiohttp_server(app)
    client = NodeClient(str(server.make_url("/")), token="nt_x")
    client.machine_id = "c" * 32
    try:
        await client.heartbeat()
    finally:
        await client.close()
    assert ["c" * 32] == seen


async def test_a_gangs_lost_device_is_not_forgotten_when_another_of_its_nodes_changes(api):
    """DevicesLost is the reservation's, over all its nodes: a change on h2 that touches none of its devices left
    it cleared while h1 still did not report one it holds."""
    inv1, inv2 = inventory("h1.test"), inventory("h2.test")
    n1, n2 = await register(api, "h1.test", inv1), await register(api, "h2.test", inv2)
    res = (await api.create(key="gang", gpuCount=4, nodeCount=2, durationHours=1))[1]["reservation"]
    held = {b.node_id: b.units for b in api.cp.state.calendar.bookings_of(res["id"])}
    gone1 = int(held["h1"][0][3:])
    assert 200 == (await node_call(api, "heartbeat", n1["nodeToken"], {"inventory": {
        **inv1, "gpus": [g for g in inv1["gpus"] if g["index"] != gone1]}}))[0]
    spare2 = min(set(range(8)) - {int(u[3:]) for u in held["h2"]})
    assert 200 == (await node_call(api, "heartbeat", n2["nodeToken"], {"inventory": {
        **inv2, "gpus": [g for g in inv2["gpus"] if g["index"] != spare2]}}))[0]
    lost = [c for c in (await api.ok("get", "alice", {"reservationId": res["id"]}))["conditions"]
            if c["type"] == "DevicesLost"]
    assert [("True", f"node h1 no longer reports gpu{gone1}")] == [(c["status"], c["message"]) for c in lost]


async def test_after_a_restart_the_grace_counts_from_the_start_for_every_registered_node(api, db_url, aiohttp_client,
                                                                                          bootstrap_file):
    """A control plane that was down longer than the grace does not lose nodes whose agents have not yet had the
    time to speak again; and a registered node whose agent never speaks again is lost the grace after the start."""
    dead = await register(api, "h1.test")
    alive = await register(api, "h2.test")
    for node in (dead, alive):
        await node_call(api, "heartbeat", node["nodeToken"], {})
    if api.engine == "postgresql":  # shared with other replicas (and this one's successor) on the database
        for _ in range(100):
            if len(api.rows("SELECT node_id FROM node_seen")) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(api.rows("SELECT node_id FROM node_seen")) == 2
    await api.client.close()
    api.clock.advance(600_000)  # ten minutes down
    config = Config(db=db_url, bootstrap=bootstrap_file(), clock=api.clock, synchronous="NORMAL", reconcile=False)
    again = Api(await aiohttp_client(create_app(config)), api.clock)
    for _ in range(100):  # PostgreSQL: the lead, once the old session's lock is gone
        if again.cp.nodes.leads():
            break
        await asyncio.sleep(0.05)
    assert again.cp.nodes.leads()
    assert [] == await again.cp.nodes.check_lost()  # nobody could have spoken yet
    again.clock.advance(20_000)
    status, doc = await node_call(again, "heartbeat", alive["nodeToken"], {})
    assert status == 200, doc
    again.clock.advance(15_000)
    assert [dead["nodeId"]] == await again.cp.nodes.check_lost()
    assert not again.cp.catalog.current.nodes[dead["nodeId"]].schedulable
    never = [n for n in again.cp.catalog.current.nodes.values() if n.id not in (dead["nodeId"], alive["nodeId"])]
    assert never and all(n.schedulable for n in never)  # declared, never registered: no agent to wait for


async def test_an_agent_restarted_after_an_upgrade_shows_its_version_by_its_heartbeats(api):
    """An agent keeps its node token across restarts and does not register again: the node showed the version it
    first registered with after an upgrade in place, and none at all after the control plane restarted. A heartbeat
    answer names the version on record; an agent whose own differs sends it with its next heartbeat."""
    from agent.link import ControlPlaneLink
    from agent.metrics import AgentMetrics
    from tests.controlplane.test_admin_api import ok
    status, reg = await node_call(api, "register", BOOT, {"hostname": "h1.test", "inventory": inventory("h1.test"),
                                                          "agentVersion": "0.1.0"})
    assert status == 200, reg
    upgraded = ControlPlaneLink(str(api.client.server.make_url("")), "", None, None, None, AgentMetrics(),
                                inventory=lambda: None, agent_version="0.2.0", wall_ms=lambda: 0, on_node=print)
    upgraded.client.token = reg["nodeToken"]
    try:
        assert "0.1.0" == (await upgraded._heartbeat(None)).agentVersion  # the first heartbeat does not carry it
        assert "0.2.0" == (await upgraded._heartbeat(None)).agentVersion
        assert upgraded.sends_version  # and every one after, so each replica behind a balancer learns it
    finally:
        await upgraded.client.close()
    assert "0.2.0" == (await ok(api, "nodes/get", {"nodeId": "h1"}))["node"]["agentVersion"]
    status, doc = await node_call(api, "heartbeat", reg["nodeToken"], {"agentVersion": "x" * 65})
    assert (status, doc["error"]["details"]["field"]) == (400, "agentVersion"), doc


async def test_gpus_renumbered_after_one_left_keep_their_units_so_no_gpu_is_bound_twice(api):
    """NVML numbers GPUs in their order: after GPU 0 dies the others move up an index. Units named by the index
    then named other GPUs: the reservation on the dead GPU was not told, and a new booking of the unit its GPU had
    was bound to the GPU another reservation held (two tenants on one GPU)."""
    from tests.controlplane.test_admin_api import ok
    inv = inventory("h1.test")
    node = await register(api, "h1.test", inv)
    await ok(api, "nodes/cordon", {"nodeId": "h2", "reason": "only h1 here"})
    held = {}
    for key in ("a", "b"):
        res = (await api.create(key=key, gpuCount=1))[1]["reservation"]
        held[key] = (res["id"], res["placements"][0]["devices"][0])
    uuid_of = {f"gpu{g['index']}": g["uuid"] for g in inv["gpus"]}
    gone = uuid_of[held["a"][1]]
    renumbered = copy.deepcopy(inv)
    renumbered["gpus"] = [g for g in renumbered["gpus"] if g["uuid"] != gone]
    for i, gpu in enumerate(renumbered["gpus"]):
        gpu["index"] = i
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": renumbered})
    assert status == 200
    lost = await api.ok("get", "alice", {"reservationId": held["a"][0]})
    assert any(c["type"] == "DevicesLost" for c in lost["conditions"]), lost["conditions"]
    kept = await api.ok("get", "alice", {"reservationId": held["b"][0]})
    assert not any(c["type"] == "DevicesLost" for c in kept["conditions"]), kept["conditions"]
    await api.ok("release", "alice", {"reservationId": held["a"][0]})
    for i in range(6):  # every other GPU of the node, once the dead one's reservation let go
        status, doc = await api.create(key=f"more{i}", gpuCount=1)
        assert status == 202, doc
    await api.settle()
    status, doc = await node_call(api, "watch", node["nodeToken"], {"timeoutMs": 0})
    uuids = [u["uuid"] for b in doc["bindings"] for u in b["units"]]
    assert len(uuids) == len(set(uuids)) == 7 and gone not in uuids, doc["bindings"]
    b_binding = next(b for b in doc["bindings"] if b["reservationId"] == held["b"][0])
    assert [u["uuid"] for u in b_binding["units"]] == [uuid_of[held["b"][1]]]
    status, doc = await api.create(key="none-left", gpuCount=1)  # 7 GPUs, 7 booked
    assert doc["reservation"]["state"] == "pending", doc
    # a new card at the last index, whose unit name a GPU that moved up still has: a name of its own
    card = copy.deepcopy(renumbered["gpus"][-1])
    card.update(index=7, uuid="GPU-a-new-card-0000000000001", minor=99, pciBusId="00000000:F0:00.0")
    status, doc = await node_call(api, "heartbeat", node["nodeToken"], {
        "inventory": {**renumbered, "gpus": renumbered["gpus"] + [card]}})
    assert status == 200, doc
    names = {u.uuid: u.id for u in api.cp.catalog.current.nodes["h1"].units}
    assert names[card["uuid"]] == "gpu7-00000001" and names[uuid_of["gpu7"]] == "gpu7", names
    # the dead GPU back (a new driver, a reseated card): its own unit again, the others untouched
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": inv})
    assert status == 200
    assert sorted(u.id for u in api.cp.catalog.current.nodes["h1"].units) == sorted(uuid_of)


async def test_a_gpu_that_gave_no_units_for_a_while_keeps_its_name(api):
    """Names were remembered through the units only: a GPU unhealthy in one inventory (or in MIG mode with no
    instance) came back under its index's name, which after a renumbering was another GPU's (its reservation lost
    its devices, a new booking was bound to it), or took the name of the GPU that had just died."""
    inv = inventory("h1.test")
    node = await register(api, "h1.test", inv)
    uuid = [g["uuid"] for g in inv["gpus"]]

    async def beat(gpus: list[dict]) -> None:
        status, doc = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": {**inv, "gpus": gpus}})
        assert status == 200, doc

    def gpus_with(present: list[int], sick: tuple[int, ...] = ()) -> list[dict]:
        out = []
        for i, old in enumerate(present):
            gpu = copy.deepcopy(inv["gpus"][old])
            gpu["index"] = i
            if old in sick:
                gpu.update(health={"healthy": False, "xid": 79, "reason": "XID 79", "sinceMs": T0}, bookable=False)
            out.append(gpu)
        return out

    def names() -> dict[str, str]:
        return {u.uuid: u.id for u in api.cp.catalog.current.nodes["h1"].units}

    await beat(gpus_with([0, 1, 2, 3, 4, 5, 6, 7], sick=(1,)))  # GPU 1 unhealthy: no unit for a while
    await beat(gpus_with([1, 2, 3, 4, 5, 6, 7]))  # then GPU 0 dies, and GPU 1, healthy again, moves to index 0
    assert names()[uuid[1]] == "gpu1" and "gpu0" not in names().values(), names()
    await beat(gpus_with([1, 2, 3, 4, 5, 6, 7], sick=(2,)))  # after the renumbering: unhealthy at index 1
    await beat(gpus_with([1, 2, 3, 4, 5, 6, 7]))
    assert names() == {uuid[i]: f"gpu{i}" for i in range(1, 8)}, names()


async def test_one_nodes_bound_report_does_not_clear_another_nodes_failure(api):
    """DevicesBound went back to True when any node repeated its bound report, though the node that failed had not
    bound again."""
    nodes = {n["nodeId"]: n["nodeToken"] for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="gang", gpuCount=8, nodeCount=2))[1]["reservation"]
    await api.settle()

    def bound(i: int) -> dict:
        return {"reservationId": res["id"], "status": "bound", "cgroup": f"/berth/{i}", "devices": ["/dev/nvidia0"]}

    for i, token in enumerate(nodes.values()):
        await node_call(api, "report", token, {"reports": [bound(i)]})
    assert "active" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]
    first, second = nodes.values()
    await node_call(api, "report", first, {"reports": [{"reservationId": res["id"], "status": "failed",
                                                        "message": "GPU-1 is gone"}]})
    await node_call(api, "report", second, {"reports": [{**bound(1), "oomKills": 1}]})  # the other node, again

    def shown(got):
        cond = next(c for c in got["conditions"] if c["type"] == "DevicesBound")
        return cond["status"], cond["reason"], "GPU-1 is gone" in cond["message"]

    assert shown(await api.ok("get", "alice", {"reservationId": res["id"]})) == ("False", "BindFailed", True)
    await node_call(api, "report", first, {"reports": [bound(0)]})  # the failed node binds again
    assert shown(await api.ok("get", "alice", {"reservationId": res["id"]}))[:2] == ("True", "Bound")


async def test_a_gang_whose_node_failed_while_binding_waits_for_it_to_bind_again(api):
    """A node that bound, then failed, while its gang was binding: the other node's bound report made the
    reservation active, with 'every node reported the devices bound', its create succeeded and billing began."""
    nodes = {n["nodeId"]: n["nodeToken"] for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="gang", gpuCount=8, nodeCount=2))[1]["reservation"]
    await api.settle()
    first, second = nodes.values()
    bound = {"reservationId": res["id"], "status": "bound", "cgroup": "/berth/x", "devices": ["/dev/nvidia0"]}
    await node_call(api, "report", first, {"reports": [bound]})
    await node_call(api, "report", first, {"reports": [{"reservationId": res["id"], "status": "failed",
                                                        "message": "GPU-1 is gone"}]})
    await node_call(api, "report", second, {"reports": [bound]})
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    cond = next(c for c in got["conditions"] if c["type"] == "DevicesBound")
    assert (got["state"], cond["status"], cond["reason"]) == ("binding", "False", "BindFailed"), got
    await node_call(api, "report", first, {"reports": [bound]})  # bound again, as it was
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    assert got["state"] == "active", got
