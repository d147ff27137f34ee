"""The kubelet device plugin for one extended resource: its socket, the devices it advertises, its registration.

A `DevicePlugin` serves the kubelet's DevicePlugin API (v1beta1) on
`<kubelet root>/device-plugins/<endpoint>`, then registers with the kubelet
on `kubelet.sock` beside it, and does both again whenever the kubelet makes
a new `kubelet.sock` (a restarting kubelet wipes the directory, our socket
with it). The owner says what to advertise with `set_devices`, from the event
loop's thread; that set is the one truth here: ListAndWatch sends it whole on
every change, Allocate refuses any id outside it, GetPreferredAllocation picks
only from it.

How a device reaches a container is one strategy, in `container_allocation`:
its device nodes as DeviceSpecs and its `visible_id` in NVIDIA_VISIBLE_DEVICES.
Devices are named to the kubelet by `PluginDevice.id` (the GPU or MIG UUID).
The placement hint is the pure function `preferred_allocation`.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterable, Mapping, Sequence

import grpc
import structlog

from agent.errors import AgentError
from agent.kubelet.gen.deviceplugin.v1beta1 import api_pb2 as api
from agent.kubelet.gen.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc

log = structlog.get_logger("berth.agent.kubelet")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEVICE_PLUGINS_DIR = "device-plugins"
POD_RESOURCES_DIR = "pod-resources"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL
_REGISTER_TIMEOUT_S = 5.0
_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0


class KubeletError(AgentError):
    """Talking to the kubelet failed; the message says what to check."""


class DeviceNotAdvertised(KubeletError):
    """The kubelet asked for a device this plugin does not advertise now (withdrawn, or never booked)."""


@dataclass(frozen=True)
class PluginDevice:
    """One device as the kubelet sees it: `id` its name there, `device_nodes` the host paths a container needs,
    `visible_id` what goes into NVIDIA_VISIBLE_DEVICES."""

    id: str
    healthy: bool
    numa_node: int | None
    device_nodes: tuple[str, ...]
    visible_id: str


def default_endpoint(resource_name: str) -> str:
    """The plugin's socket name for a resource: "berth.dev/h100" -> "berth-h100.sock" (the domain's first label and
    the name, as NVIDIA's "nvidia.com/gpu" -> "nvidia-gpu.sock")."""
    domain, _, name = resource_name.rpartition("/")
    stem = "-".join(part for part in (domain.split(".")[0], name) if part)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem) + ".sock"


def unix_target(path: Path) -> str:
    """The gRPC target for a unix socket, refusing a path the kernel would not take."""
    path = Path(os.path.abspath(path))
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise KubeletError(f"socket path {path} is longer than a unix socket allows ({_UNIX_PATH_MAX} bytes): "
                           "use a shorter --kubelet-root")
    return f"unix://{path}"


# -- the protocol's answers, from plain data -------------------------------------


def advertised(devices: Iterable[PluginDevice]) -> api.ListAndWatchResponse:
    """The ListAndWatch message for a device set: every device, its health and its NUMA node."""
    return api.ListAndWatchResponse(devices=[
        api.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY,
                   topology=None if d.numa_node is None else api.TopologyInfo(nodes=[api.NUMANode(ID=d.numa_node)]))
        for d in devices
    ])


def container_allocation(devices: Sequence[PluginDevice]) -> api.ContainerAllocateResponse:
    """What the runtime gives a container for these devices: each device node once (read-write, same path inside)
    and NVIDIA_VISIBLE_DEVICES naming them in the order asked."""
    nodes = dict.fromkeys(node for d in devices for node in d.device_nodes)
    return api.ContainerAllocateResponse(
        envs={VISIBLE_DEVICES_ENV: ",".join(d.visible_id for d in devices)},
        devices=[api.DeviceSpec(container_path=node, host_path=node, permissions="rw") for node in nodes],
    )


def preferred_allocation(available: Sequence[str], must_include: Sequence[str], size: int,
                         numa_of: Mapping[str, int | None], *, by_numa: bool = True) -> list[str]:
    """Choose `size` ids: all of `must_include` first, then from `available` on as few NUMA nodes as possible.

    The nodes the must-include devices sit on are filled first; then, while devices are still needed, the tightest
    node that has room for all of them is taken, or else the fullest node. So a request that fits one node stays on
    one, and leaves the larger nodes whole. Without `by_numa` the rest come in `available`'s order.
    """
    chosen = list(dict.fromkeys(must_include))
    need = size - len(chosen)
    if need <= 0:
        return chosen
    taken = set(chosen)
    rest = [i for i in dict.fromkeys(available) if i not in taken]
    if not by_numa:
        return chosen + rest[:need]
    free: dict[int | None, list[str]] = {}
    for i in rest:
        free.setdefault(numa_of.get(i), []).append(i)

    def rank(node: int | None) -> tuple[bool, int]:
        return node is None, node or 0

    picked: list[str] = []
    for node in sorted({numa_of.get(i) for i in chosen} & free.keys(), key=rank):
        picked += free.pop(node)[:need - len(picked)]
    while len(picked) < need and free:
        want = need - len(picked)
        fitting = [n for n in free if len(free[n]) >= want]
        node = (min(fitting, key=lambda n: (len(free[n]), rank(n))) if fitting
                else min(free, key=lambda n: (-len(free[n]), rank(n))))
        picked += free.pop(node)[:want]
    return chosen + picked


