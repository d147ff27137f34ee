"""The node agent against the real control plane: two simulated 8-GPU hosts, each agent in its own network
namespace joined to the control plane's by a veth pair; tenants book, agents bind, `berth exec` runs work.

Real kernel throughout (cgroups below the test's own, eBPF device programs); on this hybrid host cpu, cpuset and
memory are enforced on their cgroup v1 hierarchies, and the tests check the kernel's files match the share in
every hierarchy (or, on a host without a controller, that the agent says so).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from cgroups import Subtree, bpf
from tests.agent.test_tenantroot import make_key
from tests.e2e.conftest import (H100_TOKEN, MIG_TOKEN, NODE_TOKEN, ControlPlane, alive, exec_open, pids_of,
                                spawn_in, wait_for)

pytestmark = pytest.mark.kernel


class Fleet:
    def __init__(self, cp: ControlPlane, a, b, lab) -> None:
        self.cp, self.a, self.b, self.lab = cp, a, b, lab


@pytest.fixture
def fleet(netlab, agents, workdir, bpf_works):
    """A control plane in its namespace (plus loopback for the tenant) and two agents: `a` on an H100 x 8
    host (pool h100), `b` on an A100 x 8 host with 7 MIG instances each (pool mig)."""
    netlab.add_agent("a")
    netlab.add_agent("b")
    sock = netlab.listen(netlab.cp_ns)
    port = sock.getsockname()[1]
    cp = ControlPlane(workdir, grace_s=2.0, sockets=[sock]).start()
    fast = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]
    started = []
    try:
        for role, token, kind in (("a", H100_TOKEN, "h100"), ("b", MIG_TOKEN, "mig")):
            ns, _, addr = netlab.links[role]
            started.append(agents(role, f"http://{addr}:{port}", token, kind, netns=netlab.ns_path(ns), extra=fast))
        for agent in started:
            agent.wait_event("reconciled", timeout=20)
        yield Fleet(cp, *started, netlab)
    finally:
        for agent in started:  # before the control plane, so that no long poll holds its shutdown
            agent.stop()
        cp.stop()


def minor_of(device: str) -> int:
    return int(device.removeprefix("/dev/nvidia"))


def test_a_hold_reservation_is_bound_enforced_usable_and_released(fleet, device_nodes):
    cp, a = fleet.cp, fleet.a
    rid = cp.create(gpuCount=1)["id"]
    # The control plane moves a reservation starting now to `binding` on its reconciler's next tick (up to 1 s);
    # from there the agent's part, watch -> cgroup -> report -> active, must take well under a second.
    res = cp.wait_state(rid, "active", timeout=2.5)
    _, doc = cp.post("/api/compute/events/list", {"limit": 500})
    at = {e["type"]: e["at"] for e in doc["events"] if e["reservationId"] == rid}
    assert at["reservation.active"] - at["reservation.binding"] < 1000, at
    [bound] = res["bound"]
    cgroup = Path(bound["cgroup"])
    assert cgroup == a.root / f"rsv-{rid}" and cgroup.is_dir()
    [gpu] = [d for d in bound["devices"] if d[len("/dev/nvidia"):].isdigit()]
    assert ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] == [d for d in bound["devices"] if d != gpu]

    # the share and device rules as recorded, and the kernel matching the record (one program, its tag)
    tree = Subtree(a.root, controllers=())
    found = tree.get(f"rsv-{rid}")
    rules = {str(r) for r in found.rules}
    mine = minor_of(gpu)
    assert f"c 195:{mine} rw" in rules and "c 195:255 rw" in rules
    assert not {f"c 195:{m} rw" for m in range(8) if m != mine} & rules
    assert [] == [d for d in tree.drift(f"rsv-{rid}") if d.what == "devices"]
    assert 1 == len(bpf.query_ids(cgroup))
    line = [e for e in a.events("bound") if e.get("reservation_id") == rid][-1]
    booked = res["resources"]
    unenforced = " ".join(line.get("unenforced") or [])
    notes = " ".join(line.get("notes") or [])
    # under --simulate a share larger than this machine is capped at what it really has, and the note says so
    real_cpus = re.search(r"capped at this host's (\d+) real CPUs", notes)
    real_mib = re.search(r"capped at this host's real (\d+) MiB", notes)
    caps = {"cpu": int(real_cpus[1]) if real_cpus else None, "memory": int(real_mib[1]) / 1024 if real_mib else None}
    for controller, value in (("cpu", booked["vcpu"]), ("memory", booked["memoryGiB"])):
        if f"{controller} (" in unenforced:
            assert found.share.vcpu_milli is None if controller == "cpu" else found.share.memory_bytes is None
        else:
            got = found.share.vcpu_milli / 1000 if controller == "cpu" else found.share.memory_bytes / 2**30
            assert got == pytest.approx(caps[controller] or value, rel=1e-3), (controller, got, value, notes)
    # and the kernel's files in every hierarchy (cgroup2 and, on a hybrid host, v1) match the record
    enforced = tuple(c for c in ("cpu", "memory") if f"{c} (" not in unenforced)
    assert [] == Subtree(a.root, controllers=enforced, anchor_pid=a.pid).drift(f"rsv-{rid}")

    # berth exec: its GPU's node opens (ENXIO: no driver, the filter let it through), another GPU's is denied
    other = (mine + 1) % 8
    opened = exec_open(a.state_dir, rid, [device_nodes / f"nvidia{mine}", device_nodes / f"nvidia{other}",
                                          Path("/dev/null")])
    assert {str(device_nodes / f"nvidia{mine}"): "ENXIO", str(device_nodes / f"nvidia{other}"): "EPERM",
            "/dev/null": "OK"} == opened

    worker = spawn_in(a.state_dir, rid, "sleep", "600")
    wait_for(lambda: worker.pid in pids_of(cgroup), 5, what="the worker in the reservation's cgroup")
    cp.release(rid)
    wait_for(lambda: not cgroup.exists(), 3, what="the cgroup removed after release")
    assert worker.wait(5) == -9  # killed with its cgroup
    assert "released" == cp.get(rid)["state"]
    wait_for(lambda: not cp.get(rid).get("bound"), 3, what="the unbound report to reach the control plane")


def test_kill9_and_restart_adopts_twenty_bindings_and_cleans_up_one_released_meanwhile(fleet):
    cp, b = fleet.cp, fleet.b
    rids = [cp.create(poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb", gpuCount=1)["id"] for _ in range(20)]
    for rid in rids:
        cp.wait_state(rid, "active", timeout=5)
    cgroups = {rid: b.root / f"rsv-{rid}" for rid in rids}
    workers = {rid: spawn_in(b.state_dir, rid, "sleep", "600") for rid in rids}
    for rid, w in workers.items():
        wait_for(lambda: w.pid in pids_of(cgroups[rid]), 10, what=f"worker of {rid}")
    before = {rid: (cg.stat().st_ino, tuple(bpf.query_ids(cg))) for rid, cg in cgroups.items()}
    # a MIG binding opens its instance's cap minors besides the GPU
    assert any(d.startswith("/dev/nvidia-caps/nvidia-cap") for d in cp.get(rids[0])["bound"][0]["devices"])

    b.kill9()
    gone = rids[0]
    cp.release(gone)
    b.start()
    b.wait_event("reconciled", timeout=20)
    wait_for(lambda: not cgroups[gone].exists(), 5, what="the released reservation's cgroup removed")
    assert workers[gone].wait(5) == -9
    for rid in rids[1:]:
        assert (cgroups[rid].stat().st_ino, tuple(bpf.query_ids(cgroups[rid]))) == before[rid], rid
        assert workers[rid].poll() is None and alive(workers[rid].pid), rid
        assert workers[rid].pid in pids_of(cgroups[rid])
    passes = b.events("reconciled", start=2)
    assert passes[0]["why"] == "start-up pass" and passes[0].get("keep") == 19 and passes[0].get("remove") == 1
    assert not [e for e in b.events("bound", start=2)], "nothing may be rebuilt after a restart"
    assert "released" == cp.get(gone)["state"]
    for rid in rids[1:]:
        assert "active" == cp.get(rid)["state"]
    for w in workers.values():
        if w.poll() is None:
            w.kill()
            w.wait(5)


def test_after_a_reboot_a_release_made_while_the_host_was_down_completes_and_the_rest_are_made_again(fleet):
    """A reboot kills every cgroup; the checkpoint of the old boot still lists them. The release made while the
    host was down used to run for ever (the agent forgot the binding, so it never reported it unbound); now the
    first pass reports it and makes the one still wanted again."""
    import msgspec

    from agent.checkpoint import Checkpoint, read_boot_id

    cp, b = fleet.cp, fleet.b
    kept, gone = [cp.create(poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb", gpuCount=1)["id"]
                  for _ in range(2)]
    for rid in (kept, gone):
        cp.wait_state(rid, "active", timeout=5)
    b.kill9()
    release_op = cp.release(gone)["operation"]["id"]
    # the reboot: every cgroup gone (in each hierarchy), and a checkpoint that names another boot
    path = b.state_dir / "checkpoint.json"
    old = Checkpoint.load(path, boot_id=read_boot_id(), cgroup_root=str(b.root))
    for entry in old.bindings.values():
        for part in [*entry.parts, entry.cgroup]:
            if Path(part).exists():
                Path(part).rmdir()
    old.data = msgspec.structs.replace(old.data, bootId="00000000-0000-4000-8000-000000000000")
    old.save()
    b.start()
    b.wait_event("reconciled", timeout=20)
    wait_for(lambda: cp.get(gone)["operation"]["status"] == "succeeded", 10, what="the release confirmed")
    assert release_op == cp.get(gone)["operation"]["id"] and not cp.get(gone).get("bound")
    wait_for(lambda: (b.root / f"rsv-{kept}").exists(), 10, what="the reservation still wanted made again")
    assert "active" == cp.get(kept)["state"] and not (b.root / f"rsv-{gone}").exists()


def test_a_stored_token_the_control_plane_refuses_is_replaced_once_and_the_node_stays_alive(fleet):
    """node.json with a token the control plane no longer knows (a restored database): the heartbeat and the
    watch are refused together. Both registered again, and the second, its own agent alive, was refused as a node
    another agent holds and retried until the node was lost; now the loop that comes second uses the new token."""
    import json

    cp, b = fleet.cp, fleet.b
    rid = cp.create(poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb", gpuCount=1)["id"]
    cp.wait_state(rid, "active", timeout=5)
    b.stop()
    lost = lambda: any(c["type"] == "NodeLost" and c["status"] == "True" for c in cp.get(rid).get("conditions", []))
    wait_for(lost, 10, what="the node lost (only then may a register take it again)")
    identity = b.state_dir / "node.json"
    doc = json.loads(identity.read_text())
    identity.write_text(json.dumps({**doc, "nodeToken": "nt_" + "x" * 43}))
    b.start()
    b.wait_event("registered", timeout=10)
    b.wait_event("reconciled", timeout=10)
    time.sleep(3)  # past the fleet's 2 s grace: a second register would still be retrying
    assert 1 == len(b.events("registered", b.starts)), b.tail()
    assert not b.events("register refused: the node is held by another agent; retrying", b.starts), b.tail()
    assert "active" == cp.get(rid)["state"] and not lost(), cp.get(rid)


def test_a_cut_link_loses_the_node_and_restoring_it_resumes_without_a_second_bind(fleet):
    cp, a, lab = fleet.cp, fleet.a, fleet.lab
    rid = cp.create(gpuCount=2)["id"]
    res = cp.wait_state(rid, "active", timeout=2)
    cgroup = Path(res["bound"][0]["cgroup"])
    inode, bound_at = cgroup.stat().st_ino, res["bound"][0]["at"]
    rv_before = a.events("reconciled")[-1]["resource_version"]

    lab.cut("a")
    wait_for(lambda: any(c["type"] == "NodeLost" for c in cp.get(rid)["conditions"]), 8,
             what="the NodeLost condition")
    a.wait_event("watch failed; reconnecting", timeout=10)  # the agent noticed: its calls time out
    assert cgroup.is_dir(), "a partition must not unbind anything"
    lab.restore("a")
    a.wait_event("watch resumed", timeout=10)
    wait_for(lambda: not any(c["type"] == "NodeLost" for c in cp.get(rid)["conditions"]), 10,
             what="NodeLost cleared once heartbeats come back")
    res = cp.get(rid)
    assert "active" == res["state"]
    assert [bound_at] == [b["at"] for b in res["bound"]], "bound once, not twice"
    assert inode == cgroup.stat().st_ino
    assert 1 == len([e for e in a.events("bound") if e.get("reservation_id") == rid])
    resumed = a.events("watch resumed")[-1]
    # from the version it held when the link broke, not from scratch (versions are digests of the set: unordered)
    held = a.events("watch failed; reconnecting")[0]["resource_version"]
    assert resumed["resource_version"] == held and held not in (0, None), (held, rv_before)


def test_a_node_binding_on_an_agent_without_ssh_keys_dir_is_refused_with_a_clear_failed_report(agents, workdir,
                                                                                                  bpf_works, tmp_path):
    cp = ControlPlane(workdir).start()
    try:
        metal = agents("metal", cp.url, NODE_TOKEN, "h100", extra=["--reconcile-seconds", "3600",
                                                                   "--watch-timeout-ms", "1500"])
        metal.wait_event("reconciled", timeout=20)
        _, public = make_key(tmp_path / "tenant")
        rid = cp.create(poolId="metal", gpuCount=8, binding="node",
                        access={"sshKeys": [public.read_text().strip()]})["id"]
        message = "node bindings are off on this agent: start it with --ssh-keys-dir"
        # the hand-over failed: the create's operation fails (the platform's doing) and nothing is left bound
        res = cp.wait_state(rid, "released", timeout=5)
        failure = res["operation"]["failure"]
        assert ("platform", True) == (failure["actor"], message in failure["message"]), failure
        assert not (metal.root / f"rsv-{rid}").exists()
        metal.stop()
    finally:
        cp.stop()