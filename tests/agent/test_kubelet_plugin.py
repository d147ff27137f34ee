"""agent.kubelet.plugin against the stub kubelet (tests/agent/kubelet_stub.py): registration, the advertised list on
ListAndWatch, Allocate, GetPreferredAllocation, kubelet restarts and stop. All sockets live under kubelet_root."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.kubelet.plugin import (
    API_VERSION,
    HEALTHY,
    UNHEALTHY,
    DevicePlugin,
    KubeletError,
    PluginDevice,
    default_endpoint,
    preferred_allocation,
)
from tests.agent.kubelet_stub import Advertised, StubKubelet

RESOURCE = "berth.dev/h100"
COMMON_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def gpu(minor: int, numa: int | None, healthy: bool = True) -> PluginDevice:
    uuid = f"GPU-{minor:08x}-0000-0000-0000-000000000000"
    return PluginDevice(id=uuid, healthy=healthy, numa_node=numa, device_nodes=(f"/dev/nvidia{minor}", *COMMON_NODES),
                        visible_id=uuid)


def mig(minor: int, gi_cap: int, ci_cap: int, numa: int) -> PluginDevice:
    uuid = f"MIG-{minor:02x}{gi_cap:02x}{ci_cap:02x}00-0000-0000-0000-000000000000"
    return PluginDevice(id=uuid, healthy=True, numa_node=numa,
                        device_nodes=(f"/dev/nvidia{minor}", *COMMON_NODES, f"/dev/nvidia-caps/nvidia-cap{gi_cap}",
                                      f"/dev/nvidia-caps/nvidia-cap{ci_cap}"),
                        visible_id=uuid)


def shown(*devices: PluginDevice) -> tuple[Advertised, ...]:
    """What the kubelet should see for these devices."""
    return tuple(Advertised(d.id, HEALTHY if d.healthy else UNHEALTHY,
                            () if d.numa_node is None else (d.numa_node,)) for d in devices)


GPUS = [gpu(0, 0), gpu(1, 0), gpu(2, 1), gpu(3, 1)]


@pytest.fixture
async def plugin(kubelet_root, kubelet):
    plugin = DevicePlugin(RESOURCE, kubelet_root, poll_s=0.05)
    await plugin.start()
    yield plugin
    await plugin.stop()


# -- registration


async def test_registration_names_the_version_the_endpoint_and_the_resource(plugin, kubelet):
    connection = await kubelet.wait_registered(RESOURCE)
    request = connection.request
    assert (API_VERSION, "berth-h100.sock", RESOURCE) == (request.version, request.endpoint, request.resource_name)
    assert (False, True) == (connection.options.pre_start_required,
                             connection.options.get_preferred_allocation_available)
    assert 1 == plugin.registrations
    assert plugin.registered.is_set()


async def test_a_plugin_started_before_the_kubelet_registers_once_the_kubelet_is_up(kubelet_root):
    plugin = DevicePlugin(RESOURCE, kubelet_root, poll_s=0.05)
    plugin.socket_path.parent.mkdir(parents=True)
    plugin.socket_path.write_text("stale")  # what a crashed earlier run leaves behind
    await plugin.start()
    try:
        assert not plugin.registered.is_set()
        async with StubKubelet(kubelet_root) as kubelet:  # it wipes the directory, our socket with it
            await kubelet.wait_registered(RESOURCE)
            assert 1 == plugin.registrations
    finally:
        await plugin.stop()


async def test_a_kubelet_root_that_cannot_hold_the_socket_is_a_kubelet_error_naming_the_option(kubelet_root):
    """A KubeletError fails that resource's bookings (BindFailed); an OSError stopped the whole agent."""
    (kubelet_root / "device-plugins").write_text("not a directory")
    plugin = DevicePlugin(RESOURCE, kubelet_root, poll_s=0.05)
    with pytest.raises(KubeletError, match="--kubelet-root"):
        await plugin.start()
    await plugin.stop()


async def test_a_refused_registration_is_retried_and_its_error_kept(kubelet_root, kubelet):
    kubelet.refusals = [grpc.StatusCode.UNAVAILABLE]
    async with DevicePlugin(RESOURCE, kubelet_root, poll_s=0.05) as plugin:
        await kubelet.wait_registered(RESOURCE)
        assert [] == kubelet.refusals
        assert 1 == plugin.registrations
        assert plugin.last_error is None
    assert 1 == len(kubelet.registrations)


async def test_the_last_registration_error_says_what_failed(kubelet_root, kubelet):
    kubelet.refusals = [grpc.StatusCode.PERMISSION_DENIED] * 50
    async with DevicePlugin(RESOURCE, kubelet_root, poll_s=0.05) as plugin:
        await kubelet.wait_refused(2)  # the second attempt comes only after the first failure was recorded
        assert "PERMISSION_DENIED" in plugin.last_error
        assert str(kubelet.registration_socket) in plugin.last_error
        assert not plugin.registered.is_set()