# -- the plugin -------------------------------------------------------------------


class DevicePlugin:
    """The device plugin for one resource name: start() serves and registers, stop() withdraws it, set_devices()
    changes what it advertises. `registrations` counts successful registrations, `registered` is set while the
    current kubelet has accepted us, `last_error` says why the last attempt failed.

    `preferred_numa=False` answers GetPreferredAllocation in the kubelet's order instead of packing NUMA nodes;
    `poll_s` is how often the kubelet's socket is checked for a restart.
    """

    def __init__(self, resource_name: str, kubelet_root: Path, *, endpoint: str | None = None,
                 preferred_numa: bool = True, poll_s: float = 0.25) -> None:
        if "/" not in resource_name:
            raise KubeletError(f"resource name {resource_name!r} has no domain: the kubelet accepts only extended "
                               "resources such as 'berth.dev/h100'")
        self.resource_name = resource_name
        self.endpoint = endpoint or default_endpoint(resource_name)
        self.socket_path = Path(kubelet_root) / DEVICE_PLUGINS_DIR / self.endpoint
        self.kubelet_socket = Path(kubelet_root) / DEVICE_PLUGINS_DIR / KUBELET_SOCKET
        self.preferred_numa = preferred_numa
        self.registrations = 0
        self.registered = asyncio.Event()
        self.last_error: str | None = None
        self._poll_s = poll_s
        self._devices: dict[str, PluginDevice] = {}
        self._changed = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._keeper: asyncio.Task | None = None
        self._registered_to: tuple[int, int, int] | None = None  # the kubelet socket that accepted us
        self._log = log.bind(resource_name=resource_name)
        unix_target(self.socket_path)  # refuse an unusable root now, not at start

    # -- what is advertised

    @property
    def devices(self) -> tuple[PluginDevice, ...]:
        return tuple(self._devices.values())

    def set_devices(self, devices: Iterable[PluginDevice]) -> None:
        """Advertise exactly these devices from now on; every ListAndWatch stream gets the new list at once."""
        new: dict[str, PluginDevice] = {}
        for d in devices:
            if d.id in new:
                raise ValueError(f"{self.resource_name}: device id {d.id} is given twice")
            new[d.id] = d
        if new == self._devices:
            return
        self._devices = new
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        self._log.info("devices advertised", devices=len(new), healthy=sum(d.healthy for d in new.values()))

    async def advertisements(self) -> AsyncIterator[api.ListAndWatchResponse]:
        """The ListAndWatch stream: the whole current list now and after every change, until cancelled."""
        while True:
            changed = self._changed
            yield advertised(self._devices.values())
            await changed.wait()

    def allocate(self, device_ids: Sequence[str]) -> api.ContainerAllocateResponse:
        """The container's devices and environment, or DeviceNotAdvertised naming the ids it may not have."""
        unknown = [i for i in device_ids if i not in self._devices]
        if unknown:
            self._log.warning("allocation refused", devices=list(device_ids), not_advertised=unknown)
            raise DeviceNotAdvertised(
                f"{self.resource_name}: device(s) {', '.join(unknown)} are not advertised by this plugin (withdrawn "
                "or never booked); the kubelet may only allocate from the current ListAndWatch list")
        self._log.info("allocated", devices=list(device_ids))
        return container_allocation([self._devices[i] for i in device_ids])

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """The GetPreferredAllocation answer for one container, from the devices advertised now."""
        numa_of = {i: d.numa_node for i, d in self._devices.items()}
        return preferred_allocation([i for i in available if i in numa_of], [i for i in must_include if i in numa_of],
                                    size, numa_of, by_numa=self.preferred_numa)

    def options(self) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    # -- lifecycle

    async def start(self) -> None:
        """Serve on the plugin's socket, then keep registered with the kubelet (in the background, with retries)."""
        if self._keeper is not None:
            return
        await self._serve()
        self._keeper = asyncio.create_task(self._keep_registered(), name=f"device plugin {self.resource_name}")
        self._keeper.add_done_callback(self._keeper_ended)

    async def stop(self) -> None:
        """Stop registering and serving and remove the socket: the kubelet sees the resource go."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await self._stop_serving()
        self.registered.clear()
        self._log.info("device plugin stopped", socket=str(self.socket_path))

    async def restart(self) -> None:
        """A fresh socket and a new registration, as after a kubelet restart."""
        await self.stop()
        await self.start()

    async def __aenter__(self) -> DevicePlugin:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _keeper_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.last_error = f"the registration loop died: {task.exception()!r}"
            self.registered.clear()
            self._log.error("registration loop died; restart the plugin", exc_info=task.exception())

    async def _serve(self) -> None:
        await self._stop_serving()
        try:
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            self.socket_path.unlink(missing_ok=True)  # a stale socket from an earlier run
        except OSError as e:  # this booking's failure (BindFailed), not the agent's
            raise KubeletError(f"{self.resource_name}: cannot serve on {self.socket_path}: {e.strerror or e}; check "
                               "--kubelet-root (the kubelet's root directory, default /var/lib/kubelet)") from e
        server = grpc.aio.server()
        api_grpc.add_DevicePluginServicer_to_server(_DevicePluginService(self), server)
        try:
            server.add_insecure_port(unix_target(self.socket_path))
            await server.start()
        except RuntimeError as e:
            raise KubeletError(f"{self.resource_name}: cannot serve on {self.socket_path}: {e}; check that "
                               f"{self.socket_path.parent} is writable") from e
        self._server = server
        self._log.info("device plugin serving", socket=str(self.socket_path))

    async def _stop_serving(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=None)
            self.socket_path.unlink(missing_ok=True)

    async def _keep_registered(self) -> None:
        """Check the sockets every poll: serve afresh when ours was wiped or the kubelet restarted, register whenever
        the kubelet socket is new to us, and back off while the kubelet refuses."""
        self._registered_to = None
        retry_s = _RETRY_FIRST_S
        while True:
            try:
                await self._reconcile()
            except KubeletError as e:
                self.last_error = str(e)
                self._log.warning("registration failed", error=str(e), retry_in_s=retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, _RETRY_MAX_S)
                continue
            retry_s = _RETRY_FIRST_S
            await asyncio.sleep(self._poll_s)

    async def _reconcile(self) -> None:
        """One pass of `_keep_registered`."""
        if not self.socket_path.exists():
            self._log.warning("plugin socket removed (kubelet restart?); serving again", socket=str(self.socket_path))
            self._registered_to = None
            await self._serve()
        kubelet = _socket_identity(self.kubelet_socket)
        if kubelet is None:
            if self.registered.is_set():
                self._log.warning("kubelet socket gone; waiting for the kubelet", socket=str(self.kubelet_socket))
                self.registered.clear()
            return
        if kubelet == self._registered_to:
            return
        if self._registered_to is not None:
            self._log.info("kubelet socket recreated; restarting the plugin")
            self.registered.clear()
            self._registered_to = None
            await self._serve()
        await self._register()
        self._registered_to = kubelet
        self.registrations += 1
        self.last_error = None
        self.registered.set()
        self._log.info("registered with the kubelet", endpoint=self.endpoint, registrations=self.registrations)

    async def _register(self) -> None:
        request = api.RegisterRequest(version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource_name,
                                      options=self.options())
        try:
            async with grpc.aio.insecure_channel(unix_target(self.kubelet_socket)) as channel:
                await api_grpc.RegistrationStub(channel).Register(request, timeout=_REGISTER_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise KubeletError(f"registering {self.resource_name} at {self.kubelet_socket} failed: "
                               f"{e.code().name}: {e.details()}; is the kubelet running, and is its root directory "
                               f"this --kubelet-root ({self.kubelet_socket.parent.parent})?") from e


class _DevicePluginService(api_grpc.DevicePluginServicer):
    """The gRPC face of a DevicePlugin: translates requests to its methods and its errors to status codes."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self._plugin = plugin

    async def GetDevicePluginOptions(self, request, context):
        return self._plugin.options()

    async def ListAndWatch(self, request, context):
        async for response in self._plugin.advertisements():
            yield response

    async def GetPreferredAllocation(self, request, context):
        return api.PreferredAllocationResponse(container_responses=[
            api.ContainerPreferredAllocationResponse(deviceIDs=self._plugin.preferred(
                r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size))
            for r in request.container_requests
        ])

    async def Allocate(self, request, context):
        try:
            answers = [self._plugin.allocate(r.devices_ids) for r in request.container_requests]
        except DeviceNotAdvertised as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return api.AllocateResponse(container_responses=answers)

    async def PreStartContainer(self, request, context):
        return api.PreStartContainerResponse()


def _socket_identity(path: Path) -> tuple[int, int, int] | None:
    """Which file sits at `path` now (device, inode, change time), None when none: a new kubelet socket differs
    even where the file system reuses the inode number."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns
