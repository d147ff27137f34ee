"""binding: node end to end, with every part real: a control plane, an agent (--simulate) and a real sshd in a
network namespace with the shipped drop-in. A tenant books a whole node with a fresh key, logs in over SSH and
starts a long-running process; at release the session is closed, a new login is refused, the process is gone,
the node is cleaned in band and ready again, and the next booking of it starts only after the turnaround. A
node left changed is not clean: it goes to maintenance and takes no booking until an operator clears it."""
from __future__ import annotations

import json
import time

import pytest

from tests.agent.test_tenantroot import keygen_fingerprint, login, make_key
from tests.e2e.conftest import NODE_TOKEN, ControlPlane, bootstrap_doc, wait_for
from tests.e2e.sshd import gone, read_line, sshd_server, starttime_of, tenant_user  # noqa: F401

pytestmark = pytest.mark.kernel
ADMIN = "admin-token-e2e-00000001"
FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]
TURNAROUND_MIN = 1


def admin(cp: ControlPlane, path: str, body: dict) -> dict:
    status, doc = cp.post(f"/api/admin/{path}", body, token=ADMIN)
    assert 200 == status, doc
    return doc


@pytest.fixture
def metal(workdir, agents, sshd_server, bpf_works):
    """The control plane with pool `metal` (tenant root as the sshd's throwaway user, cleaned in band) and an agent
    making node bindings into the sshd's keys directory."""
    doc = bootstrap_doc()
    pool = next(p for p in doc["pools"] if p["id"] == "metal")
    pool["policy"] = {"tenantRoot": {"user": sshd_server.user, "cleaning": "inband",
                                     "turnaroundMinutes": TURNAROUND_MIN}}
    cp = ControlPlane(workdir, bootstrap=doc).start()
    try:
        a = agents("metal", cp.url, NODE_TOKEN, "h100", extra=[
            *FAST, "--ssh-keys-dir", str(sshd_server.keys_dir), "--ssh-host-keys", sshd_server.host_keys_glob,
            "--ssh-endpoint", f"{sshd_server.host}:{sshd_server.port}"])
        a.wait_event("reconciled", timeout=20)
        yield cp, a
        a.stop()
    finally:
        cp.stop()


def node_of(cp: ControlPlane, rid: str) -> str:
    return cp.get(rid)["placements"][0]["nodeId"]


def test_a_tenant_gets_root_over_ssh_and_the_node_comes_back_clean_after_the_turnaround(metal, sshd_server, tmp_path):
    cp, agent = metal
    private, public = make_key(tmp_path / "tenant")
    rid = cp.create(poolId="metal", gpuCount=8, binding="node", access={"sshKeys": [public.read_text().strip()]})["id"]
    res = cp.wait_state(rid, "active", timeout=5)
    [bound] = res["bound"]
    fingerprints = sorted(keygen_fingerprint(p) for p in sshd_server.host_keys)
    assert {"host": sshd_server.host, "port": sshd_server.port, "user": sshd_server.user,
            "hostKeys": fingerprints} == {**bound["ssh"], "hostKeys": sorted(bound["ssh"]["hostKeys"])}
    node = node_of(cp, rid)

    out = login(sshd_server, private)
    assert (0, sshd_server.user) == (out.returncode, out.stdout.strip()), out.stderr
    session = sshd_server.spawn(private, "echo $$; exec sleep 300")
    try:
        shell = int(read_line(session))
        mark = starttime_of(shell)
        released_at = int(time.time() * 1000)
        cp.release(rid)
        session.wait(10)  # closed by the hand-back
        assert gone(shell, mark)
        again = login(sshd_server, private)
        assert (255, True) == (again.returncode, "Permission denied" in again.stderr)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait(5)
    wait_for(lambda: admin(cp, "nodes/get", {"nodeId": node})["node"]["state"] == "ready", 10,
             what="the node ready again after its in-band clean")
    _, events = cp.post("/api/admin/events/list", {"limit": 500}, token=ADMIN)
    kinds = [e["type"] for e in events["events"] if e["data"].get("nodeId") == node]
    assert "node.cleaning" in kinds and "node.cleaned" in kinds, [(e.get("reservation_id"), e.get("reason"), e.get("status")) for e in agent.events("report ignored by the control plane")]
    # the next booking of the node starts only after the turnaround
    status, doc = cp.post("/api/compute/reservations/quote", {
        "poolId": "metal", "gpuModel": "H100_80GB", "gpuCount": 8, "durationHours": 1, "binding": "node",
        "access": {"sshKeys": [public.read_text().strip()]}})
    assert 200 == status, doc
    assert doc["quote"]["earliestStart"] >= released_at + TURNAROUND_MIN * 60_000 - 1000, doc["quote"]


def test_a_node_left_changed_goes_to_maintenance_and_takes_no_booking_until_cleared(metal, sshd_server, tmp_path):
    cp, agent = metal
    _, public = make_key(tmp_path / "tenant")
    keys = {"sshKeys": [public.read_text().strip()]}
    rid = cp.create(poolId="metal", gpuCount=8, binding="node", access=keys)["id"]
    cp.wait_state(rid, "active", timeout=5)
    node = node_of(cp, rid)
    topology = json.loads(agent.topology.read_text())
    topology["lostGpus"] = [3]  # the tenant left a GPU off the bus
    agent.topology.write_text(json.dumps(topology))
    cp.release(rid)
    got = wait_for(lambda: (n := admin(cp, "nodes/get", {"nodeId": node})["node"])["state"] == "maintenance" and n,
                   10, what="the node in maintenance")
    assert "CleaningFailed" in got["stateReason"] and "lostGpus" in got["stateReason"], got["stateReason"]
    later = cp.create(poolId="metal", gpuCount=8, binding="node", access=keys, durationHours=1)
    assert later["state"] == "pending" or all(p["nodeId"] != node for p in later.get("placements", [])), later
    admin(cp, "nodes/clear", {"nodeId": node, "reason": "GPU 3 reseated"})
    assert "ready" == admin(cp, "nodes/get", {"nodeId": node})["node"]["state"]


def test_with_the_agent_stopped_sshd_refuses_the_key_by_itself_once_the_window_is_over(metal, sshd_server, tmp_path):
    cp, agent = metal
    private, public = make_key(tmp_path / "tenant")
    end = (int(time.time()) + 6) * 1000  # expiry-time has whole seconds
    rid = cp.create(poolId="metal", gpuCount=8, binding="node", access={"sshKeys": [public.read_text().strip()]},
                    durationHours=None, end=end)["id"]
    cp.wait_state(rid, "active", timeout=5)
    assert 0 == login(sshd_server, private).returncode
    agent.stop()  # nobody will take the keys back: only their expiry-time ends the access
    time.sleep(max(0.0, end / 1000 - time.time()) + 1.5)
    refused = login(sshd_server, private)
    assert (255, True) == (refused.returncode, "Permission denied" in refused.stderr)
    assert f"berth:{rid}" in (sshd_server.keys_dir / sshd_server.user).read_text()  # still in the file
