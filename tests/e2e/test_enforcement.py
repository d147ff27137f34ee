"""The share is enforced through the agent on whatever layout this host has: cgroup2 controllers, or (on a hybrid
host like this one) cpu, cpuset and memory on their cgroup v1 hierarchies. A real control plane and agent, a
simulated host small enough that one GPU's share is half a CPU and 1 GiB: a busy loop is throttled to half the
wall time, a process that outgrows the memory is OOM-killed inside the reservation, and the agent reports it, so
the tenant sees the OOMKilled condition and an event."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import H100_TOKEN, REPO, SYSTEM_PYTHON, ControlPlane, pids_of
from tests.waiting import wait_for

pytestmark = pytest.mark.kernel

# 8 GPUs on 4 CPUs and 8 GiB, nothing reserved for the system: a GPU's share is 0.5 vcpu and 1 GiB.
SMALL = {"driver": {"version": "550.54.15", "cuda": 12040},
         "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "count": 8}],
         "host": {"cpus": 4, "numaNodes": 1, "memoryGiB": 8}}
FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600",
        "--reserve-vcpu", "0", "--reserve-memory-gib", "0"]
BUSY = ("import os, time\n"
        "t0, c0 = time.monotonic(), os.times()\n"
        "while time.monotonic() - t0 < 3: pass\n"
        "c1 = os.times()\n"
        "print((c1.user + c1.system - c0.user - c0.system) / (time.monotonic() - t0))\n")
GROW = ("chunks = []\n"
        "for _ in range(64): chunks.append(bytearray(64 << 20))  # 4 GiB, 64 MiB at a time\n"
        "print('survived')\n")


@pytest.fixture
def small(agents, workdir, bpf_works):
    cp = ControlPlane(workdir, grace_s=10.0).start()
    a = agents("small", cp.url, H100_TOKEN, extra=FAST, start=False)
    try:
        doc = json.loads(a.topology.read_text())
        a.topology.write_text(json.dumps({**SMALL, "hostname": doc["hostname"]}))
        a.start()
        a.wait_event("reconciled", timeout=20)
        yield cp, a
    finally:
        a.stop()  # before the control plane, so that no long poll holds its shutdown
        cp.stop()


def berth_exec(a, rid: str, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "berth", "exec", "--state-dir", str(a.state_dir), rid, "--", *command],
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def test_the_cpu_and_memory_share_hold_and_an_oom_kill_reaches_the_tenant(small):
    cp, a = small
    probe = (a.events("cgroup controllers") or a.events("cgroup controllers missing: shares asking for them are "
                                                       "reported as not enforced") or [None])[-1]
    rid = cp.create(gpuCount=1)["id"]
    res = cp.wait_state(rid, "active", timeout=5)
    assert (0.5, 1) == (res["resources"]["vcpu"], res["resources"]["memoryGiB"]), res["resources"]
    line = [e for e in a.events("bound") if e.get("reservation_id") == rid][-1]
    unenforced = " ".join(line.get("unenforced") or [])
    missing = [c for c in ("cpu", "memory") if f"{c} (" in unenforced]
    if missing:
        pytest.skip(f"this host does not give the agent {missing} ({unenforced}; {probe})")
    assert {"vcpu_milli": 500, "memory_bytes": 1 << 30} == {k: line["share"][k] for k in ("vcpu_milli",
                                                                                        "memory_bytes")}

    # half a CPU: a busy loop gets about half of the wall time
    out = berth_exec(a, rid, SYSTEM_PYTHON, "-c", BUSY)
    assert 0 == out.returncode, out.stderr
    share = float(out.stdout)
    assert 0.35 < share < 0.65, share

    # 1 GiB: a process that grows to 4 GiB is killed by the OOM killer inside the reservation, nothing else
    cgroup = a.root / f"rsv-{rid}"
    out = berth_exec(a, rid, SYSTEM_PYTHON, "-c", GROW)
    assert (-9, "") == (out.returncode, out.stdout), (out.returncode, out.stdout, out.stderr)
    assert cgroup.is_dir() and [] == pids_of(cgroup)
    oom = a.wait_event("workload OOM-killed", timeout=10)
    assert (rid, 1) == (oom["reservation_id"], oom["oom_kills"])

    def condition():
        got = {c["type"]: c for c in cp.get(rid).get("conditions", [])}
        return got.get("OOMKilled")

    cond = wait_for(condition, 10, interval=0.05, what="the OOMKilled condition on the reservation")
    assert ("True", "MemoryLimit") == (cond["status"], cond["reason"])
    assert re.search(r"the OOM killer ended 1 process\(es\) of this reservation", cond["message"])
    assert "1 GiB per node" in cond["message"] and "--memory-gib" in cond["message"]
    _, doc = cp.post("/api/compute/events/list", {"limit": 500})
    [event] = [e for e in doc["events"] if e["type"] == "reservation.oom-killed" and e["reservationId"] == rid]
    assert 1 == event["data"]["oomKills"]
    assert "active" == cp.get(rid)["state"]  # the reservation stays; only the process went

    # a second kill raises the count; the agent restarting does not count the first one again
    assert -9 == berth_exec(a, rid, SYSTEM_PYTHON, "-c", GROW).returncode
    wait_for(lambda: "ended 2 process(es)" in (condition() or {}).get("message", ""), 10, interval=0.05,
             what="the count of 2")
    a.stop()
    a.start()
    a.wait_event("reconciled", timeout=20)
    time.sleep(3)  # two OOM checks
    assert not a.events("workload OOM-killed", start=a.starts)
    _, doc = cp.post("/api/compute/events/list", {"limit": 500})
    assert 2 == len([e for e in doc["events"] if e["type"] == "reservation.oom-killed"])