# -- what is advertised


async def test_devices_appear_on_the_stream_only_after_set_devices(plugin, kubelet):
    connection = await kubelet.wait_registered(RESOURCE)
    assert [()] == connection.lists
    plugin.set_devices(GPUS)
    await kubelet.wait_devices(RESOURCE, shown(*GPUS))
    assert [(), shown(*GPUS)] == connection.lists


async def test_a_health_change_shows_on_the_stream_within_a_second(plugin, kubelet):
    await kubelet.wait_registered(RESOURCE)
    plugin.set_devices(GPUS)
    await kubelet.wait_devices(RESOURCE, shown(*GPUS))
    changed = [gpu(0, 0, healthy=False), *GPUS[1:]]
    plugin.set_devices(changed)
    await kubelet.wait_devices(RESOURCE, shown(*changed), timeout_s=1.0)
    assert UNHEALTHY == kubelet.devices(RESOURCE)[0].health


async def test_an_empty_set_withdraws_every_device(plugin, kubelet):
    await kubelet.wait_registered(RESOURCE)
    plugin.set_devices(GPUS)
    await kubelet.wait_devices(RESOURCE, shown(*GPUS))
    plugin.set_devices([])
    await kubelet.wait_devices(RESOURCE, ())


async def test_setting_the_same_devices_again_sends_nothing(plugin, kubelet):
    connection = await kubelet.wait_registered(RESOURCE)
    plugin.set_devices(GPUS)
    await kubelet.wait_devices(RESOURCE, shown(*GPUS))
    plugin.set_devices(list(GPUS))
    plugin.set_devices([GPUS[0]])
    await kubelet.wait_devices(RESOURCE, shown(GPUS[0]))
    assert [(), shown(*GPUS), shown(GPUS[0])] == connection.lists


def test_a_device_id_given_twice_is_refused(kubelet_root):
    plugin = DevicePlugin(RESOURCE, kubelet_root)
    with pytest.raises(ValueError, match=GPUS[0].id):
        plugin.set_devices([GPUS[0], GPUS[0]])


# -- Allocate


async def test_allocate_gives_each_device_node_once_and_the_visible_ids(plugin, kubelet):
    await kubelet.wait_registered(RESOURCE)
    plugin.set_devices(GPUS)
    await kubelet.wait_devices(RESOURCE, shown(*GPUS))
    answer = await kubelet.allocate(RESOURCE, [GPUS[2].id, GPUS[0].id])
    expected_nodes = ["/dev/nvidia2", *COMMON_NODES, "/dev/nvidia0"]
    assert [(n, n, "rw") for n in expected_nodes] == [(d.host_path, d.container_path, d.permissions)
                                                     for d in answer.devices]
    assert {"NVIDIA_VISIBLE_DEVICES": f"{GPUS[2].id},{GPUS[0].id}"} == dict(answer.envs)


async def test_allocate_of_a_mig_device_adds_its_cap_nodes(kubelet_root, kubelet):
    device = mig(minor=0, gi_cap=12, ci_cap=13, numa=0)
    async with DevicePlugin("berth.dev/mig-1g.10gb", kubelet_root, poll_s=0.05) as plugin:
        plugin.set_devices([device])
        await kubelet.wait_registered("berth.dev/mig-1g.10gb")
        answer = await kubelet.allocate("berth.dev/mig-1g.10gb", [device.id])
    assert list(device.device_nodes) == [d.host_path for d in answer.devices]
    assert "/dev/nvidia-caps/nvidia-cap13" == answer.devices[-1].container_path
    assert {"NVIDIA_VISIBLE_DEVICES": device.id} == dict(answer.envs)


@pytest.mark.parametrize("advertised_before", [False, True], ids=["never advertised", "withdrawn"])
async def test_allocate_of_a_device_not_advertised_is_refused(plugin, kubelet, advertised_before):
    await kubelet.wait_registered(RESOURCE)
    plugin.set_devices(GPUS if advertised_before else GPUS[:3])
    plugin.set_devices(GPUS[:3])
    await kubelet.wait_devices(RESOURCE, shown(*GPUS[:3]))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await kubelet.allocate(RESOURCE, [GPUS[0].id, GPUS[3].id])
    assert grpc.StatusCode.FAILED_PRECONDITION == refused.value.code()
    assert GPUS[3].id in refused.value.details()
    assert GPUS[0].id not in refused.value.details()


# -- GetPreferredAllocation


async def test_preferred_allocation_keeps_one_numa_node(plugin, kubelet):
    devices = [gpu(0, 0), gpu(1, 1), gpu(2, 0), gpu(3, 1), gpu(4, 1)]
    plugin.set_devices(devices)
    await kubelet.wait_registered(RESOURCE)
    ids = [d.id for d in devices]
    assert [ids[0], ids[2]] == await kubelet.preferred(RESOURCE, ids, [], 2)
    assert [ids[4], ids[1], ids[3]] == await kubelet.preferred(RESOURCE, ids, [ids[4]], 3)


