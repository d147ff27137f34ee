"""binding: 'kubernetes' end to end: a real control plane, a real `berth agent`, and a test kubelet (the same
Registration and PodResources APIs on unix sockets, tests/agent/kubelet_stub.py: no kubelet can run on these
machines). The kubelet sees exactly the booked devices: none before a booking, the booked GPUs' UUIDs while it is
active, nothing after; it may allocate only those; a restarted kubelet gets the plugin registered again."""
from __future__ import annotations

import asyncio
import shutil
import threading
import uuid
from pathlib import Path

import pytest

from tests.agent.kubelet_stub import StubKubelet
from tests.e2e.conftest import K8S_RESOURCE, K8S_TOKEN, ControlPlane
from tests.waiting import wait_for

pytestmark = pytest.mark.kernel

FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]


class KubeletThread:
    """A StubKubelet on its own event loop thread; `call(coro_fn)` runs a coroutine there and returns its result."""

    def __init__(self, root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kubelet")
        self.thread.start()
        self.kubelet = self.call(lambda: _make(root))

    def call(self, fn, timeout: float = 20):
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def devices(self) -> set[str] | None:
        listed = self.kubelet.devices(K8S_RESOURCE)
        return None if listed is None else {d.id for d in listed}

    def close(self) -> None:
        self.call(self.kubelet.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


async def _make(root: Path) -> StubKubelet:
    kubelet = StubKubelet(root)
    await kubelet.start()
    return kubelet


@pytest.fixture
def k8s(agents, workdir, bpf_works):
    root = Path(f"/tmp/bk-{uuid.uuid4().hex[:8]}")  # unix socket paths must stay under 108 bytes
    root.mkdir()
    kubelet = KubeletThread(root)
    cp = ControlPlane(workdir, grace_s=10.0).start()
    a = agents("k8s", cp.url, K8S_TOKEN, extra=[*FAST, "--kubelet-root", str(root)])
    try:
        a.wait_event("reconciled", timeout=20)
        yield cp, a, kubelet
    finally:
        a.stop()
        cp.stop()
        kubelet.close()
        shutil.rmtree(root, ignore_errors=True)


def uuids_of(cp: ControlPlane, res: dict) -> set[str]:
    from controlplane.api.app import CONTROL_PLANE

    [placement] = res["placements"]
    node = cp.app[CONTROL_PLANE].catalog.current.nodes[placement["nodeId"]]
    by_id = {u.id: u.uuid for u in node.units}
    return {by_id[u] for u in placement["devices"]}


def test_the_kubelet_sees_exactly_the_booked_devices_while_the_booking_is_active(k8s):
    cp, a, kubelet = k8s
    assert [] == kubelet.kubelet.registrations  # nothing booked: no plugin at all
    res = cp.create(poolId="k8s", gpuCount=2, binding="kubernetes")
    res = cp.wait_state(res["id"], "active", timeout=10)
    booked = uuids_of(cp, res)
    wait_for(lambda: kubelet.devices() == booked, 5, what="the booked GPUs on the kubelet's stream")
    [registration] = kubelet.kubelet.registrations
    assert (K8S_RESOURCE, "v1beta1") == (registration.resource_name, registration.version)
    assert {d.health for d in kubelet.kubelet.devices(K8S_RESOURCE)} == {"Healthy"}

    # Allocate gives the device nodes and NVIDIA_VISIBLE_DEVICES; an unbooked GPU is refused
    one = sorted(booked)[0]
    answer = kubelet.call(lambda: kubelet.kubelet.allocate(K8S_RESOURCE, [one]))
    assert one == answer.envs["NVIDIA_VISIBLE_DEVICES"]
    paths = [d.host_path for d in answer.devices]
    assert paths[0].startswith("/dev/nvidia") and "/dev/nvidiactl" in paths and "/dev/nvidia-uvm" in paths
    assert set(res["bound"][0]["devices"]) >= set(paths)
    other = "GPU-" + "0" * 8 + "-0000-0000-0000-" + "0" * 12
    with pytest.raises(Exception, match="not advertised"):
        kubelet.call(lambda: kubelet.kubelet.allocate(K8S_RESOURCE, [other]))

    # a second booking adds its devices to the same stream within a second
    second = cp.wait_state(cp.create(poolId="k8s", gpuCount=1, binding="kubernetes")["id"], "active", timeout=10)
    wait_for(lambda: kubelet.devices() == booked | uuids_of(cp, second), 5, what="both bookings advertised")

    # the kubelet restarts (its directory wiped): the plugin registers again and advertises the same set
    kubelet.call(kubelet.kubelet.restart)
    wait_for(lambda: len(kubelet.kubelet.registrations) == 2 and kubelet.devices() == booked | uuids_of(cp, second),
             10, what="registered again after the kubelet's restart")

    # released with no pod holding them: withdrawn
    cp.release(second["id"])
    wait_for(lambda: kubelet.devices() == booked, 5, what="the released booking withdrawn")
    cp.release(res["id"])
    wait_for(lambda: not kubelet.devices(), 5, what="everything withdrawn")
    wait_for(lambda: not cp.get(res["id"]).get("bound"), 5, what="the node's unbound report")


def conditions(cp: ControlPlane, rid: str) -> dict[str, dict]:
    return {c["type"]: c for c in cp.get(rid).get("conditions", [])}


def test_a_release_while_a_pod_holds_the_devices_keeps_them_booked_until_allocation_released(k8s):
    cp, a, kubelet = k8s
    res = cp.wait_state(cp.create(poolId="k8s", gpuCount=8, binding="kubernetes")["id"], "active", timeout=10)
    booked = uuids_of(cp, res)
    wait_for(lambda: kubelet.devices() == booked, 5, what="the booking advertised")
    held = sorted(booked)[:2]
    kubelet.kubelet.hold("team-a", "trainer-0", "main", K8S_RESOURCE, held)

    cp.release(res["id"])
    got = cp.get(res["id"])
    assert ("released", "True") == (got["state"], conditions(cp, res["id"])["DevicesHeld"]["status"])
    wait_for(lambda: not kubelet.devices(), 5, what="the devices withdrawn from the kubelet at once")
    cond = wait_for(lambda: (c := conditions(cp, res["id"])["DevicesHeld"]) and "team-a/trainer-0" in c["message"]
                    and c, 5, what="the holder named on the reservation")
    assert "PodsHoldDevices" == cond["reason"] and "billed" in cond["message"]

    # nothing else can book them meanwhile
    other = cp.create(poolId="k8s", gpuCount=8, binding="kubernetes")
    assert "pending" == cp.get(other["id"])["state"]

    # the pod ends: AllocationReleased frees the devices, the waiting reservation gets them
    kubelet.kubelet.free("team-a", "trainer-0")
    cond = wait_for(lambda: (c := conditions(cp, res["id"])["DevicesHeld"])["status"] == "False" and c, 5,
                    what="AllocationReleased")
    assert "AllocationReleased" == cond["reason"]
    cp.wait_state(other["id"], "active", timeout=10)
    wait_for(lambda: kubelet.devices() == uuids_of(cp, cp.get(other["id"])), 5, what="the next booking advertised")
    assert not cp.get(res["id"]).get("bound")
    _, doc = cp.post("/api/compute/usage/list", {"reservationId": res["id"]})
    kinds = {line["held"] for line in doc["lines"]}
    assert kinds == {False, True} and all(line["to"] > line["from"] for line in doc["lines"]), doc["lines"]
    _, events = cp.post("/api/compute/events/list", {"limit": 500})
    assert "reservation.hold-ended" in [e["type"] for e in events["events"] if e["reservationId"] == res["id"]]


@pytest.fixture
def k8s_api(agents, workdir, bpf_works):
    """As k8s, plus a stand-in for the API server (tests/agent/apiserver_stub.py) that the agent reaches with a
    kubeconfig: its Node can be tainted, and an eviction frees the pod's devices on the test kubelet."""
    from aiohttp import web

    from tests.agent.apiserver_stub import NodeApi, kubeconfig_for

    root = Path(f"/tmp/bk-{uuid.uuid4().hex[:8]}")
    root.mkdir()
    kubelet = KubeletThread(root)
    api = NodeApi({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-k8s-1", "resourceVersion": "1"},
                   "spec": {}})
    api.on_evict = lambda ns, name: kubelet.kubelet.free(ns, name)

    async def serve():
        runner = web.AppRunner(api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = kubelet.call(serve)
    kubeconfig = kubeconfig_for(workdir / "kubeconfig", runner.addresses[0][1])
    cp = ControlPlane(workdir, grace_s=10.0).start()
    a = agents("k8s", cp.url, K8S_TOKEN, extra=[*FAST, "--kubelet-root", str(root), "--kubeconfig", kubeconfig,
                                                "--kubernetes-node-name", "gpu-k8s-1"])
    try:
        a.wait_event("reconciled", timeout=20)
        yield cp, a, kubelet, api
    finally:
        a.stop()
        cp.stop()
        kubelet.call(runner.cleanup)
        kubelet.close()
        shutil.rmtree(root, ignore_errors=True)


def held_then_booked_again(cp: ControlPlane, kubelet: KubeletThread, lasts_ms: int, gap_ms: int) -> tuple[dict, dict]:
    """The whole node booked (kubernetes) for `lasts_ms` from now and again from `gap_ms` after that end, with the
    first booking's first GPU held by pod team-a/trainer-0: (the first, active; the second, placed)."""
    import time

    end = int(time.time() * 1000) + lasts_ms
    res = cp.wait_state(cp.create(poolId="k8s", gpuCount=8, binding="kubernetes", end=end,
                                  durationHours=None)["id"], "active", timeout=5)
    later = cp.create(poolId="k8s", gpuCount=8, binding="kubernetes", start=end + gap_ms, end=end + 3_600_000,
                      durationHours=None)
    assert "placed" == later["state"]
    kubelet.kubelet.hold("team-a", "trainer-0", "main", K8S_RESOURCE, sorted(uuids_of(cp, res))[:1])
    return res, later


def test_held_past_its_end_the_node_is_tainted_and_a_booking_made_in_advance_evicts_the_pods(k8s_api):
    cp, a, kubelet, api = k8s_api
    res, later = held_then_booked_again(cp, kubelet, 6_000, 4_000)
    api.pods.add(("team-a", "trainer-0"))
    cp.release(res["id"])
    wait_for(lambda: "team-a/trainer-0" in conditions(cp, res["id"])["DevicesHeld"]["message"], 5,
             what="the holder reported")

    # past the window's end, still held: carried on, and the Kubernetes Node is tainted NoSchedule
    wait_for(lambda: any(t["key"] == "berth.dev/kubernetes-release-stuck" and t["effect"] == "NoSchedule"
                         for t in api.taints()), 15, interval=0.1, what="the stuck taint on the Node")
    assert "carried on past the window" in conditions(cp, res["id"])["DevicesHeld"]["message"]

    # the advance booking's start: the hold is over, the agent evicts the pod (refused by its disruption budget
    # at first, which the new booking's condition says), and the new booking binds
    api.blocked.add(("team-a", "trainer-0"))
    waits = wait_for(lambda: (c := conditions(cp, later["id"]).get("DevicesBound")) and c["reason"] == "PodsInTheWay"
                     and c, 20, interval=0.1, what="the new booking waiting for the pod")
    assert "team-a/trainer-0: its disruption budget does not allow an eviction now" in waits["message"], waits
    assert [] == api.evicted
    api.blocked.clear()  # retried within 5 s
    cp.wait_state(later["id"], "active", timeout=15)
    assert [("team-a", "trainer-0")] == api.evicted
    assert "Overtaken" == conditions(cp, res["id"])["DevicesHeld"]["reason"]
    wait_for(lambda: not api.taints(), 10, interval=0.1, what="the taint removed when the hold ended")
    _, doc = cp.post("/api/compute/events/list", {"limit": 500})
    evicted = [e for e in doc["events"] if e["type"] == "reservation.pods-evicted"]
    assert [(res["id"], ["team-a/trainer-0"])] == [(e["reservationId"], e["data"]["pods"]) for e in evicted]
    assert uuids_of(cp, cp.get(later["id"])) == kubelet.devices()


def test_without_api_access_pods_that_leave_by_themselves_are_not_said_to_be_evicted(k8s):
    """No kubeconfig: the agent cannot evict. The pod in the advance booking's way leaves by itself; the ended
    booking is unbound then, and no reservation.pods-evicted names a pod nobody evicted."""
    import time

    cp, a, kubelet = k8s
    res, later = held_then_booked_again(cp, kubelet, 4_000, 1_000)
    cp.release(res["id"])
    wait_for(lambda: cp.get(later["id"])["state"] == "binding", 15, interval=0.1, what="the advance booking's start")
    said = a.wait_event("pod holds devices a booking has started on, and stays: the booking waits until it leaves")
    assert ("team-a/trainer-0", True) == (said["pod"], "no Kubernetes API access" in said["why"]), said
    waits = wait_for(lambda: (c := conditions(cp, later["id"]).get("DevicesBound")) and c["reason"] == "PodsInTheWay"
                     and c, 10, interval=0.1, what="the new booking saying why it waits")
    assert "team-a/trainer-0: the agent has no Kubernetes API access to evict it" in waits["message"], waits
    kubelet.kubelet.free("team-a", "trainer-0")  # the pod leaves by itself
    cp.wait_state(later["id"], "active", timeout=15)
    time.sleep(3)  # the agent's report once the pod is gone (which, before, named it as evicted within a second)
    _, doc = cp.post("/api/compute/events/list", {"limit": 500})
    assert "reservation.hold-ended" in [e["type"] for e in doc["events"] if e["reservationId"] == res["id"]]
    assert [] == [e for e in doc["events"] if e["type"] == "reservation.pods-evicted"]
