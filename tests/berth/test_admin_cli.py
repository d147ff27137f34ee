"""The real `berth admin nodes|pools|tenants|events ...` against a `berth controlplane serve` process: tables on a
terminal, the API's JSON otherwise, and every refusal with the command to run next (which works when run)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest
import yaml

from berth import client as c
from tests.berth.test_tenant_cli import Run
from tests.controlplane.conftest import TOKENS, bootstrap_doc, h100_node, ssh_key
from tests.controlplane.test_fleet import OPERATOR_POLICIES, OPERATORS
from tests.serverproc import ServerProcess
from tests.waiting import wait_for

ADMIN = bootstrap_doc()["adminToken"]
HOUR = 3_600_000
METAL_BOOT = "node-token-metal-000001"  # the boot token of pool metal, whose node r1's agent registers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    doc = bootstrap_doc()
    doc["principals"] += OPERATORS
    doc["policies"] += OPERATOR_POLICIES
    # A pool of node bindings of its own, whose node's agent registers and hands a node back (it cleans then).
    doc["pools"].append({"id": "metal", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "pricePerGpuHourUsd": "1", "policy": {"tenantRoot": True}})
    doc["nodes"].append(h100_node("r1", pool="metal"))
    doc["nodeTokens"].append({"pool": "metal", "token": METAL_BOOT})
    d = tmp_path_factory.mktemp("admin-cli")
    (d / "b.json").write_text(json.dumps(doc))
    proc = ServerProcess(d / "cp.db", d / "b.json").start()
    yield proc
    proc.stop()


@pytest.fixture
def berth(server, tmp_path):
    def run(*argv: str, token: str = ADMIN, tty: bool = False) -> Run:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
        environ.update({"XDG_CONFIG_HOME": str(tmp_path), "BERTH_URL": server.url, "BERTH_TOKEN": token})
        if tty:
            environ["BERTH_FORCE_TTY"] = "1"
        out = subprocess.run([sys.executable, "-m", "berth", *argv], capture_output=True, text=True, env=environ,
                             timeout=60)
        return Run(out.returncode, out.stdout, out.stderr)

    return run


@pytest.fixture(autouse=True)
def clean(server):
    yield
    with c.Client(server.url, ADMIN) as admin:
        for node in admin.list_nodes():
            if node.admin_state in ("cordoned", "draining"):
                admin.uncordon_node(node.id)
    with c.Client(server.url, TOKENS["alice"]) as alice:
        for r in alice.list(limit=200).reservations:
            if r.state not in ("released", "cancelled"):
                alice.release(r.id)


def future_booking(server, gpus: int = 1, in_hours: int = 3) -> c.Reservation:
    start = (int(time.time() * 1000) // HOUR + in_hours) * HOUR
    with c.Client(server.url, TOKENS["alice"]) as alice:
        return alice.create("h100", "H100_80GB", gpu_count=gpus, start=start, end=start + HOUR)


def test_nodes_list_is_a_table_with_state_agent_heartbeat_and_bookings_now_and_next(server, berth):
    booked = future_booking(server)
    run = berth("admin", "nodes", "list", "--pool", "h100", tty=True)
    assert 0 == run.code, run.err
    lines = run.out.splitlines()
    assert ["NODE", "POOL", "STATE", "AGENT", "HEARTBEAT", "GPUS", "NOW", "NEXT"] == lines[0].split()
    row = next(line for line in lines if line.startswith(booked.placements[0].node_id + " "))
    assert "ready" in row and "declared" in row and "never" in row and f"{booked.id} (acme placed)" in row
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 30 * 86400))
    as_json = berth("admin", "nodes", "list", "--state", "ready", "--until", until)
    nodes = {n["id"]: n for n in json.loads(as_json.out)["nodes"]}  # piped: the API's JSON
    assert {"h1", "h2", "m1"} <= set(nodes) and booked.id in {b["reservationId"] for n in nodes.values()
                                                               for b in n["bookings"]}
    got = berth("admin", "nodes", "get", booked.placements[0].node_id, tty=True)
    assert 0 == got.code and "state              ready" in got.out and booked.id in got.out
    too_long = berth("admin", "nodes", "list", "--until", "2100-01-01T00:00:00Z")
    assert (3, "next: fix --until (at most 62 days after from)") == (too_long.code, too_long.err.splitlines()[-1])
    assert ["RESERVATION", "TENANT", "STATE", "BINDING", "START", "END", "DEVICES"] == next(
        line for line in got.out.splitlines() if line.startswith("RESERVATION")).split()


def test_cordon_is_idempotent_and_says_how_to_undo_it(berth):
    first = berth("admin", "nodes", "cordon", "h1", "--reason", "fan", tty=True)
    assert 0 == first.code, first.err
    assert "node h1: cordon done, now cordoned" in first.out
    assert "undo: berth admin nodes uncordon h1" in first.out
    again = berth("admin", "nodes", "cordon", "h1", "--json")
    assert (0, False, "cordoned") == (again.code, again.json["changed"], again.json["node"]["adminState"])
    back = berth("admin", "nodes", "uncordon", "h1", tty=True)
    assert "node h1: uncordon done, now ready" in back.out
    events = berth("admin", "events", "list", tty=True)
    assert ["SEQ", "AT", "EVENT", "NODE", "STATE", "BY", "REASON"] == events.out.splitlines()[0].split()
    assert "node.cordoned" in events.out and "ready -> cordoned" in events.out and "fan" in events.out


def test_an_empty_page_past_events_the_operator_may_not_read_says_where_to_list_on(berth):
    """olga reads the eu nodes: after a cordon of the us node m1, her page is empty but its cursor moved past it;
    the CLI says so and prints the command that lists on (from there, later events), not a bare "no events"."""
    last = berth("admin", "events", "list", "--json").json["nextCursor"] or 0
    berth("admin", "nodes", "cordon", "m1")
    page = berth("admin", "events", "list", "--after", str(last), token=OPERATORS[0]["token"], tty=True)
    assert 0 == page.code, page.err
    moved = berth("admin", "events", "list", "--after", str(last), "--json").json["events"][-1]["seq"]  # m1's
    assert f"no events of the nodes you may read up to {moved}" in page.out, page.out
    assert f"events committed later: berth admin events list --after {moved}" in page.out, page.out


def test_a_refused_action_prints_the_command_that_works_and_it_does(berth):
    berth("admin", "nodes", "cordon", "h2")
    refused = berth("admin", "nodes", "clear", "h2")
    assert 3 == refused.code
    assert "berth: INVALID_STATE (HTTP 409): clear h2: the node is cordoned, not in maintenance" in refused.err
    assert "state: cordoned" in refused.err
    nxt = refused.line("next:")
    assert nxt.startswith("berth admin nodes uncordon h2")
    done = berth(*shlex.split(nxt)[1:])
    assert (0, "ready") == (done.code, json.loads(done.out)["node"]["state"])
    missing = berth("admin", "nodes", "get", "nope")
    assert (3, "berth admin nodes list") == (missing.code, missing.line("next: see what exists:"))
    assert 0 == berth(*shlex.split(missing.line("next: see what exists:"))[1:]).code


def test_drain_moves_a_booking_that_has_not_started(server, berth):
    booked = future_booking(server, gpus=2)
    a = booked.placements[0].node_id
    b = "h2" if a == "h1" else "h1"
    run = berth("admin", "nodes", "drain", a, tty=True)
    assert 0 == run.code, run.err
    assert f"moved {booked.id} (acme) from {a} to {b}" in run.out
    assert f"undo: berth admin nodes uncordon {a}" in run.out


def test_pools_and_tenants(server, berth):
    with c.Client(server.url, TOKENS["alice"]) as alice:
        alice.create("h100", "H100_80GB", gpu_count=3, duration_hours=1)  # booked now: in use
    pools = berth("admin", "pools", "list", tty=True)
    assert ["POOL", "OWNER", "REGION", "MODEL", "SHARING", "PRICE", "NODES", "GPUS", "FREE/TOTAL", "IN", "USE",
            "PENDING"] == pools.out.splitlines()[0].split()
    row = next(line for line in pools.out.splitlines() if line.startswith("h100 "))
    assert "2 ready" in row and "13/16" in row
    pool = berth("admin", "pools", "get", "h100", tty=True)
    assert "16 total, 3 in use now, 13 free on ready nodes" in pool.out
    tenants = berth("admin", "tenants", "list", tty=True)
    assert ["TENANT", "BUDGET", "SPENT", "COMMITTED", "LIVE", "QUOTA", "USED/LIMIT"] == tenants.out.splitlines()[0].split()
    assert "gpu:H100_80GB 3/64" in next(line for line in tenants.out.splitlines() if line.startswith("acme "))
    acme = berth("admin", "tenants", "get", "acme", "--json")
    assert ({"gpu:H100_80GB": 3}, "100.000000") == (acme.json["tenant"]["used"], acme.json["tenant"]["budgetUsd"])


def test_who_may_use_the_admin_commands(berth):
    tenant = berth("admin", "nodes", "list", token=TOKENS["alice"])  # valid, but a tenant's: 403
    assert (3, True) == (tenant.code, "ACCESS_DENIED (HTTP 403)" in tenant.err), tenant.err
    assert ("is not one the admin API takes: give the admin token (the bootstrap file's adminToken) or an operator's "
            "token") in tenant.err
    unknown = berth("admin", "nodes", "list", token="token-nobody-has-0000001")
    assert (3, True) == (unknown.code, "neither the bootstrap file's adminToken nor an operator's" in unknown.err)
    as_tenant = berth("reservations", "list", token=OPERATORS[0]["token"])  # an operator's token on the tenant API
    assert (3, True) == (as_tenant.code, "is not a tenant's: give a tenant principal's token" in as_tenant.err), \
        as_tenant.err
    olga = OPERATORS[0]["token"]
    assert 0 == berth("admin", "nodes", "cordon", "h1", token=olga).code
    denied = berth("admin", "nodes", "drain", "h1", token=olga)
    assert (3, True) == (denied.code, 'Action::"fleet:nodes:drain"' in denied.err)
    read_only = berth("admin", "nodes", "uncordon", "h1", token=OPERATORS[1]["token"])
    assert 3 == read_only.code and "COMPUTE_ACCESS_REQUIRED" in read_only.err


# ---- -o json|yaml: the API's answer, as it came ----------------------------------------------------------------

# What the clock changes from one answer to the next (lastHeartbeat is now less the age: a millisecond either way).
MOVING = ("now", "heartbeatAgeSeconds", "lastHeartbeat")


def still(doc):
    """An answer with the values that move with the clock replaced by their type: two answers to the same call,
    a moment apart, then read the same (every field kept, in its order)."""
    if isinstance(doc, dict):
        return {k: type(v).__name__ if k in MOVING else still(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [still(v) for v in doc]
    return doc


def same(printed: Run, answer: dict) -> dict:
    """What the command printed is the API's answer to the same call: the same fields in the same order."""
    assert 0 == printed.code, printed.err
    assert json.dumps(still(answer)) == json.dumps(still(printed.json))
    return printed.json


