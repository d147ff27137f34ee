"""CPUs, NUMA, memory and hugepages read from hand-made /proc and /sys trees of hosts this machine is not."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent import hugepages, mig_minors, numa
from agent.cpus import read_cpu_topology
from agent.host import KernelHost
from common.hostfacts import (
    SIZE_1G_KIB, SIZE_2M_KIB, HostReadError, NodeMemory, online_nodes, parse_cpulist, read_meminfo, read_node_memory,
)
from common.hostfacts import format_cpulist
from tests.agent.trees import two_node_host


@pytest.mark.parametrize("text, cpus", [
    ("", ()), ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-2,5,7-8", (0, 1, 2, 5, 7, 8)), ("3,1", (1, 3)), ("0-1\n", (0, 1)),
])
def test_cpulist_parses_the_kernel_format(text, cpus):
    assert cpus == parse_cpulist(text)


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "0,,x"])
def test_a_bad_cpulist_is_an_error_naming_the_file(text):
    with pytest.raises(HostReadError, match="cpu/online"):
        parse_cpulist(text, "/sys/devices/system/cpu/online")


@given(st.sets(st.integers(min_value=0, max_value=600)))
def test_cpulist_format_and_parse_round_trip(cpus):
    assert tuple(sorted(cpus)) == parse_cpulist(format_cpulist(cpus))


def test_two_numa_nodes_with_offline_cpus(tree):
    two_node_host(tree)
    cpus = read_cpu_topology(str(tree.sys))
    assert (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14) == cpus.online
    assert (6, 7, 15) == cpus.offline
    assert 13 == cpus.threads
    assert 7 == cpus.cores  # core 7 lost both threads; core 6 keeps CPU 14
    assert ((0, (0, 1, 2, 3, 8, 9, 10, 11)), (1, (4, 5, 12, 13, 14))) == cpus.nodes


def test_hugepages_on_one_node_only(tree):
    two_node_host(tree)
    pool = hugepages.read_pool(SIZE_1G_KIB, (0, 1), str(tree.sys))
    assert (True, 4, 3) == (pool.supported, pool.total, pool.free)
    assert (hugepages.NodePool(0, 0, 0), hugepages.NodePool(1, 4, 3)) == pool.nodes
    small = hugepages.read_pool(SIZE_2M_KIB, (0, 1), str(tree.sys))
    assert (512, (512, 0)) == (small.total, tuple(n.total for n in small.nodes))


def test_a_kernel_without_1g_pages_says_unsupported(tree):
    tree.hugepages(2048, {0: (8, 8)})
    assert not hugepages.has_hugetlb_1g(str(tree.sys))
    assert hugepages.HugepagePool(size_kib=1048576, supported=False) == hugepages.read_pool(1048576, (0,), str(tree.sys))


def test_memory_total_hugepages_and_per_node(tree):
    two_node_host(tree)
    info = read_meminfo(str(tree.proc))
    assert (64 * 1024 * 1024, 4 * 1048576 + 512 * 2048) == (info.total_kib, info.hugetlb_kib)
    assert 32 * 1024 * 1024 == read_node_memory(1, str(tree.sys)).total_kib
    assert read_node_memory(5, str(tree.sys)) is None


def test_meminfo_without_a_hugetlb_line_counts_the_default_size(tree):
    tree.write("proc/meminfo", "MemTotal: 1000 kB\nHugePages_Total: 3\nHugepagesize: 2048 kB\n")
    assert 3 * 2048 == read_meminfo(str(tree.proc)).hugetlb_kib


def test_a_missing_required_file_is_an_error_with_its_path(tree):
    with pytest.raises(HostReadError, match="proc/meminfo"):
        read_meminfo(str(tree.proc))
    with pytest.raises(HostReadError, match="cpu/online"):
        read_cpu_topology(str(tree.sys))


def test_a_kernel_without_numa_is_one_node_with_every_cpu(tree):
    tree.cpus([0, 1, 2, 3])
    assert ((0, (0, 1, 2, 3)),) == read_cpu_topology(str(tree.sys)).nodes
    assert () == online_nodes(str(tree.sys))


@pytest.mark.parametrize("nvml_id, sysfs_id", [
    ("00000000:3B:00.0", "0000:3b:00.0"), ("0000:3b:00.0", "0000:3b:00.0"), ("00000001:C1:1F.7", "0001:c1:1f.7"),
])
def test_nvml_bus_ids_map_to_sysfs_names(nvml_id, sysfs_id):
    assert sysfs_id == numa.sysfs_bus_id(nvml_id)


def test_pci_numa_node_from_sysfs(tree):
    tree.pci_numa("0000:3b:00.0", 1).pci_numa("0000:5e:00.0", -1)
    assert 1 == numa.numa_node_of("00000000:3B:00.0", str(tree.sys))
    assert numa.numa_node_of("00000000:5E:00.0", str(tree.sys)) is None  # the platform reports no affinity
    assert numa.numa_node_of("00000000:99:00.0", str(tree.sys)) is None  # no such device


def test_mig_minors_are_read_from_the_driver_table(tree):
    tree.mig_minors("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu3/gi7/access 600\n")
    table = mig_minors.read_mig_minors(str(tree.proc))
    assert (1, 2, 12, 13, 600, None) == (table.config, table.monitor, table.gi(0, 1), table.ci(0, 1, 0),
                                         table.gi(3, 7), table.ci(3, 7, 0))


def test_the_rendered_table_matches_the_drivers_layout():
    table = mig_minors.parse(mig_minors.render([0, 1]))
    assert (12, 13, 3 + 135 + 9 * 7, 3 + 135 + 9 * 7 + 1) == (table.gi(0, 1), table.ci(0, 1, 0), table.gi(1, 7),
                                                               table.ci(1, 7, 0))


def test_no_mig_minors_file_is_an_empty_table(tree):
    assert not mig_minors.read_mig_minors(str(tree.proc)).present


def test_a_malformed_mig_minors_line_names_the_file_and_line(tree):
    tree.mig_minors("config 1\ngpu0/gi1/access twelve\n")
    with pytest.raises(HostReadError, match="mig-minors: line 2"):
        mig_minors.read_mig_minors(str(tree.proc))


def test_kernel_host_reads_identity_and_all_sections(tree):
    two_node_host(tree)
    facts = KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)).read()
    assert ("gpu-host-7", "6f1c2e0a-0000-4000-8000-000000000007") == (facts.hostname, facts.boot_id)
    assert (2, 4, 512) == (len(facts.node_memory), facts.pages_1g.total, facts.pages_2m.total)


@pytest.mark.parametrize("boot_id", ["x" * 100, "6f1c2e0a-0000-4000-8000-00000000000", "not a boot id"])
def test_a_boot_id_that_is_not_one_is_an_error_naming_the_file(tree, boot_id):
    two_node_host(tree).identity(boot_id=boot_id)
    with pytest.raises(HostReadError, match="random/boot_id: not a boot id"):
        KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)).read()


@pytest.mark.parametrize("rel", ["sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages",
                                 "sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages",
                                 "sys/devices/system/node/node1/hugepages/hugepages-1048576kB/nr_hugepages"])
def test_a_negative_hugepage_count_is_an_error_naming_the_file(tree, rel):
    two_node_host(tree).write(rel, "-5")
    with pytest.raises(HostReadError, match=f"{rel}: -5 pages"):
        KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)).read()


def test_a_kernel_without_numa_reports_node_0_with_the_whole_memory(tree):
    tree.cpus([0, 1, 2, 3]).meminfo(16 * 1024 * 1024).identity()
    facts = KernelHost(sys_root=str(tree.sys), proc_root=str(tree.proc)).read()
    assert ((0, (0, 1, 2, 3)),) == facts.cpus.nodes
    assert (NodeMemory(0, 16 * 1024 * 1024),) == facts.node_memory
