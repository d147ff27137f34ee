"""One real `berth agent` process on loopback: systemd's notify protocol, its lock, /metrics and /status, the
hugetlb share on the kernel, and an agent that cannot reach its control plane (it kills nothing, and resumes)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import H100_TOKEN, REPO, ControlPlane, alive, pids_of, spawn_in
from tests.waiting import wait_for

pytestmark = pytest.mark.kernel
FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]


@pytest.fixture
def cp(workdir):
    plane = ControlPlane(workdir, grace_s=30).start()
    try:
        yield plane
    finally:
        plane.stop()


def test_the_agent_says_ready_pings_the_watchdog_and_says_stopping(cp, agents, tmp_path, bpf_works):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(10)
    try:
        a = agents("n", cp.url, H100_TOKEN, extra=FAST, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "300000"})
        first = sock.recv(4096).decode()
        assert first.startswith("READY=1\nSTATUS=enforcing"), first
        pings = [sock.recv(4096) for _ in range(3)]
        assert [b"WATCHDOG=1"] * 3 == pings
        assert 0 == a.stop()
        rest = []
        while b"STOPPING=1" not in rest:
            rest.append(sock.recv(4096))
        assert a.events("agent stopped; workloads keep running")
    finally:
        sock.close()


def test_an_agent_in_a_delegated_cgroup_moves_itself_into_a_leaf(cp, agents, bpf_works):
    a = agents("leaf", cp.url, H100_TOKEN, extra=FAST, layout="delegated")
    moved = a.wait_event("agent moved into its leaf cgroup")
    assert [a.pid] == moved["pids"] and [a.pid] == pids_of(a.base / "agent")
    assert [] == pids_of(a.base), "the delegated cgroup holds no process: it may pass controllers down"
    a.wait_event("reconciled")
    rid = cp.create(gpuCount=1)["id"]
    assert a.root / f"rsv-{rid}" == Path(cp.wait_state(rid, "active", timeout=2)["bound"][0]["cgroup"])


def test_the_kernel_refuses_a_process_in_a_cgroup_that_passes_controllers_down(own_cgroup2, hugetlb_for_own_cgroup):
    """Why workloads live in a scope beside the agent's unit, not below it: systemd (before v254) starts a
    restarted service in its unit's top cgroup, and the kernel refuses that once the top passes a controller on."""
    top = own_cgroup2 / "unit"
    (top / "child").mkdir(parents=True)
    (own_cgroup2 / "cgroup.subtree_control").write_text("+hugetlb")
    (top / "cgroup.subtree_control").write_text("+hugetlb")
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(OSError) as err:
            (top / "cgroup.procs").write_text(str(proc.pid))
        assert 16 == err.value.errno  # EBUSY
    finally:
        proc.kill()
        proc.wait()