def api(server, path: str, body: dict | None = None) -> dict:
    status, doc = server.post(f"/api/admin/{path}", ADMIN, body or {})
    assert 200 == status, doc
    return doc


def handed_back(server, berth) -> tuple[dict, str]:
    """r1's agent registers, a node binding is bound there (the tenant's get shows where to log in), released and
    handed back: r1 is cleaning, its stateReason saying why. (the register answer, the reservation's id)"""
    from tests.controlplane.test_nodes import inventory

    status, agent = server.post("/api/nodes/register", METAL_BOOT, {"hostname": "r1.test",
                                                                    "inventory": inventory("r1.test")})
    assert 200 == status, agent
    with c.Client(server.url, TOKENS["alice"]) as alice:
        res = alice.create("metal", "H100_80GB", binding="node", ssh_keys=(ssh_key(1),), duration_hours=1)
        wait_for(lambda: alice.get(res.id).state == "binding", timeout=5)
        ssh = {"host": "r1.test", "port": 2222, "user": "root", "hostKeys": ["SHA256:" + "h" * 43]}
        status, doc = server.post("/api/nodes/report", agent["nodeToken"], {"reports": [
            {"reservationId": res.id, "status": "bound", "ssh": ssh}]})
        assert [res.id] == doc["accepted"], doc
        shown = berth("reservations", "get", res.id, "--table", token=TOKENS["alice"]).out
        assert ["bound", "r1:", "log", "in", "with", "ssh", "-p", "2222", "root@r1.test", "(check", "its", "host",
                "key", "is", "one", "of:", f"SHA256:{'h' * 43})"] == next(
            line.split() for line in shown.splitlines() if line.startswith("bound")), shown
        alice.release(res.id)
    status, doc = server.post("/api/nodes/report", agent["nodeToken"], {"reports": [
        {"reservationId": res.id, "status": "unbound"}]})
    assert [res.id] == doc["accepted"], doc
    return agent, res.id


