"""agent.kubelet.evict through the real `kubernetes` client against the loopback stand-in for the API server
(tests/agent/apiserver_stub.py): an eviction is accepted, a pod already gone is done, a disruption budget that
refuses is `blocked` (try again), and refused credentials say which verb to grant."""
from __future__ import annotations

import pytest
from aiohttp import web

from agent.kubelet.apiserver import ApiServerError
from agent.kubelet.evict import PodEvictions
from tests.agent.apiserver_stub import NodeApi, kubeconfig_for


@pytest.fixture
async def standin(tmp_path):
    api = NodeApi({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "resourceVersion": "1"},
                   "spec": {}})
    runner = web.AppRunner(api.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield api, runner.addresses[0][1], tmp_path
    await runner.cleanup()


async def test_an_eviction_is_accepted_a_gone_pod_is_done_and_a_budget_blocks(standin):
    api, port, tmp = standin
    api.pods |= {("team-a", "trainer-0"), ("team-a", "trainer-1")}
    api.blocked.add(("team-a", "trainer-1"))
    seen = []
    api.on_evict = lambda ns, name: seen.append((ns, name))
    evictions = PodEvictions(kubeconfig=kubeconfig_for(tmp / "kc", port))
    assert "evicted" == await evictions.evict_async("team-a", "trainer-0")
    assert "gone" == await evictions.evict_async("team-a", "trainer-0")
    assert "blocked" == await evictions.evict_async("team-a", "trainer-1")
    api.blocked.clear()
    assert "evicted" == await evictions.evict_async("team-a", "trainer-1")
    assert [("team-a", "trainer-0"), ("team-a", "trainer-1")] == seen


async def test_refused_credentials_say_which_verb_to_grant(standin):
    api, port, tmp = standin
    evictions = PodEvictions(kubeconfig=kubeconfig_for(tmp / "kc", port, token="not-the-token-000000"))
    with pytest.raises(ApiServerError, match="create verb on pods/eviction"):
        await evictions.evict_async("team-a", "trainer-0")


async def test_a_booking_that_pods_are_in_the_way_of_is_reported_waiting_with_why_only_to_a_control_plane_that_takes_it(
        standin):
    """KubernetesBindings' side: the pods of an ended booking holding a new booking's device are evicted; the new
    booking is reported `waiting` with them and why each stays (its budget, then evicted and stopping), once per
    change, and only where the control plane's heartbeat answer listed `waiting` (an older one does not)."""
    import msgspec

    from agent.kubelet.podresources import PodDevices
    from agent.kubernetes import KubernetesBindings
    from common.nodewire import Binding, BindingUnit, HeartbeatAnswer

    api, port, tmp = standin
    api.pods.add(("team-a", "trainer-0"))
    api.blocked.add(("team-a", "trainer-0"))
    pods = KubernetesBindings(tmp, kubeconfig=kubeconfig_for(tmp / "kc", port), node_name="n1")
    new = Binding("rsv_new", "kubernetes", "t", "p", 0, 1, (BindingUnit("u0", 0, "GPU-1"),),
                  resourceName="berth.dev/gpu")
    held = [PodDevices("team-a", "trainer-0", "main", "berth.dev/gpu", ("GPU-1",))]

    older = msgspec.json.decode(b'{"resourceVersion": 3, "graceSeconds": 30.0}', type=HeartbeatAnswer)
    assert "waiting" not in older.reportStatuses
    assert [] == await pods._evict_for([new], held, {"rsv_new"})  # the default: nothing such is sent
    assert {"rsv_new": ["team-a/trainer-0"]} == pods.blocked

    pods.report_waiting = True
    [report] = await pods._evict_for([new], held, {"rsv_new"})
    assert ("rsv_new", "waiting", ("team-a/trainer-0",)) == (report.reservationId, report.status, report.holders)
    assert report.message == ("Pods of an ended booking still hold the devices; they are bound once the pods are "
                              "gone. team-a/trainer-0: its disruption budget does not allow an eviction now; "
                              "retried until it does.")
    assert [] == await pods._evict_for([new], held, {"rsv_new"})  # the same again: not sent again
    assert pods._retry_at is not None  # the watch tries it again

    api.blocked.clear()
    [report] = await pods._evict_for([new], held, {"rsv_new"})  # evicted now; the kubelet still lists it
    assert report.message.endswith("team-a/trainer-0: evicted, stopping.")
    assert [] == await pods._evict_for([new], [], {"rsv_new"})  # gone: nothing in the way
    assert ({}, None) == (pods.blocked, pods._retry_at)


async def test_pods_evicted_for_a_new_booking_are_told_to_the_ended_one_after_an_agent_restart_too(standin):
    """Which ended booking a pod in the way belonged to was in memory only: an agent restarted meanwhile evicted
    the pods but sent no `unbound` naming them, so no reservation.pods-evicted. The checkpoint's bound kubernetes
    entries now seed it at start."""
    from agent.checkpoint import BindingEntry
    from agent.kubelet.podresources import PodDevices
    from agent.kubernetes import KubernetesBindings
    from common.nodewire import Binding, BindingUnit

    api, port, tmp = standin
    api.pods.add(("team-a", "trainer-0"))
    restarted = KubernetesBindings(tmp, kubeconfig=kubeconfig_for(tmp / "kc", port), node_name="n1")
    restarted.remember_bound([BindingEntry(reservationId="rsv_old", state="completed", spec="berth.dev/gpu",
                                           cgroup="", kind="kubernetes", devices=["GPU-1"])])
    new = Binding("rsv_new", "kubernetes", "t", "p", 0, 1, (BindingUnit("u0", 0, "GPU-1"),),
                  resourceName="berth.dev/gpu")
    held = [PodDevices("team-a", "trainer-0", "main", "berth.dev/gpu", ("GPU-1",))]
    assert [] == await restarted._evict_for([new], held, {"rsv_new"})  # evicted; the kubelet still lists it
    [told] = await restarted._evict_for([new], [], {"rsv_new"})  # gone
    assert ("rsv_old", "unbound", ("team-a/trainer-0",)) == (told.reservationId, told.status, told.evicted)
