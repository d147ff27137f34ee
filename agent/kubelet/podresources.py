"""Which pods hold which devices, from the kubelet's PodResources API (v1, List).

The kubelet serves it on `<kubelet root>/pod-resources/kubelet.sock`.

The agent asks this before it reports a kubernetes binding released: a device
still listed here is still in a container. gRPC failures become one
PodResourcesError whose message says what to check.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.kubelet.gen.podresources.v1 import api_pb2 as api
from agent.kubelet.gen.podresources.v1 import api_pb2_grpc as api_grpc
from agent.kubelet.plugin import KUBELET_SOCKET, POD_RESOURCES_DIR, KubeletError, unix_target


class PodResourcesError(KubeletError):
    """The kubelet's PodResources API could not be read; the message says what to check."""


@dataclass(frozen=True)
class PodDevices:
    """The devices of one resource that one container of one pod holds."""

    namespace: str
    name: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


def pod_resources_socket(kubelet_root: Path) -> Path:
    return Path(kubelet_root) / POD_RESOURCES_DIR / KUBELET_SOCKET


async def list_pod_devices(kubelet_root: Path, resource_name: str | None = None,
                           timeout_s: float = 5) -> list[PodDevices]:
    """Every (pod, container, resource) that holds devices, in the kubelet's order; only `resource_name`'s if given."""
    socket = pod_resources_socket(kubelet_root)
    if not socket.exists():
        raise PodResourcesError(f"{socket} does not exist: the kubelet is not running, or its root is not "
                                f"--kubelet-root {kubelet_root}")
    try:
        async with grpc.aio.insecure_channel(unix_target(socket)) as channel:
            answer = await api_grpc.PodResourcesListerStub(channel).List(api.ListPodResourcesRequest(),
                                                                         timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        raise PodResourcesError(f"PodResources List at {socket} failed: {e.code().name}: {e.details()}; "
                                f"{_what_to_check(e.code(), timeout_s)}") from e
    return [
        PodDevices(namespace=pod.namespace, name=pod.name, container=container.name,
                   resource_name=devices.resource_name, device_ids=tuple(devices.device_ids))
        for pod in answer.pod_resources
        for container in pod.containers
        for devices in container.devices
        if devices.device_ids and resource_name in (None, devices.resource_name)
    ]


def _what_to_check(code: grpc.StatusCode, timeout_s: float) -> str:
    if code == grpc.StatusCode.UNAVAILABLE:
        return "the socket is there but nobody answers: is the kubelet running, and may this user connect?"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the kubelet did not answer within {timeout_s} s: it may be overloaded or hung"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "this kubelet does not serve PodResources v1 (Kubernetes 1.20 or later is needed)"
    return "see the kubelet's log"
