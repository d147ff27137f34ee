"""Unit tests of the agent runtime's pieces: binder decisions, share translation and device rules per binding,
sd_notify over a real datagram socket, the exec policy, the controller probe, the cgroup layout, metrics text."""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from agent import controllers, delegation
from agent.binder import Action, Have, Refused, plan
from agent.bindspec import BindError, HostView, refusal, simulated_devices_proc, want_of
from agent.discovery import Discovery
from agent.execgate import ExecPolicy, NoWorkloadUser
from agent.metrics import AgentMetrics
from common.nodewire import Binding, BindingShare, BindingUnit, WatchAnswer
from agent.link import Backoff, heartbeat_interval
from agent.sdnotify import Notifier
from agent.simulate import SimulatedGpus, SimulatedHost
from cgroups import CgroupShare
from tests.cgroups.conftest import FakeCgroupfs

TOPOLOGY = {"hostname": "unit", "gpus": [
    {"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "count": 2, "numaNodes": [0, 0],
     "mig": {"profile": "1g.10gb", "count": 2}},
    {"name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "count": 2, "numaNodes": [0, 0]}]}
ALL = frozenset({"cpu", "cpuset", "memory", "hugetlb"})


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    path = tmp_path_factory.mktemp("top") / "t.json"
    path.write_text(json.dumps(TOPOLOGY))
    gpus = SimulatedGpus(path)
    return Discovery(gpus=gpus, host=SimulatedHost(gpus)).discover()


@pytest.fixture(scope="module")
def devices_proc(tmp_path_factory):
    """A /proc/devices with the nvidia-uvm and nvidia-caps majors, as a host with the driver has them."""
    d = tmp_path_factory.mktemp("proc")
    (d / "devices").write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-uvm\n"
                               "237 nvidia-caps\n\nBlock devices:\n  7 loop\n")
    return d


def view(inventory, devices_proc, enforced=ALL, **kw) -> HostView:
    return HostView(inventory=inventory, enforced=frozenset(enforced), devices_proc=devices_proc, **kw)


def hold(rid="r1", units=(), vcpu=8000, memory=65536, huge=0, numa=(), kind="hold") -> Binding:
    return Binding(reservationId=rid, kind=kind, tenantId="acme", principalId="alice", start=0, end=1, units=tuple(units),
                   share=BindingShare(vcpuMilli=vcpu, memoryMiB=memory, hugepages1Gi=huge), numaNodes=tuple(numa))


def gpu_unit(inv, index):
    g = inv.gpus[index]
    return BindingUnit(unit=f"gpu{index}", gpuIndex=index, uuid=g.uuid)


# -- share translation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enforced, expect_share, expect_unenforced", [
    (ALL, CgroupShare(vcpu_milli=8000, memory_bytes=64 << 30, hugepages_1g=2), []),  # node 0's 2 CPUs < 8 vcpu
    ({"hugetlb"}, CgroupShare(hugepages_1g=2),
     ["cpu (vcpuMilli 8000)", "memory (memoryMiB 65536)", "cpuset (numaNodes [0])"]),
    ((), CgroupShare(), ["cpu (vcpuMilli 8000)", "memory (memoryMiB 65536)", "hugetlb (hugepages1Gi 2)",
                         "cpuset (numaNodes [0])"]),
])
def test_the_share_becomes_what_the_host_enforces_and_the_rest_is_named(inventory, devices_proc, enforced,
                                                                         expect_share, expect_unenforced):
    want = want_of(hold(units=[gpu_unit(inventory, 2)], huge=2, numa=[0]), view(inventory, devices_proc, enforced))
    assert (expect_share, expect_unenforced) == (want.share, list(want.unenforced))


def test_the_share_is_pinned_to_its_gpus_numa_nodes_where_their_cpus_hold_it_and_else_not_pinned(inventory,
                                                                                                  devices_proc):
    """A whole-GPU booking is sized from the whole host (the per-GPU share), and GPUs may sit on a node with fewer
    CPUs: pinned there, it could never bind (ShareTooLarge at every pass, for its whole window)."""
    from common.hostfacts import parse_cpulist

    near = inventory.cpus.numaNodes[0].cpus  # this host's, as --simulate keeps the real CPUs
    n = len(parse_cpulist(near))
    fits = want_of(hold(units=[gpu_unit(inventory, 2)], vcpu=n * 1000, numa=[0]), view(inventory, devices_proc))
    assert (near, "0", ()) == (fits.share.cpus, fits.share.mems, fits.notes)
    more = want_of(hold(units=[gpu_unit(inventory, 2)], vcpu=n * 1000 + 500, numa=[0]), view(inventory, devices_proc))
    assert (None, None, n * 1000 + 500) == (more.share.cpus, more.share.mems, more.share.vcpu_milli)
    assert [f"cpuset not pinned to numaNodes [0]: their {n} CPUs are fewer than the share's {n + 0.5:g} vcpu, so the "
            "workload may run on any CPU of the host"] == list(more.notes)