def test_json_and_yaml_print_the_apis_answer_as_it_came(server, berth):
    """-o json, --json, a pipe and -o yaml print the admin API's answer document itself: every field it sent
    (stateReason, conditions, now) and none it did not (release-identity answers five fields of a node); and,
    on the way, the tenant's get of its node binding says where to log in."""
    agent, rid = handed_back(server, berth)
    node = same(berth("admin", "nodes", "get", "r1", "-o", "json"), api(server, "nodes/get", {"nodeId": "r1"}))
    reason = f"cleaning (inband) after reservation {rid}: waiting for its agent's clean check"
    assert ("cleaning", reason, []) == (node["node"]["state"], node["node"]["stateReason"], node["node"]["conditions"])
    assert isinstance(node["now"], int)
    as_yaml = berth("admin", "nodes", "get", "r1", "-o", "yaml")
    assert (0, still(node)) == (as_yaml.code, still(yaml.safe_load(as_yaml.out)))
    shown = berth("admin", "nodes", "get", "r1", "--table")
    assert f"state reason       {reason}" in shown.out  # the table shows it too
    piped = same(berth("admin", "nodes", "list", "--pool", "metal"), api(server, "nodes/list", {"poolId": "metal"}))
    assert [("r1", reason, [])] == [(n["id"], n["stateReason"], n["conditions"]) for n in piped["nodes"]]
    same(berth("admin", "nodes", "list", "--json"), api(server, "nodes/list"))

    released = berth("admin", "nodes", "release-identity", "r1", "-o", "json")
    assert 0 == released.code, released.err
    machine = node["node"]["machineId"]  # what the registration recorded (none from a simulated host)
    assert {"node": {"id": "r1", "poolId": "metal", "hostname": "r1.test", "machineId": machine,
                     "identityReleased": True}} == released.json  # nothing made up: no state, inventory, ...
    same(released, api(server, "nodes/release-identity", {"nodeId": "r1"}))  # the same again, asked again

    cordoned = same(berth("admin", "nodes", "cordon", "h1", "-o", "json"), {
        **api(server, "nodes/cordon", {"nodeId": "h1"}), "changed": True})  # asked again: nothing changed
    assert ("cordoned", "", []) == (cordoned["node"]["state"], cordoned["node"]["stateReason"],
                                    cordoned["node"]["conditions"])
    assert 0 == berth("admin", "nodes", "uncordon", "h1").code
    for argv, path, body in [(("pools", "list"), "pools/list", {}),
                             (("pools", "get", "metal"), "pools/get", {"poolId": "metal"}),
                             (("tenants", "list"), "tenants/list", {}),
                             (("tenants", "get", "acme"), "tenants/get", {"tenantId": "acme"}),
                             (("events", "list"), "events/list", {})]:
        same(berth("admin", *argv, "-o", "json"), api(server, path, body))

    status, doc = server.post("/api/nodes/report", agent["nodeToken"], {"reports": [
        {"reservationId": rid, "status": "cleaned", "clean": {"ok": True}}]})
    assert [rid] == doc["accepted"], doc  # r1 ready again


def test_a_nodes_conditions_and_state_reason_read_as_the_api_sent_them():
    """What nodes get's table shows of a node held out by the platform (KubernetesReleaseStuck needs a cluster)."""
    from berth.cli.render import render_node

    stuck = {"type": "KubernetesReleaseStuck", "status": "True", "reservations": ["rsv_1"],
             "message": "pods still hold the devices of released rsv_1: carried on ..."}
    node = c.decode({"id": "k1", "poolId": "k8s", "hostname": "k1.test", "state": "maintenance",
                     "stateReason": "KubernetesReleaseStuck: pods of rsv_1", "conditions": [stuck]}, c.AdminNode)
    assert (["rsv_1"], "KubernetesReleaseStuck: pods of rsv_1") == (node.conditions[0].reservations, node.state_reason)
    text = render_node(node)
    assert "state reason       KubernetesReleaseStuck: pods of rsv_1" in text
    assert "condition          KubernetesReleaseStuck=True: pods still hold the devices of released rsv_1" in text
