"""Fixtures for agent/: the stand-in NVML library (built once with gcc), its topology file, and hand-made
/proc and /sys trees for hosts this machine is not."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.agent import fake_nvml
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