def test_under_simulate_cpus_and_memory_are_capped_at_the_real_host_and_cpuset_is_not_pinned(inventory,
                                                                                              devices_proc):
    v = view(inventory, devices_proc, simulated_cpus=True, simulated_memory=True, real_cpus=2,
             real_memory_bytes=8 << 30)
    want = want_of(hold(units=[gpu_unit(inventory, 2)], vcpu=16000, memory=131072, numa=[0]), v)
    assert CgroupShare(vcpu_milli=2000, memory_bytes=8 << 30) == want.share
    assert 3 == len(want.notes) and not want.unenforced


def test_under_simulate_hugepages_are_capped_at_the_real_pool_and_a_real_hosts_are_not(inventory, devices_proc):
    """A topology's simulated 1 GiB pages were booked and then never bound (the kernel's pool, empty, refused
    them: BindFailed for the reservation's whole window)."""
    binding = hold(units=[gpu_unit(inventory, 2)], huge=2)
    simulated = want_of(binding, view(inventory, devices_proc, simulated_hugepages=True, real_hugepages_1g=0))
    assert 0 == simulated.share.hugepages_1g
    assert ["hugepages1Gi 2 capped at this host's real 0 (--simulate)"] == [n for n in simulated.notes if "huge" in n]
    real = want_of(binding, view(inventory, devices_proc, real_hugepages_1g=0))
    assert 2 == real.share.hugepages_1g  # a real host's pool is the kernel's to refuse, and the binding says so


# -- device rules ------------------------------------------------------------------------------------------------


