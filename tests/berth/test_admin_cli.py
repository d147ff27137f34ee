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

from berth import client as c
from tests.berth.test_tenant_cli import Run
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.controlplane.test_fleet import OPERATOR_POLICIES, OPERATORS
from tests.serverproc import ServerProcess

ADMIN = bootstrap_doc()["adminToken"]
HOUR = 3_600_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    doc = bootstrap_doc()
    doc["principals"] += OPERATORS
    doc["policies"] += OPERATOR_POLICIES
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
    tenant = berth("admin", "nodes", "list", token=TOKENS["alice"])
    assert 3 == tenant.code
    assert "neither the bootstrap file's adminToken nor an operator's" in tenant.err
    olga = OPERATORS[0]["token"]
    assert 0 == berth("admin", "nodes", "cordon", "h1", token=olga).code
    denied = berth("admin", "nodes", "drain", "h1", token=olga)
    assert (3, True) == (denied.code, 'Action::"fleet:nodes:drain"' in denied.err)
    read_only = berth("admin", "nodes", "uncordon", "h1", token=OPERATORS[1]["token"])
    assert 3 == read_only.code and "COMPUTE_ACCESS_REQUIRED" in read_only.err
