"""A loopback stand-in for the parts of the Kubernetes API server the agent uses, with the API server's rules for
them (no API server can be installed on these machines): GET /api/v1/nodes/{name}; PATCH of the same path as a
JSON patch (RFC 6902: add, replace, remove, test), where the patched object's resourceVersion must equal the
stored one or the answer is 409 Conflict (a Status object), every write bumping resourceVersion; and POST
/api/v1/namespaces/{ns}/pods/{name}/eviction (policy/v1 Eviction: 201, 404 for a pod it does not know, 429 while
the test says a disruption budget blocks it). A bearer token is required. The real `kubernetes` client talks to
it through a kubeconfig file (`kubeconfig_for`).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

from aiohttp import web

TOKEN = "stand-in-token-0123456789"


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
        self.pods: set[tuple[str, str]] = set()  # (namespace, name) the API server knows
        self.blocked: set[tuple[str, str]] = set()  # pods whose disruption budget refuses an eviction now
        self.evicted: list[tuple[str, str]] = []
        self.on_evict: Callable[[str, str], None] = lambda namespace, name: None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/api/v1/nodes/{name}", self._get)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch)
        app.router.add_post("/api/v1/namespaces/{namespace}/pods/{pod}/eviction", self._evict)
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
        if "name" in request.match_info and request.match_info["name"] != self.node["metadata"]["name"]:
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


    async def _evict(self, request):
        pod = (request.match_info["namespace"], request.match_info["pod"])
        doc = await request.json()
        if doc.get("kind") != "Eviction" or doc.get("metadata", {}).get("name") != pod[1]:
            return status(400, "BadRequest", "the body must be an Eviction naming the pod")
        if pod not in self.pods:
            return status(404, "NotFound", f'pods "{pod[1]}" not found')
        if pod in self.blocked:
            return status(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.")
        self.pods.discard(pod)
        self.evicted.append(pod)
        self.on_evict(*pod)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}, status=201)


def kubeconfig_for(path: Path, port: int, token: str = TOKEN) -> str:
    """A kubeconfig file that points the client at the stand-in on 127.0.0.1:port."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "standin",
        "clusters": [{"name": "standin", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "agent"}}],
    }))
    return str(path)
