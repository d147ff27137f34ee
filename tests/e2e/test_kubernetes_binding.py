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
from tests.e2e.conftest import K8S_RESOURCE, K8S_TOKEN, ControlPlane, wait_for

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
