"""agent.kubelet.podresources against the stub kubelet's PodResources List, and its errors when no kubelet answers."""
from __future__ import annotations

import socket

import pytest

from agent.kubelet.plugin import DevicePlugin, PluginDevice
from agent.kubelet.podresources import PodDevices, PodResourcesError, list_pod_devices, pod_resources_socket

H100 = "berth.dev/h100"
MIG = "berth.dev/mig-1g.10gb"


async def test_list_shows_which_pod_and_container_holds_which_devices(kubelet_root, kubelet):
    kubelet.hold("team-a", "train-0", "trainer", H100, ["GPU-1", "GPU-2"])
    kubelet.hold("team-a", "train-0", "sidecar", MIG, ["MIG-9"])
    kubelet.hold("team-b", "infer", "server", H100, ["GPU-3"])
    expected = [
        PodDevices("team-a", "train-0", "trainer", H100, ("GPU-1", "GPU-2")),
        PodDevices("team-a", "train-0", "sidecar", MIG, ("MIG-9",)),
        PodDevices("team-b", "infer", "server", H100, ("GPU-3",)),
    ]
    assert expected == await list_pod_devices(kubelet_root)


async def test_list_of_one_resource_leaves_the_others_out(kubelet_root, kubelet):
    kubelet.hold("team-a", "train-0", "trainer", H100, ["GPU-1"])
    kubelet.hold("team-a", "train-0", "sidecar", MIG, ["MIG-9"])
    assert [PodDevices("team-a", "train-0", "sidecar", MIG, ("MIG-9",))] == await list_pod_devices(kubelet_root, MIG)


async def test_a_freed_pod_and_a_container_without_devices_are_not_listed(kubelet_root, kubelet):
    kubelet.hold("team-a", "done", "trainer", H100, ["GPU-1"])
    kubelet.hold("team-a", "cpu-only", "main", H100, [])
    kubelet.free("team-a", "done")
    assert [] == await list_pod_devices(kubelet_root)


async def test_devices_the_plugin_allocated_show_once_a_pod_holds_them(kubelet_root, kubelet):
    device = PluginDevice("GPU-1", True, 0, ("/dev/nvidia0", "/dev/nvidiactl"), "GPU-1")
    async with DevicePlugin(H100, kubelet_root, poll_s=0.05) as plugin:
        plugin.set_devices([device])
        await kubelet.wait_registered(H100)
        await kubelet.allocate(H100, ["GPU-1"])
        kubelet.hold("team-a", "train-0", "trainer", H100, ["GPU-1"])
        assert [PodDevices("team-a", "train-0", "trainer", H100, ("GPU-1",))] == await list_pod_devices(kubelet_root, H100)


async def test_a_missing_socket_says_the_kubelet_is_not_running_or_the_root_is_wrong(kubelet_root):
    with pytest.raises(PodResourcesError) as error:
        await list_pod_devices(kubelet_root / "not-the-kubelet-root")
    assert "the kubelet is not running, or its root is not --kubelet-root" in str(error.value)
    assert str(pod_resources_socket(kubelet_root / "not-the-kubelet-root")) in str(error.value)


async def test_a_socket_nobody_serves_says_to_check_the_kubelet(kubelet_root):
    path = pod_resources_socket(kubelet_root)
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: what a crashed kubelet leaves behind
        with pytest.raises(PodResourcesError) as error:
            await list_pod_devices(kubelet_root, timeout_s=2)
    assert "UNAVAILABLE" in str(error.value)
    assert "is the kubelet running" in str(error.value)
