"""Hand-made /proc and /sys trees, laid out like the kernel's, for hosts this machine is not."""
from __future__ import annotations

from pathlib import Path

from common.hostfacts import format_cpulist


class HostTree:
    """A root with proc/ and sys/ below it; each method writes the kernel files for one fact."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = root / "proc"
        self.sys = root / "sys"

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")
        return path

    def cpus(self, online: list[int], offline: list[int] = (), siblings: dict[int, list[int]] | None = None):
        """CPU online/offline lists and, for each online CPU, its thread siblings (default: itself)."""
        base = "sys/devices/system/cpu"
        self.write(f"{base}/online", format_cpulist(online))
        self.write(f"{base}/offline", format_cpulist(offline))
        for cpu in online:
            sib = (siblings or {}).get(cpu, [cpu])
            self.write(f"{base}/cpu{cpu}/topology/thread_siblings_list", format_cpulist(sib))
        return self

    def numa(self, nodes: dict[int, list[int]], memory_kib: dict[int, int] | None = None):
        base = "sys/devices/system/node"
        self.write(f"{base}/online", format_cpulist(nodes))
        for node, cpus in nodes.items():
            self.write(f"{base}/node{node}/cpulist", format_cpulist(cpus))
            if memory_kib and node in memory_kib:
                self.write(f"{base}/node{node}/meminfo",
                           f"Node {node} MemTotal:       {memory_kib[node]} kB\n"
                           f"Node {node} MemFree:        {memory_kib[node] // 2} kB\n"
                           f"Node {node} HugePages_Total:     0\n")
        return self

    def meminfo(self, total_kib: int, hugetlb_kib: int | None = 0):
        lines = [f"MemTotal:       {total_kib} kB", f"MemFree:        {total_kib // 2} kB",
                 "HugePages_Total:       0", "Hugepagesize:       2048 kB"]
        if hugetlb_kib is not None:
            lines.append(f"Hugetlb:        {hugetlb_kib} kB")
        self.write("proc/meminfo", "\n".join(lines))
        return self

    def hugepages(self, size_kib: int, per_node: dict[int, tuple[int, int]] | None, total: tuple[int, int] | None = None):
        """A pool: per-node (total, free) counters, and the host-wide ones (default: their sums)."""
        per_node = per_node or {}
        t, f = total or (sum(v[0] for v in per_node.values()), sum(v[1] for v in per_node.values()))
        base = f"sys/kernel/mm/hugepages/hugepages-{size_kib}kB"
        self.write(f"{base}/nr_hugepages", str(t))
        self.write(f"{base}/free_hugepages", str(f))
        self.write(f"{base}/resv_hugepages", "0")
        for node, (nt, nf) in per_node.items():
            nbase = f"sys/devices/system/node/node{node}/hugepages/hugepages-{size_kib}kB"
            self.write(f"{nbase}/nr_hugepages", str(nt))
            self.write(f"{nbase}/free_hugepages", str(nf))
        return self

    def pci_numa(self, sysfs_bus_id: str, node: int):
        self.write(f"sys/bus/pci/devices/{sysfs_bus_id}/numa_node", str(node))
        return self

    def mig_minors(self, text: str):
        self.write("proc/driver/nvidia-caps/mig-minors", text)
        return self

    def identity(self, hostname: str = "gpu-host-7", boot_id: str = "6f1c2e0a-0000-4000-8000-000000000007"):
        self.write("proc/sys/kernel/hostname", hostname)
        self.write("proc/sys/kernel/random/boot_id", boot_id)
        return self


def two_node_host(tree: HostTree) -> HostTree:
    """16 CPUs (8 cores x 2 threads: core c is CPUs c and c+8) on 2 NUMA nodes, CPUs 6, 7 and 15 offline
    (core 7 gone, core 6 keeps CPU 14), 64 GiB, 1 GiB pages on node 1 only (4, 3 free), 512 x 2 MiB on node 0."""
    offline = [6, 7, 15]
    online = [c for c in range(16) if c not in offline]
    siblings = {c: [c % 8, c % 8 + 8] for c in online}
    node0, node1 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    huge_kib = 4 * 1048576 + 512 * 2048
    return (tree.cpus(online, offline, siblings)
            .numa({0: node0, 1: node1}, memory_kib={0: 32 * 1024 * 1024, 1: 32 * 1024 * 1024})
            .meminfo(64 * 1024 * 1024, hugetlb_kib=huge_kib)
            .hugepages(1048576, {0: (0, 0), 1: (4, 3)})
            .hugepages(2048, {0: (512, 512), 1: (0, 0)})
            .identity())
