"""binding: node end to end, with every part real: a control plane, an agent (--simulate) and a real sshd in a
network namespace with the shipped drop-in. A tenant books a whole node with a fresh key, logs in over SSH and
starts a long-running process; at release the session is closed, a new login is refused, the process is gone,
the node is cleaned in band and ready again, and the next booking of it starts only after the turnaround. A
node left changed is not clean: it goes to maintenance and takes no booking until an operator clears it.

Over NVML (the agent on the stand-in libnvidia-ml.so.1 instead of --simulate): a MIG layout the tenant changed
(instances destroyed and made, MIG mode flipped) is put back by the clean, and the node is ready with the recreated
MIG devices' new UUIDs at the control plane; a GPU a process still holds is not reset, and the node goes to
maintenance naming it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from common.inventory import Inventory
from controlplane.api.app import CONTROL_PLANE
from tests.agent import fake_nvml
from tests.agent.conftest import standin_library  # noqa: F401 (fixture)
from tests.agent.test_tenantroot import keygen_fingerprint, login, make_key
from tests.e2e.conftest import NODE_TOKEN, REPO, ControlPlane, bootstrap_doc
from tests.waiting import wait_for
from tests.e2e.sshd import gone, read_line, sshd_server, starttime_of, tenant_user  # noqa: F401

pytestmark = pytest.mark.kernel
ADMIN = "admin-token-e2e-00000001"
FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]
TURNAROUND_MIN = 1


def admin(cp: ControlPlane, path: str, body: dict) -> dict:
    status, doc = cp.post(f"/api/admin/{path}", body, token=ADMIN)
    assert 200 == status, doc
    return doc


H100 = {"name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}
# GPU 6 is in MIG mode: GPU instances 1 (3g.40gb at slice 0), 2 (2g.20gb at 3), 3 and 4 (1g.10gb at 5 and 6).
MIG_HOST = {"driver": {"version": "550.54.15", "cuda": 12040}, "gpus": [
    dict(H100, count=6),
    dict(H100, mig=[{"profile": "3g.40gb"}, {"profile": "2g.20gb"}, {"profile": "1g.10gb", "count": 2}]),
    H100]}
WHOLE_GPUS = 7  # the metal pool books whole GPUs: GPU 6 (in MIG mode) is not among them


def _metal(workdir, agents, sshd_server, nvml=None):
    """The control plane with pool `metal` (tenant root as the sshd's throwaway user, cleaned in band) and an agent
    making node bindings into the sshd's keys directory (over --simulate, or the stand-in NVML)."""
    doc = bootstrap_doc()
    pool = next(p for p in doc["pools"] if p["id"] == "metal")
    pool["policy"] = {"tenantRoot": {"user": sshd_server.user, "cleaning": "inband",
                                     "turnaroundMinutes": TURNAROUND_MIN}}
    cp = ControlPlane(workdir, bootstrap=doc).start()
    try:
        a = agents("metal", cp.url, NODE_TOKEN, "h100", nvml=nvml, extra=[
            *FAST, "--ssh-keys-dir", str(sshd_server.keys_dir), "--ssh-host-keys", sshd_server.host_keys_glob,
            "--ssh-endpoint", f"{sshd_server.host}:{sshd_server.port}"])
        a.wait_event("reconciled", timeout=20)
        yield cp, a
        a.stop()
    finally:
        cp.stop()


@pytest.fixture
def metal(workdir, agents, sshd_server, bpf_works):
    yield from _metal(workdir, agents, sshd_server)


@pytest.fixture
def metal_nvml(workdir, agents, sshd_server, bpf_works, standin_library):  # noqa: F811
    yield from _metal(workdir, agents, sshd_server, nvml=(standin_library, MIG_HOST))


def tenant(agent, *action) -> str:
    """What the tenant does as root on the node: change the MIG layout through NVML (its own pynvml); its output."""
    env = {**os.environ, fake_nvml.TOPOLOGY_ENV: str(agent.topology)}
    env.pop(fake_nvml.CALLS_ENV, None)  # the calls file records the agent's calls only
    out = subprocess.run([sys.executable, "-m", "tests.agent.fake_nvml.tenant", str(agent.nvml_library),
                          *map(str, action)], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=30)
    assert 0 == out.returncode, out.stderr
    return out.stdout.strip()


def inventory_at(cp: ControlPlane, node: str) -> Inventory:
    """The node's inventory as the control plane holds it (what its units and later hand-overs go by)."""
    return cp.app[CONTROL_PLANE].catalog.current.nodes[node].inventory


def layout(inv: Inventory, gpu: int) -> dict[tuple, str]:
    """A GPU's MIG devices by position (placement start, profile, GPU and compute instance ids) -> UUID."""
    return {(m.placement.start if m.placement else None, m.profile, m.gpuInstanceId, m.computeInstanceId): m.uuid
            for m in inv.gpus[gpu].migDevices}


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
        # SIGKILLed by the same hand-back, which waits for it to end; the session's client can see its own
        # connection close before the kernel has run the killed process's exit
        wait_for(lambda: gone(shell, mark), 10, what="the tenant's process ended by the hand-back")
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


def test_a_mig_layout_the_tenant_changed_is_restored_and_the_node_is_ready_with_the_new_mig_uuids(metal_nvml,
                                                                                               tmp_path):
    cp, agent = metal_nvml
    _, public = make_key(tmp_path / "tenant")
    keys = {"sshKeys": [public.read_text().strip()]}
    rid = cp.create(poolId="metal", gpuCount=WHOLE_GPUS, binding="node", access=keys)["id"]
    cp.wait_state(rid, "active", timeout=10)
    node = node_of(cp, rid)
    handed = inventory_at(cp, node)
    assert [(0, "3g.40gb", 1, 0), (3, "2g.20gb", 2, 0), (5, "1g.10gb", 3, 0), (6, "1g.10gb", 4, 0)] == \
        sorted(layout(handed, 6))
    # the tenant repartitions GPU 6 (the two 1g.10gb instances become one 2g.20gb) and turns MIG on for GPU 7
    tenant(agent, "destroy-gi", 6, 3)
    tenant(agent, "destroy-gi", 6, 4)
    assert "3" == tenant(agent, "create-gi", 6, "2g.20gb", 5)  # the driver's lowest free GPU instance id
    tenant(agent, "mig-mode", 7, "on")
    cp.release(rid)

    def restored():
        n = admin(cp, "nodes/get", {"nodeId": node})["node"]
        inv = inventory_at(cp, node)
        # the agent's next heartbeat carries the inventory its clean discovered: the recreated devices' UUIDs
        return n["state"] == "ready" and set(layout(inv, 6)) == set(layout(handed, 6)) and \
            layout(inv, 6) != layout(handed, 6) and inv
    after = wait_for(restored, 15, what="the node ready with GPU 6's MIG layout put back and its new MIG UUIDs")
    old, new = layout(handed, 6), layout(after, 6)
    assert [old[p] == new[p] for p in sorted(old)] == [True, True, False, False]  # recreated: new UUIDs
    assert (False, False) == (after.gpus[7].migMode.current, after.gpus[7].migMode.pending)
    calls = agent.calls.read_text().splitlines()
    mig_calls = [c for c in calls if c.split()[0] in ("ci-destroy", "gi-destroy", "gi-create", "ci-create",
                                                      "mig-mode")]
    assert ["ci-destroy 6 3 0", "gi-destroy 6 3", "gi-create 6 3 0 5", "ci-create 6 3 0 5", "gi-create 6 4 0 6",
            "ci-create 6 4 0 6", "mig-mode 7 0"] == mig_calls, calls


def test_a_gpu_a_process_still_holds_is_not_reset_and_the_node_goes_to_maintenance(metal_nvml, tmp_path):
    cp, agent = metal_nvml
    _, public = make_key(tmp_path / "tenant")
    rid = cp.create(poolId="metal", gpuCount=WHOLE_GPUS, binding="node",
                    access={"sshKeys": [public.read_text().strip()]})["id"]
    cp.wait_state(rid, "active", timeout=10)
    node = node_of(cp, rid)
    fake_nvml.write(agent.topology, MIG_HOST, processes=[fake_nvml.Process(gpu=2, pid=4242)])  # left running
    cp.release(rid)
    got = wait_for(lambda: (n := admin(cp, "nodes/get", {"nodeId": node})["node"])["state"] == "maintenance" and n,
                   15, what="the node in maintenance")
    assert "CleaningFailed" in got["stateReason"] and "GPU 2: not reset: held by compute process(es) 4242" in \
        got["stateReason"], got["stateReason"]
    assert not [c for c in agent.calls.read_text().splitlines() if c.endswith(" 2") and c.startswith("reset-")]
