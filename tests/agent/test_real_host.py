"""This machine's real /proc and /sys, read by the agent's readers and checked against psutil and os."""
from __future__ import annotations

import os

import psutil

from agent.cpus import read_cpu_topology
from agent.discovery import Reserve, assemble
from agent.host import KernelHost
from common.inventory import GpuInventory, Driver
from common.hostfacts import read_meminfo


def test_online_cpus_match_psutil_and_os():
    cpus = read_cpu_topology()
    assert psutil.cpu_count(logical=True) == cpus.threads
    assert os.sched_getaffinity(0) <= set(cpus.online)
    assert 1 <= cpus.cores <= cpus.threads


def test_every_online_cpu_is_on_exactly_one_numa_node():
    cpus = read_cpu_topology()
    listed = [c for _, node_cpus in cpus.nodes for c in node_cpus]
    assert sorted(listed) == list(cpus.online)


def test_memory_total_matches_psutil():
    assert psutil.virtual_memory().total == read_meminfo().total_kib * 1024


def test_the_real_host_assembles_into_an_inventory_with_explicit_allocatable():
    facts = KernelHost().read()
    inv = assemble(GpuInventory(source="nvml", driver=Driver(status="not-found", message="no GPU driver found")), facts,
                   reserve=Reserve(vcpu_milli=500, memory_mib=1024))
    assert inv.cpus.onlineCount * 1000 - 500 == inv.cpus.allocatableVcpuMilli
    assert inv.memory.totalMiB - inv.memory.hugepagesMiB - 1024 == inv.memory.allocatableMiB
    assert inv.hugepages.pages1G.supported == os.path.isdir("/sys/kernel/mm/hugepages/hugepages-1048576kB")
    assert inv.share.perGpu is None
