"""The agent's client of the Kubernetes API server: credentials (a kubeconfig, or the pod's service account) and
one translation of its failures into errors that say what to check."""
from __future__ import annotations

import json
from typing import Any

import kubernetes

from agent.kubelet.plugin import KubeletError


class ApiServerError(KubeletError):
    """A request to the API server failed, or no credentials were found; the message says what to check."""


def core_api(kubeconfig: str | None) -> Any:
    """A `kubernetes.client.CoreV1Api` from the kubeconfig file, or from in-cluster credentials when None."""
    try:
        if kubeconfig is not None:
            return kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(config_file=kubeconfig))
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=configuration)
        return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))
    except (kubernetes.config.ConfigException, OSError) as e:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster credentials (no kubeconfig was given)"
        raise ApiServerError(f"cannot load {where}: {e}; give the agent a kubeconfig file (--kubeconfig) or run it "
                             "in a pod with a service account") from e


def server_message(e: kubernetes.client.ApiException) -> str:
    """The message of the Status object the API server sent, or its raw body."""
    body = e.body.decode(errors="replace") if isinstance(e.body, bytes) else str(e.body or "")
    try:
        return str(json.loads(body).get("message", body))
    except (ValueError, AttributeError):
        return body[:200]
