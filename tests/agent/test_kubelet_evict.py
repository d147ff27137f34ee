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
