"""A test kubelet, written from the same two APIs as agent.kubelet: Registration and PodResources under a root.

`StubKubelet(root)` serves Registration on `root/device-plugins/kubelet.sock`
and PodResourcesLister on `root/pod-resources/kubelet.sock`. On Register it
dials the plugin's endpoint, asks GetDevicePluginOptions, and follows
ListAndWatch in the background, keeping every list per resource; tests await
"the list is now X" with a bounded wait. `allocate` and `preferred` call the
plugin as the kubelet's device manager does. `hold` and `free` script which
pod holds which devices, and List answers from that. `restart` does what a
kubelet restart does to plugins: the directory is wiped and a new
`kubelet.sock` made, so a plugin must serve and register again.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import grpc

from agent.kubelet.gen.deviceplugin.v1beta1 import api_pb2 as dp
from agent.kubelet.gen.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.kubelet.gen.podresources.v1 import api_pb2 as pr
from agent.kubelet.gen.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.kubelet.plugin import API_VERSION, DEVICE_PLUGINS_DIR, KUBELET_SOCKET, POD_RESOURCES_DIR, unix_target

_CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Advertised:
    """One device as a ListAndWatch message showed it."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()


def advertised_of(response: dp.ListAndWatchResponse) -> tuple[Advertised, ...]:
    return tuple(Advertised(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in response.devices)


@dataclass
class PluginConnection:
    """What the stub knows of one registered plugin: its request, options, and every list it sent."""

    request: dp.RegisterRequest
    channel: grpc.aio.Channel
    options: dp.DevicePluginOptions | None = None
    lists: list[tuple[Advertised, ...]] = field(default_factory=list)
    stream_ended: bool = False
    task: asyncio.Task | None = None

    @property
    def stub(self) -> dp_grpc.DevicePluginStub:
        return dp_grpc.DevicePluginStub(self.channel)


class StubKubelet:
    """A kubelet's two sockets under `root`, and what a kubelet does with the plugins that register there."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.registration_socket = self.root / DEVICE_PLUGINS_DIR / KUBELET_SOCKET
        self.pod_resources_socket = self.root / POD_RESOURCES_DIR / KUBELET_SOCKET
        self.registrations: list[dp.RegisterRequest] = []
        self.plugins: dict[str, PluginConnection] = {}
        self.refusals: list[grpc.StatusCode] = []  # answers for the next Register calls, one each
        self.refused = 0
        self._holds: dict[tuple[str, str], list[tuple[str, str, tuple[str, ...]]]] = {}
        self._servers: list[grpc.aio.Server] = []
        self._changed = asyncio.Condition()

    # -- lifecycle

    async def start(self, *, wipe: bool = True) -> None:
        """Serve both sockets; first remove everything in device-plugins/, as the kubelet does, unless not `wipe`."""
        plugins_dir = self.registration_socket.parent
        plugins_dir.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        for stale in plugins_dir.iterdir() if wipe else ():
            stale.unlink()
        self.pod_resources_socket.unlink(missing_ok=True)
        registration = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), registration)
        registration.add_insecure_port(unix_target(self.registration_socket))
        pod_resources = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), pod_resources)
        pod_resources.add_insecure_port(unix_target(self.pod_resources_socket))
        for server in (registration, pod_resources):
            await server.start()
            self._servers.append(server)

    async def stop(self) -> None:
        for connection in list(self.plugins.values()):
            await self._disconnect(connection)
        self.plugins.clear()
        for server in self._servers:
            await server.stop(grace=None)
        self._servers.clear()
        self.registration_socket.unlink(missing_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)

    async def restart(self, *, wipe: bool = True) -> None:
        """Stop and start again with a new kubelet.sock; `wipe=False` leaves the plugins' sockets in place."""
        await self.stop()
        await self.start(wipe=wipe)

    async def __aenter__(self) -> StubKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- what the plugins told us

    def devices(self, resource: str) -> tuple[Advertised, ...] | None:
        """The latest list from the resource's plugin; None before its first."""
        connection = self.plugins.get(resource)
        return connection.lists[-1] if connection and connection.lists else None

    async def wait_registered(self, resource: str, count: int = 1, timeout_s: float = 5.0) -> PluginConnection:
        """Wait until `resource` has registered `count` times in all and its first list arrived."""
        def done() -> bool:
            n = sum(r.resource_name == resource for r in self.registrations)
            return n >= count and self.devices(resource) is not None
        await self._wait(done, timeout_s, lambda: f"{resource} registered "
                         f"{sum(r.resource_name == resource for r in self.registrations)} times, wanted {count}")
        return self.plugins[resource]

    async def wait_devices(self, resource: str, expected: Sequence[Advertised], timeout_s: float = 1.0) -> None:
        """Wait until the resource's latest list equals `expected`."""
        expected = tuple(expected)
        await self._wait(lambda: self.devices(resource) == expected, timeout_s,
                         lambda: f"{resource}: wanted {expected}, the latest list is {self.devices(resource)}")

    async def wait_refused(self, count: int, timeout_s: float = 5.0) -> None:
        await self._wait(lambda: self.refused >= count, timeout_s, lambda: f"refused {self.refused}, wanted {count}")

    async def wait_stream_ended(self, resource: str, timeout_s: float = 1.0) -> None:
        await self._wait(lambda: self.plugins[resource].stream_ended, timeout_s,
                         lambda: f"{resource}: ListAndWatch is still open")

    # -- calls a kubelet makes

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> dp.ContainerAllocateResponse:
        request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=list(device_ids))])
        answer = await self.plugins[resource].stub.Allocate(request, timeout=_CALL_TIMEOUT_S)
        return answer.container_responses[0]

    async def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                        size: int) -> list[str]:
        request = dp.PreferredAllocationRequest(container_requests=[dp.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size)])
        answer = await self.plugins[resource].stub.GetPreferredAllocation(request, timeout=_CALL_TIMEOUT_S)
        return list(answer.container_responses[0].deviceIDs)

    # -- the pods, as a script

    def hold(self, namespace: str, name: str, container: str, resource: str, device_ids: Sequence[str]) -> None:
        self._holds.setdefault((namespace, name), []).append((container, resource, tuple(device_ids)))

    def free(self, namespace: str, name: str) -> None:
        self._holds.pop((namespace, name), None)

    def pod_resources(self) -> pr.ListPodResourcesResponse:
        pods = []
        for (namespace, name), held in self._holds.items():
            containers: dict[str, pr.ContainerResources] = {}
            for container, resource, ids in held:
                containers.setdefault(container, pr.ContainerResources(name=container)).devices.append(
                    pr.ContainerDevices(resource_name=resource, device_ids=ids))
            pods.append(pr.PodResources(name=name, namespace=namespace, containers=list(containers.values())))
        return pr.ListPodResourcesResponse(pod_resources=pods)

    # -- inside

    async def _register(self, request: dp.RegisterRequest) -> None:
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            await self._disconnect(old)
        channel = grpc.aio.insecure_channel(unix_target(self.registration_socket.parent / request.endpoint))
        connection = PluginConnection(request=request, channel=channel)
        self.plugins[request.resource_name] = connection
        self.registrations.append(request)
        connection.task = asyncio.create_task(self._follow(connection))

    async def _follow(self, connection: PluginConnection) -> None:
        """GetDevicePluginOptions, then ListAndWatch until the plugin ends it."""
        try:
            connection.options = await connection.stub.GetDevicePluginOptions(dp.Empty(), timeout=_CALL_TIMEOUT_S)
            async for response in connection.stub.ListAndWatch(dp.Empty()):
                connection.lists.append(advertised_of(response))
                await self._notify()
        except grpc.aio.AioRpcError:
            pass
        connection.stream_ended = True
        await self._notify()

    async def _disconnect(self, connection: PluginConnection) -> None:
        if connection.task is not None:
            connection.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connection.task
        await connection.channel.close()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, done: Callable[[], bool], timeout_s: float, describe: Callable[[], str]) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                async with self._changed:
                    await self._changed.wait_for(done)
        except TimeoutError:
            raise AssertionError(f"after {timeout_s} s: {describe()}") from None


class _Registration(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: StubKubelet) -> None:
        self._kubelet = kubelet

    async def Register(self, request, context):
        if self._kubelet.refusals:
            self._kubelet.refused += 1
            await self._kubelet._notify()
            await context.abort(self._kubelet.refusals.pop(0), "the stub kubelet refuses this registration")
        if request.version != API_VERSION:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version}")
        if "/" not in request.resource_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid resource name {request.resource_name}")
        await self._kubelet._register(request)
        await self._kubelet._notify()
        return dp.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: StubKubelet) -> None:
        self._kubelet = kubelet

    async def List(self, request, context):
        return self._kubelet.pod_resources()
