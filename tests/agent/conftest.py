"""Fixtures for agent/: the stand-in NVML library (built once with gcc), its topology file, and hand-made
/proc and /sys trees for hosts this machine is not."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.agent import fake_nvml
from tests.agent.kubelet_stub import StubKubelet
from tests.agent.trees import HostTree


@pytest.fixture(scope="session")
def standin_library(tmp_path_factory) -> Path:
    """libnvidia-ml.so.1 built from tests/agent/fake_nvml/fake_nvml.c; skipped where gcc is missing."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the stand-in NVML library cannot be built")
    return fake_nvml.build(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def standin(standin_library, tmp_path, monkeypatch):
    """Write a topology for the stand-in: `standin(topology_dict, mode=..., events=[...])` -> the file path."""
    path = tmp_path / "fake-nvml-topology.txt"
    monkeypatch.setenv(fake_nvml.TOPOLOGY_ENV, str(path))

    def write(topology: dict, **kwargs) -> Path:
        return fake_nvml.write(path, topology, **kwargs)

    return write


@pytest.fixture
def tree(tmp_path) -> HostTree:
    return HostTree(tmp_path / "host")


@pytest.fixture
def host(tmp_path):
    """The binder's view of a simulated 4 x H100 host, with a /proc/devices that names nvidia-uvm."""
    from agent.bindspec import HostView
    from agent.discovery import Discovery
    from agent.simulate import SimulatedGpus, SimulatedHost

    top = tmp_path / "top.json"
    top.write_text(json.dumps({"hostname": "b", "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559,
                                                          "count": 4}]}))
    gpus = SimulatedGpus(top)
    inv = Discovery(gpus=gpus, host=SimulatedHost(gpus)).discover()
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text("Character devices:\n  1 mem\n236 nvidia-uvm\n\nBlock devices:\n")
    return HostView(inventory=inv, enforced=frozenset(), devices_proc=tmp_path / "proc")


@pytest.fixture
def kubelet_root() -> Iterator[Path]:
    """A kubelet's root directory short enough for its sockets: pytest's tmp_path under a worker of pytest-xdist
    and a long test name gave a plugin socket past the 107 bytes of a unix socket's path."""
    root = Path(tempfile.mkdtemp(prefix="bk-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def kubelet(kubelet_root):
    """A kubelet that speaks the device plugin and pod resources APIs on unix sockets below kubelet_root."""
    async with StubKubelet(kubelet_root) as stub:
        yield stub
