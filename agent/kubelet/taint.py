"""A taint on this host's Kubernetes Node object, set and removed without losing anyone else's.

`NodeTaints` reads the Node as raw JSON (no round trip through the client's
models, so no field it does not know is dropped), changes only
`spec.taints`, and writes that list back as a JSON patch (RFC 6902, the
client's default patch type in every version) that also sets
metadata.resourceVersion to the version it read. The API server takes a
resourceVersion in a patch as a precondition and answers 409 Conflict when
anyone wrote the Node in between; we then read again and redo the change,
a few times at most. A taint is one per (key, effect), as
the API server counts them. Setting what is already there and removing
what is absent write nothing.

The kubernetes client is synchronous: `set_async` and `remove_async` run it
in a worker thread for the agent's event loop.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import kubernetes
import structlog
import urllib3

from agent.kubelet.apiserver import ApiServerError, core_api, server_message

log = structlog.get_logger("berth.agent.kubelet")

RELEASE_STUCK_TAINT = "berth.dev/kubernetes-release-stuck"
NO_SCHEDULE = "NoSchedule"

_CONFLICT_ATTEMPTS = 5
_REQUEST_TIMEOUT_S = 10

Taint = dict[str, Any]


class NodeTaintError(ApiServerError):
    """The Node's taints could not be read or written; the message says what to check."""


class NodeTaints:
    """The taints of one Node. `client` is a `kubernetes.client.CoreV1Api`; without one it is built from
    `kubeconfig`, or from the pod's service account when that is None."""

    def __init__(self, node_name: str, *, kubeconfig: str | None = None, client: Any = None) -> None:
        self.node_name = node_name
        self._core = client if client is not None else core_api(kubeconfig)
        self._log = log.bind(node_name=node_name)

    def set(self, key: str, value: str = "", effect: str = NO_SCHEDULE) -> bool:
        """Make the Node carry `key=value:effect`; answers whether anything was written."""
        ours = {"key": key, "value": value, "effect": effect} if value else {"key": key, "effect": effect}

        def edit(taints: list[Taint]) -> list[Taint]:
            for i, t in enumerate(taints):
                if t.get("key") == key and t.get("effect") == effect:
                    if t.get("value", "") == value:
                        return taints
                    return [*taints[:i], {**t, **ours}, *taints[i + 1:]]
            return [*taints, ours]

        return self._change(edit, f"set {key}:{effect}")

    def remove(self, key: str) -> bool:
        """Take every taint with `key` off the Node and no other; answers whether anything was written."""
        return self._change(lambda taints: [t for t in taints if t.get("key") != key], f"remove {key}")

    async def set_async(self, key: str, value: str = "", effect: str = NO_SCHEDULE) -> bool:
        return await asyncio.to_thread(self.set, key, value, effect)

    async def remove_async(self, key: str) -> bool:
        return await asyncio.to_thread(self.remove, key)

    def taints(self) -> list[Taint]:
        """The Node's taints as the API server has them now."""
        return list(self._read().get("spec", {}).get("taints") or [])

    def _change(self, edit: Callable[[list[Taint]], list[Taint]], what: str) -> bool:
        for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
            node = self._read()
            taints = list(node.get("spec", {}).get("taints") or [])
            wanted = edit(taints)
            if wanted == taints:
                return False
            patch = [{"op": "replace", "path": "/metadata/resourceVersion",
                      "value": node["metadata"]["resourceVersion"]},
                     {"op": "add", "path": "/spec/taints", "value": wanted} if "spec" in node
                     else {"op": "add", "path": "/spec", "value": {"taints": wanted}}]
            try:
                self._call(self._core.patch_node, self.node_name, patch)
            except _Conflict:
                self._log.info("node changed while we wrote its taints; retrying", change=what, attempt=attempt)
                continue
            self._log.info("node taints changed", change=what)
            return True
        raise NodeTaintError(f"node {self.node_name}: {what} lost to other writers {_CONFLICT_ATTEMPTS} times in a "
                             "row; something rewrites this Node constantly, find it (kubectl get node -w)")

    def _read(self) -> dict[str, Any]:
        response = self._call(self._core.read_node, self.node_name)
        return json.loads(response.data)

    def _call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """One API request, raw (no model round trip), with its failures translated."""
        try:
            return method(*args, _preload_content=False, _request_timeout=_REQUEST_TIMEOUT_S, **kwargs)
        except kubernetes.client.ApiException as e:
            if e.status == 409:
                raise _Conflict() from e
            raise NodeTaintError(f"node {self.node_name}: the API server answered {e.status} {e.reason} "
                                 f"({server_message(e)}): {_what_to_check(e.status, self.node_name)}") from e
        except urllib3.exceptions.HTTPError as e:
            raise NodeTaintError(f"node {self.node_name}: cannot reach the API server ({e}); check the kubeconfig's "
                                 "server address and the network") from e


class _Conflict(Exception):
    """409: the Node changed since we read it."""


def _what_to_check(status: int, node_name: str) -> str:
    if status == 404:
        return f"there is no Node named {node_name}: check the agent's node name against kubectl get nodes"
    if status in (401, 403):
        return "the agent's credentials may not get and patch nodes: grant it those verbs on nodes (RBAC)"
    return "see the API server's message and log"
