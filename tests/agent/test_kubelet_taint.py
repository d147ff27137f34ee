"""agent.kubelet.taint through the real `kubernetes` client against a loopback stand-in for the API server's Node
endpoints.

No Kubernetes API server can be installed on these machines, so the stand-in
here (aiohttp, on 127.0.0.1) serves what NodeTaints uses, with the API
server's rules for it: GET /api/v1/nodes/{name}; PATCH of the same path as a
JSON patch (RFC 6902: add, replace, remove, test), where the patched
object's resourceVersion must equal the stored one or the answer is 409
Conflict (a Status object); every write bumps resourceVersion; a bearer
token is required. The client is built
from a kubeconfig file the test writes.
"""
from __future__ import annotations

import copy
import json

import pytest
from aiohttp import web

from agent.kubelet.taint import RELEASE_STUCK_TAINT, NodeTaintError, NodeTaints

TOKEN = "stand-in-token-0123456789"
OTHER = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": "2026-12-01T10:00:00Z"}
OURS = {"key": RELEASE_STUCK_TAINT, "value": "rsv-1", "effect": "NoSchedule"}


class PatchFailed(Exception):
    pass


def json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 for object members and list indices, which is all a Node patch needs."""
    result = copy.deepcopy(document)
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        key = int(last) if isinstance(target, list) and last != "-" else last
        exists = key in target if isinstance(target, dict) else isinstance(key, int) and key < len(target)
        if op["op"] == "add":
            if isinstance(target, list):
                target.insert(len(target) if key == "-" else key, op["value"])
            else:
                target[key] = op["value"]
        elif op["op"] in ("replace", "remove", "test") and not exists:
            raise PatchFailed(f"{op['path']} does not exist")
        elif op["op"] == "replace":
            target[key] = op["value"]
        elif op["op"] == "remove":
            del target[key]
        elif op["op"] == "test" and target[key] != op["value"]:
            raise PatchFailed(f"{op['path']} is not {op['value']!r}")
    return result


def status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                              "message": message, "code": code}, status=code)


class NodeApi:
    """The stand-in: one stored Node, the requests it saw, and a hook run before a write (another writer)."""

    def __init__(self, node: dict) -> None:
        self.node = node
        self.requests: list[tuple[str, str]] = []  # (method, content type)
        self.conflicts = 0
        self.before_write = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/api/v1/nodes/{name}", self._get)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch)
        return app

    def taints(self) -> list[dict]:
        return self.node["spec"].get("taints", [])

    def bump(self) -> None:
        meta = self.node["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    @web.middleware
    async def _auth(self, request, handler):
        self.requests.append((request.method, request.content_type if request.can_read_body else ""))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return status(401, "Unauthorized", "Unauthorized")
        if request.match_info.get("name") != self.node["metadata"]["name"]:
            return status(404, "NotFound", f'nodes "{request.match_info.get("name")}" not found')
        return await handler(request)

    async def _get(self, request):
        return web.json_response(self.node)

    async def _patch(self, request):
        if request.content_type != "application/json-patch+json":
            return status(415, "UnsupportedMediaType", f"the stand-in takes JSON patches, not {request.content_type}")
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            hook(self)
        try:
            patched = json_patch(self.node, await request.json())
        except PatchFailed as e:
            return status(422, "Invalid", str(e))
        if patched["metadata"]["resourceVersion"] != self.node["metadata"]["resourceVersion"]:
            self.conflicts += 1
            return status(409, "Conflict", 'Operation cannot be fulfilled on nodes "n1": the object has been '
                                           "modified; please apply your changes to the latest version and try again")
        self.node = patched
        self.bump()
        return web.json_response(self.node)


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
        port = runner.addresses[0][1]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "agent", "user": {"token": token}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "agent"}}],
        }))
        return api, str(kubeconfig)

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
    with pytest.raises(NodeTaintError, match="give the agent a kubeconfig"):
        NodeTaints("n1", kubeconfig=str(tmp_path / "nowhere"))


def test_outside_a_pod_without_a_kubeconfig_says_what_to_give(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(NodeTaintError, match="in-cluster credentials"):
        NodeTaints("n1")
