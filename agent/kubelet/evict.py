"""Evicting a pod through the API server's Eviction API (policy/v1), as `kubectl drain` does: the pod's
PodDisruptionBudget is honoured (429: try again later), a pod already gone is done.

Used when a booking made in advance takes devices that pods of an ended kubernetes booking still hold. The
kubernetes client is synchronous: `evict_async` runs it in a worker thread."""
from __future__ import annotations

import asyncio
from typing import Any, Literal

import kubernetes
import structlog
import urllib3

from agent.kubelet.apiserver import ApiServerError, core_api, server_message

log = structlog.get_logger("berth.agent.kubelet")

_REQUEST_TIMEOUT_S = 10
Outcome = Literal["evicted", "gone", "blocked"]


class PodEvictions:
    """Evictions through one API server; `client` is a CoreV1Api, else built from `kubeconfig` (or in-cluster)."""

    def __init__(self, *, kubeconfig: str | None = None, client: Any = None) -> None:
        self._core = client if client is not None else core_api(kubeconfig)

    def evict(self, namespace: str, name: str) -> Outcome:
        """Ask the API server to evict the pod: evicted (accepted), gone (no such pod) or blocked (its disruption
        budget does not allow it now); ApiServerError for anything else."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        try:
            self._core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False,
                                                      _request_timeout=_REQUEST_TIMEOUT_S)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return "gone"
            if e.status == 429:
                log.info("eviction blocked by a disruption budget; retrying later", pod=f"{namespace}/{name}",
                         message=server_message(e))
                return "blocked"
            raise ApiServerError(f"evicting pod {namespace}/{name}: the API server answered {e.status} {e.reason} "
                                 f"({server_message(e)}); the agent's credentials need the create verb on "
                                 "pods/eviction") from e
        except urllib3.exceptions.HTTPError as e:
            raise ApiServerError(f"evicting pod {namespace}/{name}: cannot reach the API server ({e})") from e
        log.info("pod evicted", pod=f"{namespace}/{name}")
        return "evicted"

    async def evict_async(self, namespace: str, name: str) -> Outcome:
        return await asyncio.to_thread(self.evict, namespace, name)