def test_a_whole_gpu_gets_its_node_nvidiactl_and_uvm_and_the_harmless_nodes(inventory, devices_proc):
    want = want_of(hold(units=[gpu_unit(inventory, 2), gpu_unit(inventory, 3)]), view(inventory, devices_proc))
    rules = {str(r) for r in want.rules}
    assert {"c 195:2 rw", "c 195:3 rw", "c 195:255 rw", "c 236:0 rw", "c 236:1 rw", "c 1:3 rw", "c 136:* rw"} <= rules
    assert not {"c 195:0 rw", "c 195:1 rw"} & rules
    assert ("/dev/nvidia2", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools") == \
        want.devices


def test_a_mig_unit_gets_its_parent_gpu_and_its_gi_and_ci_cap_minors(inventory, devices_proc):
    gpu = inventory.gpus[1]
    mig = gpu.migDevices[0]
    unit = BindingUnit(unit="gpu1/mig0", gpuIndex=1, uuid=mig.uuid, migProfile="1g.10gb")
    want = want_of(hold(units=[unit]), view(inventory, devices_proc))
    rules = {str(r) for r in want.rules}
    assert {f"c 195:{gpu.minor} rw", f"c 237:{mig.capMinors.gi} r", f"c 237:{mig.capMinors.ci} r"} <= rules
    assert f"/dev/nvidia-caps/nvidia-cap{mig.capMinors.ci}" in want.devices
    assert not [r for r in rules if r.startswith("c 237:") and r not in
                {f"c 237:{mig.capMinors.gi} r", f"c 237:{mig.capMinors.ci} r"}]


@pytest.mark.parametrize("units, message", [
    ([BindingUnit(unit="gpu9", gpuIndex=9, uuid="GPU-gone")], "GPU GPU-gone is not in this host's inventory"),
    ([BindingUnit(unit="gpu0/mig0", gpuIndex=0, uuid=None, migProfile="1g.10gb")], "must name its MIG device"),
    ([], "names no units"),
])
def test_a_binding_that_cannot_be_made_here_says_why(inventory, devices_proc, units, message):
    with pytest.raises(BindError, match=message):
        want_of(hold(units=units), view(inventory, devices_proc))


def test_without_the_driver_the_uvm_major_is_missing_and_the_binding_fails_with_the_fix(inventory, tmp_path):
    (tmp_path / "devices").write_text("Character devices:\n  1 mem\n\nBlock devices:\n")
    with pytest.raises(BindError, match="nvidia-uvm is not in"):
        want_of(hold(units=[gpu_unit(inventory, 2)]), view(inventory, tmp_path))


def test_simulate_adds_the_driver_majors_without_clashing_with_the_hosts(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "devices").write_text("Character devices:\n  1 mem\n511 taken\n\nBlock devices:\n  7 loop\n")
    from cgroups import read_proc_devices

    majors = read_proc_devices(simulated_devices_proc(real, tmp_path / "sim"))
    assert (1, 511, 510, 509) == (majors["mem"], majors["taken"], majors["nvidia-uvm"], majors["nvidia-caps"])


@pytest.mark.parametrize("kind, message", [
    ("node", "node bindings are off on this agent: start it with --ssh-keys-dir"),
    ("kubernetes", "kubernetes bindings are off on this agent"),
    ("teleport", "unknown to this agent"),
    ("hold", None),
])
def test_binding_kinds_other_than_hold_are_refused_clearly(kind, message):
    why = refusal(hold(kind=kind))
    assert (why is None) if message is None else (message in why)


def test_the_fingerprint_follows_share_and_rules(inventory, devices_proc):
    v = view(inventory, devices_proc)
    a = want_of(hold(units=[gpu_unit(inventory, 2)]), v)
    assert a.fingerprint == want_of(hold(units=[gpu_unit(inventory, 2)]), v).fingerprint
    assert a.fingerprint != want_of(hold(units=[gpu_unit(inventory, 3)]), v).fingerprint
    assert a.fingerprint != want_of(hold(units=[gpu_unit(inventory, 2)], vcpu=4000), v).fingerprint


# -- binder decisions --------------------------------------------------------------------------------------------


def _want(inventory, devices_proc, rid, index=2, vcpu=8000):
    return want_of(hold(rid, units=[gpu_unit(inventory, index)], vcpu=vcpu), view(inventory, devices_proc))


def test_plan_creates_keeps_updates_removes_fails_and_refuses(inventory, devices_proc):
    w = {rid: _want(inventory, devices_proc, rid) for rid in ("new", "same", "changed", "norecord")}
    same, changed = w["same"], _want(inventory, devices_proc, "changed", vcpu=4000)
    actual = {
        "same": Have("same", Path("/x/rsv-same"), same.share, same.rules),
        "changed": Have("changed", Path("/x/rsv-changed"), changed.share, changed.rules),
        "norecord": Have("norecord", Path("/x/rsv-norecord"), None, None, problem="no record"),
        "gone": Have("gone", Path("/x/rsv-gone"), same.share, same.rules),
        "broken": Have("broken", Path("/x/rsv-broken"), same.share, same.rules),
    }
    desired = {**w, "broken": BindError("GPU lost"), "metal": Refused("binding kind node is not supported")}
    got = {(a.kind, a.reservation_id) for a in plan(desired, actual)}
    assert {("create", "new"), ("keep", "same"), ("update", "changed"), ("update", "norecord"),
            ("remove", "gone"), ("fail", "broken"), ("refuse", "metal")} == got


def test_plan_removes_first_and_is_stable(inventory, devices_proc):
    w = _want(inventory, devices_proc, "b")
    actions = plan({"b": w, "a": w}, {"z": Have("z", Path("/x/rsv-z"))})
    assert ["remove:z", "create:a", "create:b"] == [f"{a.kind}:{a.reservation_id}" for a in actions]


def test_plan_with_nothing_wanted_removes_everything_and_with_nothing_found_creates_everything(inventory,
                                                                                               devices_proc):
    w = _want(inventory, devices_proc, "r")
    assert [Action("remove", "r", have=Have("r", Path("/x")), reason="not wanted by the control plane")] == \
        plan({}, {"r": Have("r", Path("/x"))})
    assert ["create"] == [a.kind for a in plan({"r": w}, {})]


# -- sd_notify -----------------------------------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    yield path, s
    s.close()


def test_sd_notify_sends_ready_status_and_watchdog_datagrams(notify_socket):
    path, sock = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())})
    assert 1.5 == n.watchdog_interval_s
    assert n.ready(status="enforcing hugetlb")
    assert b"READY=1\nSTATUS=enforcing hugetlb" == sock.recv(4096)
    assert n.watchdog()
    assert b"WATCHDOG=1" == sock.recv(4096)
    assert n.stopping()
    assert b"STOPPING=1" == sock.recv(4096)