async def test_preferred_allocation_picks_only_advertised_devices(plugin, kubelet):
    plugin.set_devices(GPUS[:3])
    await kubelet.wait_registered(RESOURCE)
    ids = [d.id for d in GPUS]
    assert [ids[2]] == await kubelet.preferred(RESOURCE, [ids[3], ids[2]], [], 1)
    # a must-include id that is not advertised (withdrawn: released) is not chosen either
    assert [ids[2]] == await kubelet.preferred(RESOURCE, [ids[3], ids[2]], [ids[3]], 1)


NUMA = {"a0": 0, "b0": 0, "c1": 1, "d1": 1, "e1": 1, "f2": 2, "x": None}


@pytest.mark.parametrize("available, must, size, expected", [
    (["a0", "c1", "b0", "d1", "e1"], [], 2, ["a0", "b0"]),                  # the tightest node that fits
    (["a0", "c1", "b0", "d1", "e1"], [], 3, ["c1", "d1", "e1"]),            # the only node that fits
    (["a0", "c1", "b0", "d1", "e1"], ["c1"], 2, ["c1", "d1"]),              # stays on the must-include's node
    (["a0", "b0", "c1", "d1", "e1"], ["a0"], 3, ["a0", "b0", "c1"]),        # its node first, then one more node
    (["a0", "b0", "c1", "d1", "e1", "f2"], [], 4, ["c1", "d1", "e1", "f2"]),  # fullest node, then the tightest
    (["a0", "c1", "f2"], ["f2", "a0"], 2, ["f2", "a0"]),                    # the must-include set is the answer
    (["x", "a0"], [], 1, ["a0"]),                                           # a known node before an unknown one
])
def test_preferred_allocation_uses_the_fewest_numa_nodes(available, must, size, expected):
    assert expected == preferred_allocation(available, must, size, NUMA)


def test_preferred_allocation_without_numa_takes_the_available_order():
    assert ["c1", "a0", "d1"] == preferred_allocation(["a0", "d1", "b0"], ["c1"], 3, NUMA, by_numa=False)


# -- kubelet restart and stop


@pytest.mark.parametrize("wipe", [True, False], ids=["directory wiped", "only kubelet.sock new"])
async def test_a_kubelet_restart_makes_the_plugin_register_again_and_the_stream_resume(plugin, kubelet, wipe):
    await kubelet.wait_registered(RESOURCE)
    plugin.set_devices(GPUS)
    await kubelet.wait_devices(RESOURCE, shown(*GPUS))
    await kubelet.restart(wipe=wipe)
    connection = await kubelet.wait_registered(RESOURCE, count=2)
    assert [shown(*GPUS)] == connection.lists
    assert 2 == plugin.registrations
    plugin.set_devices(GPUS[:1])
    await kubelet.wait_devices(RESOURCE, shown(GPUS[0]))
    answer = await kubelet.allocate(RESOURCE, [GPUS[0].id])
    assert {"NVIDIA_VISIBLE_DEVICES": GPUS[0].id} == dict(answer.envs)


async def test_stop_removes_the_plugin_socket_and_ends_the_stream(kubelet_root, kubelet):
    plugin = DevicePlugin(RESOURCE, kubelet_root, poll_s=0.05)
    await plugin.start()
    await kubelet.wait_registered(RESOURCE)
    assert plugin.socket_path.is_socket()
    await plugin.stop()
    assert not plugin.socket_path.exists()
    await kubelet.wait_stream_ended(RESOURCE)
    assert not plugin.registered.is_set()


async def test_restart_serves_a_new_socket_and_registers_again(plugin, kubelet):
    await kubelet.wait_registered(RESOURCE)
    await plugin.restart()
    await kubelet.wait_registered(RESOURCE, count=2)
    for _ in range(100):  # the kubelet has the call before the plugin has its answer and counts it
        if plugin.registrations == 2:
            break
        await asyncio.sleep(0.05)
    assert 2 == plugin.registrations
    assert plugin.socket_path.is_socket()


# -- names and paths


@pytest.mark.parametrize("resource, endpoint", [
    ("berth.dev/h100", "berth-h100.sock"),
    ("nvidia.com/gpu", "nvidia-gpu.sock"),
    ("berth.dev/mig-1g.10gb", "berth-mig-1g.10gb.sock"),
])
def test_the_default_endpoint_is_the_domain_label_and_the_name(resource, endpoint):
    assert endpoint == default_endpoint(resource)


def test_a_resource_name_without_a_domain_is_refused(kubelet_root):
    with pytest.raises(KubeletError, match="no domain"):
        DevicePlugin("h100", kubelet_root)


def test_a_kubelet_root_too_long_for_a_unix_socket_is_refused(kubelet_root):
    with pytest.raises(KubeletError, match="shorter --kubelet-root"):
        DevicePlugin(RESOURCE, kubelet_root / ("x" * 120))
