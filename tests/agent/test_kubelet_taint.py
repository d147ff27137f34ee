"""agent.kubelet.taint through the real `kubernetes` client against a loopback stand-in for the API server's Node
endpoints (tests/agent/apiserver_stub.py: no Kubernetes API server can be installed on these machines). The client
is built from a kubeconfig file the test writes."""
from __future__ import annotations

import copy

import pytest
from aiohttp import web

from agent.kubelet.apiserver import ApiServerError
from agent.kubelet.taint import RELEASE_STUCK_TAINT, NodeTaintError, NodeTaints
from tests.agent.apiserver_stub import TOKEN, NodeApi, kubeconfig_for
OTHER = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": "2026-12-01T10:00:00Z"}
OURS = {"key": RELEASE_STUCK_TAINT, "value": "rsv-1", "effect": "NoSchedule"}


def a_node(*taints: dict) -> dict:
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "resourceVersion": "100", "labels": {"gpu": "h100"}},
            "spec": {"podCIDR": "10.0.0.0/24"},
            "status": {"capacity": {"berth.dev/h100": "8"}, "futureField": {"kept": True}}}
    if taints:
        node["spec"]["taints"] = [copy.deepcopy(t) for t in taints]
    return node


@pytest.fixture
async def serve(tmp_path):
    """serve(node) -> (NodeApi, kubeconfig path); the stand-in runs until the test ends."""
    runners = []

    async def start(node: dict, token: str = TOKEN):
        api = NodeApi(node)
        runner = web.AppRunner(api.app())
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return api, kubeconfig_for(tmp_path / "kubeconfig", runner.addresses[0][1], token)

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_set_puts_the_taint_on_the_node_on_the_first_call(serve):
    api, kubeconfig = await serve(a_node())
    taints = NodeTaints("n1", kubeconfig=kubeconfig)
    assert await taints.set_async(RELEASE_STUCK_TAINT, "rsv-1")
    assert [OURS] == api.taints()
    assert [("GET", ""), ("PATCH", "application/json-patch+json")] == api.requests


async def test_a_second_set_changes_nothing(serve):
    api, kubeconfig = await serve(a_node())
    taints = NodeTaints("n1", kubeconfig=kubeconfig)
    await taints.set_async(RELEASE_STUCK_TAINT, "rsv-1")
    version = api.node["metadata"]["resourceVersion"]
    assert not await taints.set_async(RELEASE_STUCK_TAINT, "rsv-1")
    assert [OURS] == api.taints()
    assert version == api.node["metadata"]["resourceVersion"]
    assert 1 == sum(method == "PATCH" for method, _ in api.requests)


async def test_set_keeps_other_taints_and_every_other_field(serve):
    api, kubeconfig = await serve(a_node(OTHER))
    before = copy.deepcopy(api.node)
    await NodeTaints("n1", kubeconfig=kubeconfig).set_async(RELEASE_STUCK_TAINT, "rsv-1")
    assert [OTHER, OURS] == api.taints()
    before["metadata"]["resourceVersion"] = "101"
    before["spec"]["taints"] = [OTHER, OURS]
    assert before == api.node


async def test_set_with_a_new_value_replaces_ours_in_place(serve):
    api, kubeconfig = await serve(a_node(OURS, OTHER))
    assert await NodeTaints("n1", kubeconfig=kubeconfig).set_async(RELEASE_STUCK_TAINT, "rsv-2")
    assert [{**OURS, "value": "rsv-2"}, OTHER] == api.taints()


async def test_a_conflict_is_retried_and_the_other_writers_taint_kept(serve):
    api, kubeconfig = await serve(a_node())

    def another_writer(api: NodeApi) -> None:
        api.node["spec"]["taints"] = [OTHER]
        api.bump()

    api.before_write = another_writer
    assert await NodeTaints("n1", kubeconfig=kubeconfig).set_async(RELEASE_STUCK_TAINT, "rsv-1")
    assert 1 == api.conflicts
    assert [OTHER, OURS] == api.taints()
    assert ["GET", "PATCH", "GET", "PATCH"] == [method for method, _ in api.requests]


async def test_remove_takes_only_ours(serve):
    api, kubeconfig = await serve(a_node(OTHER, OURS))
    taints = NodeTaints("n1", kubeconfig=kubeconfig)
    assert await taints.remove_async(RELEASE_STUCK_TAINT)
    assert [OTHER] == api.taints()


async def test_removing_an_absent_taint_writes_nothing(serve):
    api, kubeconfig = await serve(a_node(OTHER))
    assert not await NodeTaints("n1", kubeconfig=kubeconfig).remove_async(RELEASE_STUCK_TAINT)
    assert [("GET", "")] == api.requests
    assert [OTHER] == api.taints()


async def test_a_node_that_does_not_exist_is_named_in_the_error(serve):
    _, kubeconfig = await serve(a_node())
    with pytest.raises(NodeTaintError) as error:
        await NodeTaints("n2", kubeconfig=kubeconfig).set_async(RELEASE_STUCK_TAINT)
    assert ('node n2: the API server answered 404 Not Found (nodes "n2" not found): there is no Node named n2: '
            "check the agent's node name against kubectl get nodes") == str(error.value)


async def test_refused_credentials_say_which_verbs_to_grant(serve):
    _, kubeconfig = await serve(a_node(), token="not-the-right-token-000")
    with pytest.raises(NodeTaintError, match="get and patch nodes"):
        await NodeTaints("n1", kubeconfig=kubeconfig).set_async(RELEASE_STUCK_TAINT)


async def test_a_node_that_keeps_changing_is_given_up_on_with_a_reason(serve):
    api, kubeconfig = await serve(a_node())

    def always_another_writer(api: NodeApi) -> None:
        api.bump()
        api.before_write = always_another_writer

    api.before_write = always_another_writer
    with pytest.raises(NodeTaintError, match="lost to other writers 5 times"):
        await NodeTaints("n1", kubeconfig=kubeconfig).set_async(RELEASE_STUCK_TAINT)
    assert [] == api.taints()


def test_a_missing_kubeconfig_says_what_to_give(tmp_path):
    with pytest.raises(ApiServerError, match="give the agent a kubeconfig"):
        NodeTaints("n1", kubeconfig=str(tmp_path / "nowhere"))


def test_outside_a_pod_without_a_kubeconfig_says_what_to_give(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ApiServerError, match="in-cluster credentials"):
        NodeTaints("n1")