def test_sd_notify_reaches_an_abstract_socket():
    name = f"berth-test-notify-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(2)
    try:
        assert Notifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert b"READY=1" == s.recv(4096)
    finally:
        s.close()


def test_sd_notify_is_a_no_op_outside_systemd_and_ignores_another_processs_watchdog(tmp_path):
    assert not Notifier.from_env({}).ready()
    assert None is Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}) \
        .watchdog_interval_s
    gone = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert not gone.ready() and "nobody-listens" in gone.last_error


# -- the exec policy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("uid, gids, tenant, allowed", [
    (0, set(), "acme", True),
    (1000, set(), "acme", True),  # --exec-allow-uid 1000
    (1001, {50, 2000}, "globex", True),  # member of group 2000
    (1002, set(), "acme", True),  # --exec-tenant-uid acme=1002
    (1002, set(), "globex", False),
    (1003, {50}, "acme", False),
    (64123, set(), "acme", True),  # acme's workload user
    (64123, set(), "globex", False),
])
def test_who_may_exec(uid, gids, tenant, allowed):
    policy = ExecPolicy.from_options(["1000"], ["2000"], ["acme=1002"], ["acme=64123"])
    why = policy.refusal(uid, gids, tenant)
    assert allowed == (why is None), why
    if not allowed:
        assert f"uid {uid} may not run work in reservations of tenant '{tenant}'" in why


@pytest.mark.parametrize("args, message", [
    ((["x-no-such-user-x"], [], []), "no such user"),
    (([], ["x-no-such-group-x"], []), "no such group"),
    (([], [], ["acme"]), "expected TENANT=UID"),
])
def test_a_bad_exec_option_names_itself(args, message):
    with pytest.raises(ValueError, match=message):
        ExecPolicy.from_options(*args)


def test_the_exec_policy_file_round_trips_and_a_tenant_without_a_user_is_told_how(tmp_path):
    policy = ExecPolicy.from_options(["1000"], [], ["acme=1002"], ["acme=64123:64200"], allow_root=True)
    policy.write(tmp_path)
    assert policy == ExecPolicy.read(tmp_path)
    assert (64123, 64200, (64200,)) == (policy.workload_user("acme").uid, policy.workload_user("acme").gid,
                                        policy.workload_user("acme").groups)
    assert 0o644 == (tmp_path / "exec-policy.json").stat().st_mode & 0o777
    assert ExecPolicy.read(tmp_path / "none") is None
    with pytest.raises(NoWorkloadUser, match="--exec-tenant-user globex=USER"):
        policy.workload_user("globex")


# -- controllers and layout -------------------------------------------------------------------------------------


def test_the_probe_enforces_what_is_offered_and_names_the_rest(tmp_path):
    fs = FakeCgroupfs(tmp_path, controllers=("cpu", "hugetlb", "pids"))
    found = controllers.probe(fs.mount, fake=True)
    assert ("cpu", "hugetlb") == found.enforced
    assert {"cpuset", "memory"} == set(found.missing)
    assert "missing cpuset, memory" in found.summary()


def test_the_probe_of_a_root_not_made_yet_reads_what_its_parent_passes_down(tmp_path):
    fs = FakeCgroupfs(tmp_path, controllers=("cpu", "memory", "hugetlb"))
    (fs.mount / "cgroup.subtree_control").write_text("memory\n")
    assert ("memory",) == controllers.probe(fs.mount / "later" / "workloads", fake=True).enforced


