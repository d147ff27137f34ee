"""binding: 'node', the control plane's side, through real HTTP: access.sshKeys, the binding the agent gets, the
bound report's ssh on get, a failed hand-over, the turnaround in the calendar and quotes, billing, and the node's
cleaning after the hand-back (inband; redfish against the real sushy-tools emulator)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from controlplane.api.app import create_app
from controlplane.bootstrap import BootstrapError, parse
from controlplane.wiring import Config
from tests.controlplane.conftest import HOUR, NODE_ACCESS, T0, Api, bootstrap_doc, h100_node, ssh_key
from tests.controlplane.test_nodes import BOOT, inventory, node_call, register

ADMIN = "admin-token-for-tests-0001"
TURNAROUND = 30 * 60_000  # the default of policy.tenantRoot: true
HOST_KEYS = ["SHA256:" + "h" * 43]


async def create_node(api, key: str = "n", **fields):
    return await api.create(key=key, binding="node", gpuCount=None, access=NODE_ACCESS, **fields)


async def node_state(api, node_id: str) -> dict:
    status, doc = await api.post("/api/admin/nodes/get", ADMIN, {"nodeId": node_id})
    assert status == 200, doc
    return doc["node"]


async def fleet_events(api) -> list[dict]:
    status, doc = await api.post("/api/admin/events/list", ADMIN, {"limit": 500})
    assert status == 200, doc
    return doc["events"]


def ssh_of(host: str) -> dict:
    return {"host": host, "port": 22, "user": "root", "hostKeys": HOST_KEYS}


async def bound_node(api, key: str = "n", **fields) -> tuple[dict, dict]:
    """A node binding on h1 or h2, reported bound with its ssh; (the reservation as get shows it, its node's
    register answer)."""
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    status, doc = await create_node(api, key, **fields)
    assert status == 202, doc
    res = doc["reservation"]
    await api.settle()
    node = nodes[res["placements"][0]["nodeId"]]
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "bound", "ssh": ssh_of(f"{node['nodeId']}.test")}]})
    assert [res["id"]] == rep["accepted"], rep
    return await api.ok("get", "alice", {"reservationId": res["id"]}), node


async def hand_back(api, res: dict, node: dict) -> None:
    """Release the reservation and have its agent report the hand-back (keys removed, sessions ended)."""
    await api.ok("release", "alice", {"reservationId": res["id"]})
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "unbound"}]})
    assert [res["id"]] == rep["accepted"], rep


# ---- access.sshKeys ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, field, rule", [
    ([ssh_key(1), "ssh-dss AAAAB3NzaC1kc3M= old"], "access.sshKeys[1]", "type"),
    (["ssh-ed25519 not*base64"], "access.sshKeys[0]", "base64"),
    (['command="sh" ' + ssh_key(1)], "access.sshKeys[0]", "options"),
    ([ssh_key(1) + "\nssh-ed25519 AAAA"], "access.sshKeys[0]", "one-line"),
    ([""], "access.sshKeys[0]", "empty"),
    ([ssh_key(1), ssh_key(2), ssh_key(1, "again")], "access.sshKeys[2]", "duplicate"),
    ([], "access.sshKeys", None),
    ([ssh_key(i) for i in range(17)], "access.sshKeys", None),
    ([42], "access.sshKeys[0]", None),
])
async def test_every_bad_key_is_invalid_input_naming_its_place_and_rule(api, keys, field, rule):
    status, doc = await api.create(key="bad", binding="node", gpuCount=None, access={"sshKeys": keys})
    assert (400, "INVALID_INPUT", field) == (status, doc["error"]["code"], doc["error"]["details"]["field"]), doc
    if rule is not None:
        assert rule == doc["error"]["details"]["rule"]
    assert doc["error"]["message"].startswith(field + ":")
    assert {} == api.cp.state.calendar.by_reservation


async def test_access_is_required_for_a_node_binding_and_refused_for_the_others(api):
    status, doc = await api.create(key="none", binding="node", gpuCount=None)
    assert (400, "access.sshKeys") == (status, doc["error"]["details"]["field"])
    assert "required for binding 'node'" in doc["error"]["message"]
    status, doc = await api.create(key="hold", access=NODE_ACCESS)
    assert (400, "access") == (status, doc["error"]["details"]["field"])
    assert "only binding 'node'" in doc["error"]["message"]
    assert {} == api.cp.state.calendar.by_reservation


async def test_a_node_binding_in_a_pool_without_nodes_is_no_capacity_as_a_hold_would_be(api):
    doc = bootstrap_doc()
    doc["pools"].append({"id": "bare", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "policy": {"tenantRoot": True}})
    assert 200 == (await api.post("/api/admin/bootstrap", ADMIN, doc))[0]
    for count in (None, 8):  # its size cannot be told from its nodes, nor checked against them
        status, refused = await api.create(key=f"bare{count}", binding="node", access=NODE_ACCESS, poolId="bare",
                                           gpuCount=count)
        assert (409, "NO_CAPACITY", "no_stock") == (status, refused["error"]["code"],
                                                    refused["error"]["details"]["reason"]), refused
        assert refused["error"]["message"].startswith("pool bare can never hold a node binding: none of its 0 "
                                                      "nodes has H100_80GB to give")


async def test_a_node_binding_asking_a_gpu_count_is_placed_only_on_nodes_with_that_many(api):
    """A QA pass booked gpuCount 8 as a node binding and got a node with 2 GPUs (billed for 8): placement took any
    node whose units were all free. Now only a node with the count asked."""
    doc = bootstrap_doc()
    doc["pools"].append({"id": "mixed", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "policy": {"tenantRoot": True}})
    small = {**h100_node("small", pool="mixed", vcpu=8, memory=32, hugepages=0), "gpus": [{"numaNode": 0}] * 2}
    doc["nodes"] += [small, h100_node("big", pool="mixed")]
    doc["tenants"][0]["quota"].update({"gpu:H100_80GB": 64, "vcpu": 1000, "memoryGiB": 10_000})  # whole hosts
    assert 200 == (await api.post("/api/admin/bootstrap", ADMIN, doc))[0]
    placed = []
    for key in ("first", "second"):
        status, got = await api.create(key=key, binding="node", access=NODE_ACCESS, poolId="mixed", gpuCount=8)
        assert 202 == status, got
        placed.append((got["reservation"]["state"], [p["nodeId"] for p in got["reservation"]["placements"]]))
    assert [("placed", ["big"]), ("pending", [])] == placed
    status, got = await api.create(key="two", binding="node", access=NODE_ACCESS, poolId="mixed", gpuCount=2)
    assert 202 == status, got
    assert ["small"] == [p["nodeId"] for p in got["reservation"]["placements"]]


async def test_the_keys_are_part_of_the_compared_request(api):
    first = (await create_node(api, "same"))[1]["reservation"]
    assert {"sshKeys": [ssh_key(1)], "user": "root"} == first["access"]
    spaced = ssh_key(1).replace(" ", "   ")  # the same key, spaced otherwise: the same request
    status, again = await api.create(key="same", binding="node", gpuCount=None, access={"sshKeys": [spaced]})
    assert (202, first["id"]) == (status, again["reservation"]["id"])
    status, other = await api.create(key="same", binding="node", gpuCount=None, access={"sshKeys": [ssh_key(2)]})
    assert (409, "CONFLICT", "idempotency-key-reused") == (status, other["error"]["code"],
                                                          other["error"]["details"]["reason"])


# ---- the binding, the hand-over, billing ---------------------------------------------------------------------

async def test_the_agent_gets_the_keys_the_account_and_the_cleaning_with_the_window_end(api):
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await api.create(key="w", binding="node", gpuCount=None, access={"sshKeys": [
        ssh_key(3, "laptop"), "  " + ssh_key(4, "ci")]}))[1]["reservation"]
    await api.settle()
    node = nodes[res["placements"][0]["nodeId"]]
    status, watch = await node_call(api, "watch", node["nodeToken"], {"timeoutMs": 0})
    [binding] = watch["bindings"]
    assert ("node", [ssh_key(3, "laptop"), ssh_key(4, "ci")], "root", "inband") == (
        binding["kind"], binding["sshKeys"], binding["user"], binding["cleaning"])
    assert (res["end"], 8) == (binding["end"], len(binding["units"]))


async def test_a_bound_report_with_ssh_shows_on_get_and_bills_from_then_to_the_release_only(api):
    res, node = await bound_node(api)
    assert "active" == res["state"]
    [bound] = res["bound"]
    assert ssh_of(f"{node['nodeId']}.test") == bound["ssh"]
    assert res["turnaroundMinutes"] == 30
    api.clock.advance(10 * 60_000)
    await hand_back(api, res, node)
    await api.settle(2 * HOUR)
    [(rid, _pool, _hourly, start, end)] = api.cp.store.billing("acme")
    assert (res["id"], T0, T0 + 10 * 60_000) == (rid, start, end)  # the window until the release, not the turnaround


async def test_a_failed_hand_over_fails_the_create_as_the_platforms_doing_and_bills_nothing(api):
    nodes = {n["nodeId"]: n for n in [await register(api, "h1.test"), await register(api, "h2.test")]}
    res = (await create_node(api, "f"))[1]["reservation"]
    await api.settle()
    node = nodes[res["placements"][0]["nodeId"]]
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "failed", "message": "user root: no such account"}]})
    assert [res["id"]] == rep["accepted"]
    got = await api.ok("get", "alice", {"reservationId": res["id"]})
    op = got["operation"]
    assert ("released", "failed", "platform", "handover_failed") == (
        got["state"], op["status"], op["failure"]["actor"], op["failure"]["code"])
    assert "no such account" in op["failure"]["message"]
    assert op["failure"]["next"].startswith("Nothing in your request needs to change: the node's message says what "
                                            "its operator must fix. Create again with a new idempotency key")
    assert [] == api.cp.store.billing("acme")


# ---- the turnaround ------------------------------------------------------------------------------------------

async def test_the_next_booking_of_the_node_waits_for_the_turnaround_and_a_quote_says_when(api):
    await register(api, "h1.test")
    await register(api, "h2.test")
    res = (await create_node(api, "both", nodeCount=2))[1]["reservation"]
    end = res["end"]
    assert T0 + HOUR == end
    status, doc = await api.call("quote", "alice", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1,
                                                    "durationHours": 1})
    assert (200, end + TURNAROUND) == (status, doc["quote"]["earliestStart"]), doc
    during = (await api.create(key="during", start=end + TURNAROUND // 2, durationHours=1))[1]["reservation"]
    assert "pending" == during["state"]
    after = (await api.create(key="after", start=end + TURNAROUND, durationHours=1))[1]["reservation"]
    assert "placed" == after["state"]


async def test_a_window_end_seen_late_keeps_the_node_only_until_the_next_booking_and_the_reconciler_goes_on(api):
    """The end timer fires a little after the window's end (always, on a real clock): the node is kept for its
    cleaning until the end of the turnaround booked after the window, not the turnaround after now, which would
    overlap the next booking. That overlap used to fail every reconciler pass, for every pool, from then on."""
    await register(api, "h1.test")
    await register(api, "h2.test")
    res = (await create_node(api, "both", nodeCount=2))[1]["reservation"]
    end = res["end"]
    after = (await api.create(key="after", start=end + TURNAROUND, durationHours=1))[1]["reservation"]
    other = (await api.create(key="other", poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb",
                              gpuCount=1, durationHours=1))[1]["reservation"]  # another pool, ending with it
    assert ("placed", other["end"]) == (after["state"], end)
    await api.settle()
    await api.settle(HOUR + 250)  # the end timer, 250 ms late
    state = {r["id"]: r["state"] for r in (await api.ok("list", "alice", {}))["reservations"]}
    assert ("released", "released", "placed") == (state[res["id"]], state[other["id"]], state[after["id"]])
    await api.settle(TURNAROUND)  # the next booking's start
    assert "binding" == (await api.ok("get", "alice", {"reservationId": after["id"]}))["state"]


async def test_a_node_binding_fits_only_where_its_own_turnaround_is_free(api):
    later = T0 + HOUR + TURNAROUND // 2
    for key in ("h1", "h2"):  # both nodes booked from half a turnaround after an hour from now
        assert "placed" == (await api.create(key=key, gpuCount=8, start=later))[1]["reservation"]["state"]
    status, doc = await create_node(api, "hour", durationHours=1)
    assert (202, "pending") == (status, doc["reservation"]["state"]), doc
    status, doc = await create_node(api, "half", durationHours=0.5)
    assert (202, "placed") == (status, doc["reservation"]["state"]), doc


async def test_an_extension_keeps_room_for_the_turnaround(api):
    res, _node = await bound_node(api, nodeCount=1)
    node_id = res["placements"][0]["nodeId"]
    other = "h2" if node_id == "h1" else "h1"
    # fill the other node, so a whole-node booking after the window must come to this one
    await api.create(key="other", gpuCount=8, durationHours=10)
    later = (await api.create(key="later", gpuCount=8, start=res["end"] + 2 * HOUR, durationHours=1))[1]
    assert node_id == later["reservation"]["placements"][0]["nodeId"], later
    status, doc = await api.call("extend", "alice", {"reservationId": res["id"], "by": 2 * HOUR})
    assert (202, False, res["end"] + 2 * HOUR - TURNAROUND) == (status, doc["extended"], doc["availableUntil"]), doc
    assert other != node_id


# ---- cleaning inband -----------------------------------------------------------------------------------------

async def test_the_hand_back_cleans_the_node_and_a_good_check_returns_it(api):
    res, node = await bound_node(api)
    node_id = node["nodeId"]
    await hand_back(api, res, node)
    seen = await node_state(api, node_id)
    assert ("cleaning", False) == (seen["state"], seen["placeable"])
    # the other node takes the next node binding; a third waits
    nxt = (await create_node(api, "next", start=T0 + HOUR + TURNAROUND + 1))[1]["reservation"]
    assert node_id != nxt["placements"][0]["nodeId"]
    waiting = (await create_node(api, "waiting", start=T0 + HOUR + TURNAROUND + 1))[1]["reservation"]
    assert "pending" == waiting["state"]
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": True}}]})
    assert [res["id"]] == rep["accepted"], rep
    assert "ready" == (await node_state(api, node_id))["state"]
    await api.settle()
    assert [node_id] == [p["nodeId"] for p in (await api.ok("get", "alice", {"reservationId": waiting["id"]}))[
        "placements"]]
    types = [(e["type"], e["data"]["state"]) for e in await fleet_events(api) if e["data"].get("nodeId") == node_id]
    assert [("node.cleaning", "cleaning"), ("node.cleaned", "ready")] == types
    # a repeated good check for a node not being cleaned changes nothing
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": True}}]})
    assert ([], "ready") == (rep["accepted"], (await node_state(api, node_id))["state"])


async def test_a_bad_check_that_comes_after_the_cleaning_ended_still_takes_the_node_out(api):
    """The cleaning timed out (maintenance) and an operator cleared the node before the agent's check came, which
    found it not clean: the control plane ignored it, the node stayed ready, and the agent (which refuses a node it
    found not clean until the control plane takes it out and puts it back) refused every booking placed there."""
    res, node = await bound_node(api)
    node_id = node["nodeId"]
    await hand_back(api, res, node)
    await api.settle(TURNAROUND)
    assert "maintenance" == (await node_state(api, node_id))["state"]
    status, _ = await api.post("/api/admin/nodes/clear", ADMIN, {"nodeId": node_id})
    assert (200, "ready") == (status, (await node_state(api, node_id))["state"])
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": False, "differences": ["scratch: x"]}}]})
    seen = await node_state(api, node_id)
    assert ([res["id"]], "maintenance") == (rep["accepted"], seen["state"]), rep
    assert "reported after its cleaning had ended: scratch: x" in seen["stateReason"]
    status, doc = await node_call(api, "heartbeat", node["nodeToken"], {})
    assert "maintenance" == doc["nodeState"]  # what the agent hears, and then the operator's clear
    status, doc = await node_call(api, "watch", node["nodeToken"], {"timeoutMs": 0})
    assert "maintenance" == doc["nodeState"]


async def test_a_bad_check_puts_the_node_in_maintenance_until_an_operator_clears_it(api):
    res, node = await bound_node(api)
    node_id = node["nodeId"]
    await hand_back(api, res, node)
    differences = ["gpus[GPU-1].migMode.current: False -> True", "a process of uid 0 outside the baseline: crond"]
    await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": False, "differences": differences}}]})
    seen = await node_state(api, node_id)
    assert ("maintenance", False) == (seen["state"], seen["placeable"])
    assert seen["stateReason"].startswith("CleaningFailed:") and all(d in seen["stateReason"] for d in differences)
    [event] = [e for e in await fleet_events(api) if e["type"] == "node.maintenance"]
    assert ("CleaningFailed", "platform", node_id) == (event["data"]["reason"], event["data"]["by"],
                                                       event["data"]["nodeId"])
    api.clock.advance(2 * HOUR)  # past the turnaround: still held out
    await api.settle()
    nxt = (await create_node(api, "next"))[1]["reservation"]
    assert node_id != nxt["placements"][0]["nodeId"]
    waiting = (await create_node(api, "waiting"))[1]["reservation"]
    assert "pending" == waiting["state"]
    status, cleared = await api.post("/api/admin/nodes/clear", ADMIN, {"nodeId": node_id})
    assert (200, "ready") == (status, cleared["node"]["state"]), cleared
    await api.settle()
    got = await api.ok("get", "alice", {"reservationId": waiting["id"]})
    assert [node_id] == [p["nodeId"] for p in got["placements"]]


async def test_a_cleaning_past_the_turnaround_puts_the_node_in_maintenance(api):
    res, node = await bound_node(api)
    await hand_back(api, res, node)
    await api.settle(TURNAROUND - 1000)
    assert "cleaning" == (await node_state(api, node["nodeId"]))["state"]
    await api.settle(1000)
    seen = await node_state(api, node["nodeId"])
    assert "maintenance" == seen["state"] and seen["stateReason"].startswith("CleaningTimedOut:")
    assert "no clean check came from its agent" in seen["stateReason"]


async def test_an_operators_cordon_outlives_the_cleaning(api):
    res, node = await bound_node(api)
    status, _ = await api.post("/api/admin/nodes/cordon", ADMIN, {"nodeId": node["nodeId"]})
    assert 200 == status
    await hand_back(api, res, node)
    await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": True}}]})
    assert "cordoned" == (await node_state(api, node["nodeId"]))["state"]


async def test_a_cordon_or_drain_given_while_the_node_is_cleaned_is_what_it_returns_to(api):
    res, node = await bound_node(api)
    await hand_back(api, res, node)
    assert "cleaning" == (await node_state(api, node["nodeId"]))["state"]
    status, doc = await api.post("/api/admin/nodes/cordon", ADMIN, {"nodeId": node["nodeId"], "reason": "PSU"})
    assert (200, True, "cleaning") == (status, doc["changed"], doc["node"]["state"])
    status, doc = await api.post("/api/admin/nodes/cordon", ADMIN, {"nodeId": node["nodeId"]})
    assert (200, False) == (status, doc["changed"])  # asked again: nothing more
    cordoned = [e for e in await fleet_events(api) if e["type"] == "node.cordoned"]
    assert [("cleaning", "cordoned", "PSU")] == [(e["data"]["state"], e["data"]["returnsTo"], e["data"]["reason"])
                                                 for e in cordoned]
    status, refused = await api.post("/api/admin/nodes/uncordon", ADMIN, {"nodeId": node["nodeId"]})
    assert (409, "wait") == (status, refused["error"]["details"]["next"])
    assert refused["error"]["message"].endswith("the node is being cleaned: when clean it returns to cordoned (to "
                                                "maintenance if the cleaning fails)"), refused
    await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": True}}]})
    assert "cordoned" == (await node_state(api, node["nodeId"]))["state"]  # it used to come back ready
    status, _ = await api.post("/api/admin/nodes/uncordon", ADMIN, {"nodeId": node["nodeId"]})
    assert 200 == status


# ---- the bootstrap file: policy.tenantRoot and bmc -------------------------------------------------------------

def metal_doc(bmc: dict | None, **root) -> dict:
    doc = bootstrap_doc()
    doc["pools"].append({"id": "metal", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "policy": {"tenantRoot": {"cleaning": "redfish", "turnaroundMinutes": 20,
                                                   "bootOverride": "Pxe", **root}}})
    node = h100_node("r1", pool="metal")
    if bmc is not None:
        node["bmc"] = bmc
    doc["nodes"].append(node)
    doc["nodeTokens"].append({"pool": "metal", "token": METAL_BOOT})
    doc["tenants"][0]["quota"]["gpu:H100_80GB"] = 64
    return doc


METAL_BOOT = "node-token-metal-00001"


def test_policy_tenant_root_defaults_and_its_rules(tmp_path):
    catalog, _, _ = parse(json.dumps(bootstrap_doc()).encode())
    policy = catalog.pools["h100"].policy
    assert (True, "root", "inband", 30 * 60_000, "") == (policy.tenant_root, policy.root_user, policy.cleaning,
                                                          policy.turnaround_ms, policy.boot_override)
    with pytest.raises(BootstrapError, match=r"nodes\[8\]\.bmc: required: pool metal cleans"):
        parse(json.dumps(metal_doc(None)).encode())
    loose = tmp_path / "loose.json"
    loose.write_text('{"username": "u", "password": "p"}')
    loose.chmod(0o644)
    with pytest.raises(BootstrapError, match=r"nodes\[8\]\.bmc: .*chmod 600"):
        parse(json.dumps(metal_doc({"redfishUrl": "http://127.0.0.1:9", "systemId": "s",
                                    "credentialsFile": str(loose)})).encode())
    for root, where in (({"user": "Root!"}, "tenantRoot.user"), ({"turnaroundMinutes": 0}, "turnaroundMinutes"),
                        ({"cleaning": "wipe"}, "tenantRoot.cleaning: invalid enum value 'wipe': give one of "
                                               "'inband', 'redfish'"),
                        ({"cleaning": "inband"}, "tenantRoot.bootOverride")):
        doc = metal_doc(None, **root)
        doc["nodes"].pop()
        with pytest.raises(BootstrapError, match=where):
            parse(json.dumps(doc).encode())


# ---- cleaning redfish, against the real emulator ---------------------------------------------------------------

try:
    import bcrypt  # noqa: F401 - the emulator's htpasswd file
    import sushy  # noqa: F401
    import sushy_tools  # noqa: F401
except ImportError:
    bmc_tests = None
else:
    from tests.controlplane import test_bmc as bmc_tests

    emulator, credentials = bmc_tests.emulator, bmc_tests.credentials  # the emulator's fixtures
    tls_emulator = bmc_tests.tls_emulator
needs_bmc = pytest.mark.skipif(bmc_tests is None, reason="sushy, sushy-tools and bcrypt (the Redfish emulator)")
MACHINE = "c" * 32


@pytest.fixture
def metal_with(aiohttp_client, tmp_path, bootstrap_file, clock, emulator, credentials):
    """A control plane whose pool metal cleans by redfish, r1's BMC the emulator's system `system_id`."""
    async def start(system_id: str):
        doc = metal_doc({"redfishUrl": emulator.url, "systemId": system_id, "credentialsFile": str(credentials)})
        config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(doc), clock=clock,
                        synchronous="NORMAL", reconcile=False)
        return Api(await aiohttp_client(create_app(config)), clock), emulator

    return start


@pytest.fixture
async def metal(metal_with):
    return await metal_with(bmc_tests.RUNNING)


def booted(boot_id: str, inv: dict | None = None) -> dict:
    inv = copy.deepcopy(inv or inventory("r1.test"))
    inv["bootId"] = boot_id
    return inv


async def register_metal(api, inv: dict) -> dict:
    status, doc = await node_call(api, "register", METAL_BOOT, {"hostname": "r1.test", "inventory": inv,
                                                                "machineId": MACHINE})
    assert status == 200, doc
    return doc


async def handed_back(api) -> tuple[dict, dict]:
    """r1 registered from boot-1, a node binding bound there and handed back; (its reservation, register answer)."""
    first = booted("boot-1")
    node = await register_metal(api, first)
    res = (await api.create(key="m", poolId="metal", binding="node", gpuCount=None, access=NODE_ACCESS))[1][
        "reservation"]
    await api.settle()
    await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "bound", "ssh": ssh_of("r1.test")}]})
    assert "active" == (await api.ok("get", "alice", {"reservationId": res["id"]}))["state"]
    await hand_back(api, res, node)
    return res, node


@needs_bmc
@pytest.mark.slow
async def test_redfish_resets_the_node_and_only_a_new_boot_as_handed_over_returns_it(metal):
    api, bmc = metal
    res, node = await handed_back(api)
    assert "cleaning" == (await node_state(api, "r1"))["state"]
    await api.cp.reconciler.drain()  # the reset, in its worker thread
    assert "Pxe" == bmc.system(bmc_tests.RUNNING)["Boot"]["BootSourceOverrideTarget"]
    [reset] = [e for e in await fleet_events(api) if e["type"] == "node.reset"]
    assert ("ForceRestart", "Pxe", res["id"]) == (reset["data"]["reset"], reset["data"]["bootOverride"],
                                                 reset["data"]["reservationId"])
    status, _ = await node_call(api, "heartbeat", node["nodeToken"], {"inventory": booted("boot-1")})
    assert (200, "cleaning") == (status, (await node_state(api, "r1"))["state"])  # the same boot: not back yet
    status, rep = await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": True}}]})
    assert "out of band (redfish)" in rep["ignored"][0]["reason"]  # not the agent's say
    await register_metal(api, booted("boot-2"))  # back from the reset's boot, as it was handed over
    assert "ready" == (await node_state(api, "r1"))["state"]
    assert ["node.cleaning", "node.reset", "node.cleaned"] == [
        e["type"] for e in await fleet_events(api) if e["data"].get("nodeId") == "r1"]


@needs_bmc
@pytest.mark.slow
async def test_a_reset_asked_by_a_control_plane_that_died_before_the_bmc_answered_is_asked_again_at_start(
        aiohttp_client, tmp_path, bootstrap_file, clock, emulator, credentials, monkeypatch):
    from controlplane.cleaning import Cleaner

    doc = metal_doc({"redfishUrl": emulator.url, "systemId": bmc_tests.RUNNING, "credentialsFile": str(credentials)})
    config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(doc), clock=clock,
                    synchronous="NORMAL", reconcile=False)
    first = Api(await aiohttp_client(create_app(config)), clock)
    asking = Cleaner._ask_reset

    async def died_before_asking(self, node, node_id, reservation_id):
        return None  # the hand-back committed, the process gone before its BMC request

    monkeypatch.setattr(Cleaner, "_ask_reset", died_before_asking)
    res, _ = await handed_back(first)
    await first.cp.reconciler.drain()
    assert [] == [e for e in await fleet_events(first) if e["type"] == "node.reset"]
    await first.client.close()

    monkeypatch.setattr(Cleaner, "_ask_reset", asking)
    again = Api(await aiohttp_client(create_app(config)), clock)  # the restart, on the same database
    await again.cp.reconciler.drain()
    [reset] = [e for e in await fleet_events(again) if e["type"] == "node.reset"]
    assert ("ForceRestart", res["id"]) == (reset["data"]["reset"], reset["data"]["reservationId"])
    assert "Pxe" == emulator.system(bmc_tests.RUNNING)["Boot"]["BootSourceOverrideTarget"]


@needs_bmc
@pytest.mark.slow
async def test_redfish_over_https_trusts_the_private_ca_named_by_ca_file_beside_the_bootstrap_file(
        aiohttp_client, tmp_path, bootstrap_file, clock, tls_emulator, credentials):
    emulator, authority = tls_emulator
    assert tmp_path == authority.ca_file.parent == Path(bootstrap_file()).parent  # "caFile" relative to it
    doc = metal_doc({"redfishUrl": emulator.url, "systemId": bmc_tests.RUNNING, "credentialsFile": str(credentials),
                     "caFile": authority.ca_file.name})
    config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(doc), clock=clock,
                    synchronous="NORMAL", reconcile=False)
    api = Api(await aiohttp_client(create_app(config)), clock)
    assert str(authority.ca_file) == api.cp.catalog.current.nodes["r1"].bmc.ca_file
    res, _ = await handed_back(api)
    await api.cp.reconciler.drain()  # the reset, over https, in its worker thread
    [reset] = [e for e in await fleet_events(api) if e["type"] == "node.reset"]
    assert ("ForceRestart", res["id"]) == (reset["data"]["reset"], reset["data"]["reservationId"])
    assert "Pxe" == emulator.system(bmc_tests.RUNNING)["Boot"]["BootSourceOverrideTarget"]


@needs_bmc
def test_a_bmc_ca_file_that_is_not_a_ca_bundle_stops_the_bootstrap_naming_the_node(tmp_path, credentials):
    (tmp_path / "notes.txt").write_text("not a certificate\n")
    for ca_file, expected in (("absent.pem", f"bmc.caFile {tmp_path / 'absent.pem'} does not exist"),
                              ("notes.txt", "is not a PEM bundle of CA certificates")):
        doc = metal_doc({"redfishUrl": "https://127.0.0.1:9", "systemId": "s", "credentialsFile": str(credentials),
                         "caFile": ca_file})
        with pytest.raises(BootstrapError) as err:
            parse(json.dumps(doc).encode(), base_dir=tmp_path)
        assert (True, True) == (str(err.value).startswith("nodes[8].bmc: "), expected in str(err.value)), err.value


@needs_bmc
@pytest.mark.slow
async def test_redfish_a_node_back_unlike_it_was_handed_over_goes_to_maintenance(metal):
    api, _bmc = metal
    await handed_back(api)
    await api.cp.reconciler.drain()
    changed = booted("boot-2")
    changed["gpus"] = changed["gpus"][:7]  # a GPU gone after the tenant had root
    await register_metal(api, changed)
    seen = await node_state(api, "r1")
    assert "maintenance" == seen["state"] and "unlike it was handed over" in seen["stateReason"]
    assert "removed" in seen["stateReason"]


@needs_bmc
@pytest.mark.slow
async def test_redfish_a_node_not_back_within_the_turnaround_goes_to_maintenance(metal):
    api, _bmc = metal
    await handed_back(api)
    await api.cp.reconciler.drain()
    await api.settle(20 * 60_000)
    seen = await node_state(api, "r1")
    assert "maintenance" == seen["state"] and "did not come back from a new boot" in seen["stateReason"]


@needs_bmc
@pytest.mark.slow
async def test_redfish_a_reset_the_bmc_refuses_puts_the_node_in_maintenance_at_once(metal_with):
    api, _bmc = await metal_with("no-such-system")
    await handed_back(api)
    await api.cp.reconciler.drain()
    seen = await node_state(api, "r1")
    assert "maintenance" == seen["state"] and seen["stateReason"].startswith("ResetFailed:")
    assert "no system 'no-such-system'" in seen["stateReason"]


async def test_a_node_gone_to_maintenance_sends_its_bookings_that_have_not_started_elsewhere_or_to_pending(api):
    res, node = await bound_node(api)
    node_id = node["nodeId"]
    other = "h2" if node_id == "h1" else "h1"
    status, doc = await api.post("/api/admin/nodes/cordon", ADMIN, {"nodeId": other})  # so the later one is here
    assert 200 == status, doc
    status, doc = await create_node(api, "later", start=T0 + 5 * HOUR, end=T0 + 6 * HOUR)
    assert 202 == status, doc
    on_it = doc["reservation"]
    assert [node_id] == [p["nodeId"] for p in on_it["placements"]]
    await hand_back(api, res, node)
    await node_call(api, "report", node["nodeToken"], {"reports": [
        {"reservationId": res["id"], "status": "cleaned", "clean": {"ok": False, "differences": ["GPU 3 lost"]}}]})
    assert "maintenance" == (await node_state(api, node_id))["state"]
    got = await api.ok("get", "alice", {"reservationId": on_it["id"]})
    assert ("pending", []) == (got["state"], got["placements"])  # the other node is cordoned
    assert any(c["reason"] == "NodeMaintenance" for c in got["conditions"]), got["conditions"]
    moved = [e for e in await api.events() if e["reservationId"] == on_it["id"] and e["type"] == "reservation.pending"]
    assert "maintenance" == moved[-1]["data"]["reason"]
    [event] = [e for e in await fleet_events(api) if e["type"] == "node.maintenance"]
    assert (0, 1) == (event["data"].get("moved", 0), event["data"]["pending"])
