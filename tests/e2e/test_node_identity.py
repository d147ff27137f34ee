"""A node cannot be hijacked: two real agents in network namespaces, both holding the pool's bootstrap token and
claiming the same hostname. While the first is alive the second is refused (409 naming the node) and the first
keeps its token and its binding; once it is lost, only a host with its machine id may take the node over; an
operator's `berth admin nodes release-identity` lets another host register it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import H100_TOKEN, REPO, ControlPlane
from tests.waiting import wait_for

pytestmark = pytest.mark.kernel

HOST = "gpu-shared.test"
ADMIN = "admin-token-e2e-00000001"
FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]
REFUSED = "register refused: the node is held by another agent; retrying"


@pytest.fixture
def lab(netlab, agents, workdir, bpf_works):
    netlab.add_agent("a")
    netlab.add_agent("b")
    sock = netlab.listen(netlab.cp_ns)
    cp = ControlPlane(workdir, grace_s=2.0, sockets=[sock]).start()
    port = sock.getsockname()[1]

    def agent(name: str, role: str, machine_id: str):
        ns, _, addr = netlab.links[role]
        return agents(name, f"http://{addr}:{port}", H100_TOKEN, netns=netlab.ns_path(ns), extra=FAST,
                      hostname=HOST, machine_id=machine_id)

    try:
        yield cp, agent
    finally:
        cp.stop()


def node_live(cp: ControlPlane, node_id: str):
    from controlplane.api.app import CONTROL_PLANE

    return cp.app[CONTROL_PLANE].nodes.live[node_id]


def test_a_live_node_cannot_be_taken_and_a_lost_one_only_from_its_own_machine_or_after_a_release(lab):
    cp, agent = lab
    a = agent("a", "a", "a" * 32)
    registered = a.wait_event("registered", timeout=20)
    node_id = registered["node_id"]
    a.wait_event("reconciled")
    rid = cp.create(gpuCount=1)["id"]
    cp.wait_state(rid, "active", timeout=5)

    # b: the same pool's bootstrap token, the same hostname, another machine. Refused while a is alive.
    b = agent("b", "b", "b" * 32)
    refused = b.wait_event(REFUSED, timeout=20)
    assert "HTTP 409 CONFLICT" in refused["error"] and f"is node {node_id}, whose agent is alive" in refused["error"]
    assert f"berth admin nodes release-identity {node_id}" in refused["error"]
    wait_for(lambda: len(b.events(REFUSED)) >= 3, 10, what="b to keep trying")
    # a keeps its token and its binding; b was given nothing
    assert not a.events("node token refused; registering again") and not b.events("registered")
    assert not b.events("bound") and cp.get(rid)["state"] == "active"
    assert node_live(cp, node_id).last_seen is not None and not node_live(cp, node_id).lost

    # a dies; past the grace its node is lost, and b (another machine) is still refused
    a.kill9()
    wait_for(lambda: node_live(cp, node_id).lost, 10, what="the node to be lost")
    seen = len(b.events(REFUSED))
    wait_for(lambda: any("machineId" in e["error"] for e in b.events(REFUSED)[seen:]), 10,
             what="b refused for its machine id")
    assert not b.events("registered")

    # the same machine, reinstalled (a new state directory), takes its node back
    a2 = agent("a2", "a", "a" * 32)
    assert node_id == a2.wait_event("registered", timeout=20)["node_id"]
    wait_for(lambda: not node_live(cp, node_id).lost, 5, what="the node found again")
    a2.wait_event("bound", timeout=10)  # the reservation's binding, now on the new agent
    assert not b.events("registered")

    # the operator replaces the host: release the identity; b registers, and a2's token is refused from then on
    out = subprocess.run([sys.executable, "-m", "berth", "admin", "nodes", "release-identity", node_id, "--url",
                          cp.url, "--token", ADMIN, "--json"], capture_output=True, text=True, timeout=30,
                         cwd=str(REPO))
    assert 0 == out.returncode, out.stderr
    assert '"identityReleased": true' in out.stdout
    assert node_id == b.wait_event("registered", timeout=20)["node_id"]
    a2.wait_event("node token refused; registering again", timeout=20)
    refused = a2.wait_event(REFUSED, timeout=20)  # b is alive now
    assert "whose agent is alive" in refused["error"]

    # a tenant token cannot release a node
    status, doc = cp.post("/api/admin/nodes/release-identity", {"nodeId": node_id})
    assert (403, "ACCESS_DENIED") == (status, doc["error"]["code"])  # valid, but not the admin API's