def test_the_hint_for_hugetlb_says_systemd_does_not_delegate_it_and_what_to_write(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    mount = tmp_path / "cg"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpu memory hugetlb\n")
    (proc / "self/mountinfo").write_text(f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    hint = controllers.hint("hugetlb", mount / "berth.slice" / "scope", proc=proc)
    assert "systemd does not delegate hugetlb" in hint
    assert f"{mount}/cgroup.subtree_control and {mount}/berth.slice/cgroup.subtree_control" in hint
    assert f"--cgroup-enable-from {mount}" in hint
    (proc / "self/mountinfo").write_text(f"41 31 0:38 / {mount} rw - cgroup2 cgroup2 rw\n"
                                         "42 31 0:39 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert "systemd.unified_cgroup_hierarchy=1" in controllers.hint("cpu", mount / "x", proc=proc)


def fake_proc(tmp_path: Path, own: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self/mountinfo").write_text("41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n")
    (proc / "self/cgroup").write_text(f"0::{own}\n")
    return proc


@pytest.mark.parametrize("own, root, systemd, expect", [
    ("/berth.slice/berth-agent.service", "/sys/fs/cgroup/berth.slice/berth-agent.service/workloads", False,
     ("/sys/fs/cgroup/berth.slice/berth-agent.service/workloads", "/sys/fs/cgroup/berth.slice/berth-agent.service",
      "/sys/fs/cgroup/berth.slice/berth-agent.service/agent", None)),
    ("/berth.slice/berth-agent.service", None, True,
     ("/sys/fs/cgroup/berth.slice/berth-workloads.scope/workloads", "/sys/fs/cgroup/berth.slice/berth-workloads.scope",
      "/sys/fs/cgroup/berth.slice/berth-agent.service/agent", "/sys/fs/cgroup/berth.slice/berth-workloads.scope")),
    ("/user.slice/session-1.scope", None, False,
     ("/sys/fs/cgroup/user.slice/session-1.scope/workloads", "/sys/fs/cgroup/user.slice/session-1.scope",
      "/sys/fs/cgroup/user.slice/session-1.scope/agent", None)),
    ("/", "/sys/fs/cgroup/berth", False, ("/sys/fs/cgroup/berth", None, None, None)),
])
def test_the_layout_keeps_workloads_where_restarting_the_agent_cannot_reach_them(tmp_path, own, root, systemd,
                                                                                 expect):
    lay = delegation.resolve(root, proc=fake_proc(tmp_path, own), systemd=systemd)
    got = tuple(None if p is None else str(p) for p in (lay.root, lay.enable_from, lay.leaf, lay.scope))
    assert expect == got


@pytest.mark.parametrize("own, root, enable_from, message", [
    ("/", None, None, "give --cgroup-root"),
    ("/x", "/tmp/elsewhere", None, "is not below the cgroup2 mount"),
    ("/x", "/sys/fs/cgroup/a/w", "/sys/fs/cgroup/b", "is not an ancestor"),
])
def test_a_layout_that_cannot_work_says_which_option_to_change(tmp_path, own, root, enable_from, message):
    with pytest.raises(delegation.LayoutError, match=message):
        delegation.resolve(root, enable_from, proc=fake_proc(tmp_path, own), systemd=False)


def test_on_a_hybrid_host_enabling_from_the_v1_tmpfs_is_refused_naming_the_cgroup2_mount(tmp_path):
    """docs/operations.md gave every host --cgroup-enable-from /sys/fs/cgroup, the v1 hierarchies' tmpfs on a
    hybrid host: the agent exited reading its cgroup.controllers (no such file), restarted by its unit for ever."""
    proc = fake_proc(tmp_path, "/x")
    (proc / "self/mountinfo").write_text("41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    with pytest.raises(delegation.LayoutError, match="not on the cgroup2 hierarchy.*/sys/fs/cgroup/unified"):
        delegation.resolve("/sys/fs/cgroup/unified/x/w", "/sys/fs/cgroup", proc=proc, systemd=False)
    lay = delegation.resolve("/sys/fs/cgroup/unified/x/w", "/sys/fs/cgroup/unified", proc=proc, systemd=False)
    assert str(lay.enable_from) == "/sys/fs/cgroup/unified"


def test_the_workloads_scope_is_a_delegated_scope_around_a_keeper_in_a_leaf():
    cmd = delegation.scope_command(Path("/sys/fs/cgroup"))
    assert cmd[:2] == ["systemd-run", "--scope"]
    assert {"--unit=berth-workloads.scope", "--slice=berth.slice", "--property=Delegate=yes"} <= set(cmd)
    assert "keeper" in cmd[cmd.index("-c") + 1] and cmd[-1] == "/sys/fs/cgroup"


# -- timing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hb, grace, expect", [(5, 30, 5), (5, 3, 1.0), (None, None, 5), (5, 0.03, 0.05)])
def test_at_least_three_heartbeats_fit_in_the_grace(hb, grace, expect):
    assert expect == pytest.approx(heartbeat_interval(hb, grace))


def test_backoff_grows_to_its_bound_with_jitter_and_resets():
    b = Backoff(0.2, 2.0)
    delays = [b.next() for _ in range(8)]
    assert 0.1 <= delays[0] < 0.2 and all(1.0 <= d < 2.0 for d in delays[4:])
    b.reset()
    assert b.next() < 0.2


# -- wire and metrics ------------------------------------------------------------------------------------------------


def test_watch_answers_are_read_leniently_about_new_fields_and_strictly_about_types():
    import msgspec

    raw = {"resourceVersion": 7, "changed": True, "future": 1, "bindings": [
        {"reservationId": "r", "kind": "hold", "tenantId": "acme", "principalId": "alice", "start": 0, "end": 1,
         "units": [{"unit": "gpu0", "gpuIndex": 0, "minor": 0}],
         "share": {"vcpuMilli": 1000, "memoryMiB": 1, "hugepages1Gi": 0}, "numaNodes": [0]}]}
    ans = msgspec.convert(raw, WatchAnswer)
    assert (7, "gpu0") == (ans.resourceVersion, ans.bindings[0].units[0].unit)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**raw, "resourceVersion": "7"}, WatchAnswer)
    # An answer without its bindings (a proxy's or a broken replica's 200) is no answer: read as "nothing is
    # wanted", it unbound every reservation on the node and killed their workloads.
    for missing in ({"resourceVersion": 12345}, {"resourceVersion": 12345, "changed": True}):
        with pytest.raises(msgspec.ValidationError, match="bindings"):
            msgspec.convert(missing, WatchAnswer)


async def test_a_watch_answer_without_bindings_is_a_failed_watch_not_an_empty_set(aiohttp_server):
    from aiohttp import web

    from agent.nodeclient import NodeApiError, NodeClient

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"resourceVersion": 12345})

    app = web.Application()
    app.router.add_post("/api/nodes/watch", answer)
    server = await aiohttp_server(app)
    client = NodeClient(str(server.make_url("/")), token="nt_x")
    try:
        with pytest.raises(NodeApiError) as failed:
            await client.watch(7, 1000)
    finally:
        await client.close()
    assert "BAD_ANSWER" == failed.value.code and "bindings" in str(failed.value), failed.value


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_render_in_the_prometheus_text_format():
    now = [100.0]
    m = AgentMetrics(clock=lambda: now[0])
    m.bindings = {"bound": 3, "failed": 1}
    for v in (0.002, 0.004, 0.3):
        m.bind_latency.observe(v)
    m.watch_reconnects = 2
    m.controllers_enforced, m.controllers_missing = ("hugetlb",), ("cpu", "memory")
    text = m.render()
    s = _samples(text)
    assert math.isnan(s["berth_agent_heartbeat_age_seconds"])
    m.last_heartbeat = 98.5
    s = _samples(m.render())
    assert 1.5 == s["berth_agent_heartbeat_age_seconds"]
    assert (3, 1, 0) == (s['berth_agent_bindings{state="bound"}'], s['berth_agent_bindings{state="failed"}'],
                         s['berth_agent_bindings{state="removing"}'])
    assert (0, 1, 2, 3, 3) == tuple(s[f'berth_agent_bind_latency_seconds_bucket{{le="{b}"}}']
                                    for b in ("0.001", "0.0025", "0.005", "0.5", "+Inf"))
    assert 3 == s["berth_agent_bind_latency_seconds_count"]
    assert 2 == s["berth_agent_watch_reconnects_total"]
    assert (1, 0) == (s['berth_agent_controller_enforced{controller="hugetlb"}'],
                      s['berth_agent_controller_enforced{controller="cpu"}'])
    assert "# TYPE berth_agent_bind_latency_seconds histogram" in text
    for kind, seconds in (("create", 0.003), ("remove", 0.02), ("remove", 0.04), ("keep", 5.0), ("refuse", 5.0)):
        m.binder_took(kind, seconds)
    s = _samples(m.render())
    ops = {k: v for k, v in s.items() if k.startswith("berth_agent_binding_operation_seconds_count")}
    assert {'berth_agent_binding_operation_seconds_count{operation="bind"}': 1,
            'berth_agent_binding_operation_seconds_count{operation="unbind"}': 2} == ops
    assert 0.06 == pytest.approx(s['berth_agent_binding_operation_seconds_sum{operation="unbind"}'])
    assert not any(k.endswith("_created") for k in s)


def test_waiting_reports_go_in_calls_of_their_own_after_the_others():
    """A replica of an earlier release refuses a whole report call for a status it does not know (and a refused
    call is dropped): `waiting` never rides with a bound, unbound or held report, and waits for them to go first."""
    from agent.link import REPORT_BATCH, next_batch
    from common.nodewire import Report

    queue = [Report("r1", "waiting", holders=("ns/p",)), Report("r2", "bound"), Report("r3", "waiting"),
             Report("r4", "unbound")]
    assert ["r2", "r4"] == [r.reservationId for r in next_batch(queue)]
    assert ["r1", "r3"] == [r.reservationId for r in next_batch([queue[0], queue[2]])]
    assert REPORT_BATCH == len(next_batch([Report(f"r{i}", "bound") for i in range(REPORT_BATCH + 5)]))


async def test_an_agent_sends_its_version_only_to_a_control_plane_that_names_one_and_never_loses_a_heartbeat(
        aiohttp_server):
    """A control plane of an earlier release answers heartbeats without a version and refuses the field (its
    requests are strict): the agent never sends it there. One that names versions gets it with every heartbeat.
    Behind one balancer in a rolling upgrade a newer replica may answer and an older one get the next heartbeat:
    refused with it, it goes again without."""
    from aiohttp import web

    from agent.link import ControlPlaneLink

    seen: list[dict] = []
    names = {"version": None}  # what the answers say; None: an earlier release's, which says nothing of it

    async def heartbeat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if "agentVersion" in body and names["version"] is None:
            return web.json_response({"error": {"code": "INVALID_INPUT", "message": "unknown field",
                                                "details": {"field": "agentVersion"}}}, status=400)
        answer = {"resourceVersion": 1, "graceSeconds": 30, "reportStatuses": ["bound"]}
        return web.json_response(answer if names["version"] is None else {**answer, "agentVersion": names["version"]})

    app = web.Application()
    app.router.add_post("/api/nodes/heartbeat", heartbeat)
    server = await aiohttp_server(app)
    link = ControlPlaneLink(str(server.make_url("/")), "", None, None, None, AgentMetrics(), inventory=lambda: None,
                            agent_version="0.2.0", wall_ms=lambda: 0, on_node=print)
    link.client.token = "nt_x"
    try:
        for _ in range(3):
            assert (await link._heartbeat(None)).agentVersion is None
        assert all("agentVersion" not in body for body in seen)
        names["version"] = "0.1.0"  # a newer replica answers
        await link._heartbeat(None)
        seen.clear()
        for _ in range(2):  # from then on every heartbeat carries it: behind a balancer each replica learns it
            await link._heartbeat(None)
        assert ["0.2.0", "0.2.0"] == [body.get("agentVersion") for body in seen]
        names["version"] = None  # and an older one takes the next heartbeat, which carries the version
        seen.clear()
        assert (await link._heartbeat(None)).agentVersion is None
        assert ["0.2.0", None] == [body.get("agentVersion") for body in seen]  # refused, then sent without
    finally:
        await link.client.close()


async def _fake_control_plane(aiohttp_server, routes: dict):
    from aiohttp import web
    app = web.Application()
    for method, handler in routes.items():
        app.router.add_post(f"/api/nodes/{method}", handler)
    return await aiohttp_server(app)


def _link(server, **kw):
    from types import SimpleNamespace

    from agent.link import ControlPlaneLink
    import msgspec
    from common.inventory import Inventory
    from tests.controlplane.test_nodes import inventory
    inv = msgspec.convert(inventory("h1.test"), Inventory)
    link = ControlPlaneLink(str(server.make_url("/")), "", None, None, SimpleNamespace(kubernetes=None, nodes=None),
                            AgentMetrics(), inventory=lambda: inv, agent_version="0.2.0", wall_ms=lambda: 0,
                            on_node=print, backoff_min_s=0.01, backoff_max_s=0.02, **kw)
    link.client.token = "nt_x"
    link._registered.set()
    return link


async def test_the_heartbeat_keeps_three_to_each_grace_the_control_plane_names(aiohttp_server):
    """The interval was fixed at register (or by --heartbeat-seconds): a control plane restarted with a shorter
    --node-grace lost the node between heartbeats, over and over."""
    import asyncio
    from aiohttp import web
    grace = {"s": 3.0}

    async def heartbeat(request: web.Request) -> web.Response:
        return web.json_response({"resourceVersion": 1, "graceSeconds": grace["s"], "reportStatuses": ["bound"]})

    server = await _fake_control_plane(aiohttp_server, {"heartbeat": heartbeat})
    link = _link(server, heartbeat_s=10.0)
    task = asyncio.ensure_future(link.heartbeat_loop())
    try:
        await asyncio.sleep(0.3)
        assert link.heartbeat_s == 1.0 and link.metrics.heartbeats_ok >= 1
        grace["s"] = 60.0  # a longer grace again: back to what was asked
        await asyncio.sleep(1.3)
        assert link.heartbeat_s == 10.0
    finally:
        task.cancel()
        await link.client.close()


async def test_a_bad_resource_version_is_a_bad_answer_and_a_refused_one_starts_the_watch_again(aiohttp_server):
    """One watch answer with resourceVersion -1 (a broken proxy) was kept, and every later watch sent it back and
    was refused: the node took no new binding until the agent restarted, while its heartbeats kept it ready."""
    import asyncio
    from aiohttp import web
    sent: list[int] = []
    answers = [{"resourceVersion": -1, "bindings": []}, {"resourceVersion": 7, "bindings": []}]

    async def watch(request: web.Request) -> web.Response:
        body = await request.json()
        sent.append(body["resourceVersion"])
        if body["resourceVersion"] < 0 or sent.count(7) == 1 and body["resourceVersion"] == 7:  # (a restored
            # database that never gave 7, say) refused once
            return web.json_response({"error": {"code": "INVALID_INPUT", "message": "resourceVersion: refused",
                                                "details": {"field": "resourceVersion"}}}, status=400)
        if answers:
            return web.json_response(answers.pop(0))
        await asyncio.sleep(0.05)
        return web.json_response({"resourceVersion": 7, "bindings": [], "changed": False})

    server = await _fake_control_plane(aiohttp_server, {"watch": watch})
    link = _link(server)
    reconciled: list[int] = []

    async def reconcile(bindings, seen, resource_version, why):
        reconciled.append(resource_version)
    link.controller.reconcile, link.controller.started = reconcile, False
    task = asyncio.ensure_future(link.watch_loop())
    try:
        await asyncio.sleep(0.4)
    finally:
        task.cancel()
        await link.client.close()
    assert sent[:4] == [0, 0, 7, 0] and reconciled[:1] == [7], (sent, reconciled)


async def test_an_answer_without_the_control_planes_error_document_drops_nothing(aiohttp_server):
    """A load balancer's 404 page while it reloaded was taken for the control plane refusing the reports, which
    were dropped for good: the unbound of a released reservation was lost."""
    from aiohttp import web

    from agent.nodeclient import NodeApiError, Unreachable

    async def page(request: web.Request) -> web.Response:
        return web.Response(status=404, text="<html><body>404 Not Found</body></html>", content_type="text/html")

    async def envelope(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "INVALID_INPUT", "message": "no", "details": {}}}, status=400)

    server = await _fake_control_plane(aiohttp_server, {"report": page, "heartbeat": envelope})
    link = _link(server)
    try:
        with pytest.raises(Unreachable, match="without the control plane's error document"):
            await link.client.report([])
        with pytest.raises(NodeApiError) as refused:
            await link.client.heartbeat()
        assert refused.value.code == "INVALID_INPUT"
    finally:
        await link.client.close()