def test_a_second_agent_on_the_same_state_dir_exits_naming_the_first(cp, agents, bpf_works):
    a = agents("one", cp.url, H100_TOKEN, extra=FAST)
    a.wait_event("agent ready")
    out = subprocess.run([sys.executable, "-m", "berth", "agent", "--control-plane", cp.url,
                          "--bootstrap-token", H100_TOKEN, "--cgroup-root", str(a.root), "--state-dir",
                          str(a.state_dir)], capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert 1 == out.returncode
    assert f"is in use by another agent (pid {a.pid})" in out.stderr, out.stderr


def test_a_second_agent_on_the_same_cgroup_root_exits_naming_the_first_and_kills_nothing(cp, agents, bpf_works,
                                                                                          tmp_path):
    """With a state directory of its own, a second agent given the first's --cgroup-root took the first's
    reservation cgroups for leftovers and removed them: its workloads were killed, the control plane unaware."""
    a = agents("one", cp.url, H100_TOKEN, extra=FAST)
    a.wait_event("reconciled")
    rid = cp.create(gpuCount=1)["id"]
    cp.wait_state(rid, "active", timeout=5)
    cgroup = a.root / f"rsv-{rid}"
    out = subprocess.run([sys.executable, "-m", "berth", "agent", "--control-plane", cp.url,
                          "--bootstrap-token", H100_TOKEN, "--cgroup-root", str(a.root), "--state-dir",
                          str(tmp_path / "another-state"), *FAST], capture_output=True, text=True, timeout=30,
                         cwd=str(REPO))
    assert 1 == out.returncode
    assert f"--cgroup-root {a.root} is in use by another agent (pid {a.pid})" in out.stderr, out.stderr
    assert cgroup.is_dir() and alive(a.pid)


def test_the_operators_signal_to_reset_gpu_health_is_heard_and_stops_nothing(cp, agents, bpf_works):
    """SIGUSR1 is the operator's word on GPU health marks (its default action ends a process). A simulated host
    has no XID watcher, and says so; NVML's path is tests/agent/test_runtime_units.py's."""
    import os
    import signal
    a = agents("usr1", cp.url, H100_TOKEN, extra=FAST)
    a.wait_event("reconciled")
    os.kill(a.pid, signal.SIGUSR1)
    a.wait_event("health reset asked, but this agent watches no GPU health (a simulated host)")
    assert alive(a.pid)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_metrics_and_status_and_the_hugetlb_share_on_the_kernel(cp, agents, bpf_works, hugetlb_for_own_cgroup,
                                                              reserved_1g_hugepages):
    reserved_1g_hugepages(1)
    a = agents("m", cp.url, H100_TOKEN, extra=[*FAST, "--metrics-listen", "127.0.0.1:0"])
    address = a.wait_event("metrics listening")["address"]
    a.wait_event("reconciled")
    rid = cp.create(gpuCount=1, resources={"vcpu": 4, "memoryGiB": 16, "hugepages1Gi": 1})["id"]
    res = cp.wait_state(rid, "active", timeout=2)
    cgroup = Path(res["bound"][0]["cgroup"])
    assert str(1 << 30) == (cgroup / "hugetlb.1GB.max").read_text().strip()
    if (cgroup / "hugetlb.1GB.rsvd.max").exists():
        assert str(1 << 30) == (cgroup / "hugetlb.1GB.rsvd.max").read_text().strip()

    metrics = _get(f"http://{address}/metrics")
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert 1 == float(samples['berth_agent_bindings{state="bound"}'])
    assert 1 == float(samples['berth_agent_controller_enforced{controller="hugetlb"}'])
    assert float(samples["berth_agent_bind_latency_seconds_count"]) >= 1
    assert float(samples['berth_agent_binding_operation_seconds_count{operation="bind"}']) >= 1
    assert float(samples["berth_agent_heartbeat_age_seconds"]) < 10
    assert "berth_agent_watch_reconnects_total" in samples

    status = json.loads(_get(f"http://{address}/status"))
    assert status["nodeId"] and status["startupPassDone"] and "hugetlb" in status["controllers"]["enforced"]
    assert rid in status["bindings"] and "bound" == status["bindings"][rid]["state"]
    for c, hint in status["controllers"]["missing"].items():
        samples_key = f'berth_agent_controller_enforced{{controller="{c}"}}'
        assert 0 == float(samples[samples_key]) and hint, c
        assert f"{c} (" in " ".join(status["bindings"][rid]["unenforced"]) or c == "cpuset"
    cp.release(rid)
    wait_for(lambda: not cgroup.exists(), 3, what="the cgroup removed")


def test_an_agent_restarted_while_the_control_plane_is_down_kills_nothing_and_resumes(workdir, agents, bpf_works):
    plane = ControlPlane(workdir).start()
    try:
        a = agents("d", plane.url, H100_TOKEN, extra=FAST)
        a.wait_event("reconciled")
        rid = plane.create(gpuCount=1)["id"]
        plane.wait_state(rid, "active", timeout=2)
        cgroup = a.root / f"rsv-{rid}"
        worker = spawn_in(a.state_dir, rid, "sleep", "600")
        wait_for(lambda: worker.pid in pids_of(cgroup), 5, what="the worker in its cgroup")
        port = int(plane.url.rsplit(":", 1)[1])
        plane.stop()
        a.kill9()
        a.start()
        a.wait_event("agent ready", timeout=20)
        a.wait_event("watch failed; reconnecting", timeout=10)
        time.sleep(1.0)  # several retries with backoff
        assert cgroup.is_dir() and alive(worker.pid), "no control plane: nothing may be removed"
        assert not a.events("reconciled", start=2)
        plane = ControlPlane(workdir).start(port=port)  # the same database: the reservation is still wanted here
        first = a.wait_event("reconciled", timeout=15)
        assert ("start-up pass", 1) == (first["why"], first.get("keep"))
        assert a.events("watch resumed", start=2)
        assert alive(worker.pid) and worker.pid in pids_of(cgroup)
        assert "active" == plane.get(rid)["state"]
        worker.kill()
        worker.wait(5)
    finally:
        plane.stop()