def test_the_operators_word_clears_every_health_mark_and_the_quiet_time_reaches_the_policy(tmp_path,
                                                                                            standin_library):
    """A GPU an XID marked unhealthy stayed so until the agent restarted: no quiet time was configurable and nothing
    called the policy's reset. --gpu-health-quiet-minutes sets the one; SIGUSR1 (agent/cli.py) calls the other."""
    from agent.health import HealthPolicy, XidEvent
    from agent.runtime import Agent, AgentConfig

    agent = Agent(AgentConfig(control_plane="http://127.0.0.1:9", bootstrap_token="t", state_dir=tmp_path))
    agent._health = HealthPolicy(quiet_time_s=None)
    agent._health.observe(XidEvent(kind="xid", xid=79, gpu_uuid="GPU-a"))
    agent._health.observe(XidEvent(kind="ecc-dbe", xid=None, gpu_uuid="GPU-b", gpu_instance_id=1,
                                   compute_instance_id=0))
    assert 2 == len(agent._health.marks())
    agent.reset_health()
    assert [] == agent._health.marks() and agent._health.health_of("GPU-a").healthy
    quiet = Agent(AgentConfig(control_plane="http://127.0.0.1:9", bootstrap_token="t", state_dir=tmp_path,
                              nvml_library=str(standin_library), health_quiet_s=90.0))
    quiet._build_discovery()
    assert quiet._health.quiet_time_s == 90.0
