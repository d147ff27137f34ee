"""The inventory as a readable table for a terminal (`berth agent discover` without --json)."""
from __future__ import annotations

from common.inventory import Gpu, HugepagePool, Inventory


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _mig(g: Gpu) -> str:
    if g.migMode is None:
        return "n/a"
    text = "on" if g.migMode.current else "off"
    if g.migMode.pending != g.migMode.current:
        text += f" (pending {'on' if g.migMode.pending else 'off'})"
    return text


def _health(h) -> str:
    return "ok" if h.healthy else f"UNHEALTHY: {h.reason}"


def _pool(name: str, p: HugepagePool) -> str:
    if not p.supported:
        return f"  {name}: not supported by this kernel"
    nodes = ", ".join(f"node {n.node} {n.free}/{n.total}" for n in p.numaNodes)
    return f"  {name}: {p.free} free of {p.total}" + (f"  ({nodes})" if nodes else "")


def render(inv: Inventory) -> str:
    out: list[str] = []
    d = inv.driver
    driver = (f"driver {d.version}" + (f", CUDA {d.cudaVersion}" if d.cudaVersion else "")) if d.status == "ok" \
        else d.message
    out.append(f"Host {inv.hostname}  (source: {inv.source}; {driver})")
    out.append("")
    if inv.gpus:
        out.append(f"GPUs: {len(inv.gpus)}, {inv.share.bookableGpus} bookable as whole GPUs")
        rows = [["IDX", "CLASS", "NAME", "UUID", "MINOR/CAPS", "PCI", "MEMORY", "NUMA", "MIG", "HEALTH"]]
        for g in inv.gpus:
            rows.append([str(g.index), g.deviceClass, g.name, g.uuid, str(g.minor), g.pciBusId, f"{g.memoryMiB} MiB",
                         "-" if g.numaNode is None else str(g.numaNode), _mig(g), _health(g.health)])
            for m in g.migDevices:
                caps = "-" if m.capMinors.gi is None else f"caps {m.capMinors.gi},{m.capMinors.ci}"
                rows.append(["", f"  MIG {m.profile or '?'}", f"gi {m.gpuInstanceId} ci {m.computeInstanceId} "
                             f"slot {m.index}", m.uuid, caps, "", f"{m.memoryMiB} MiB", "", "", _health(m.health)])
        out.extend(_table(rows))
    elif d.status == "ok":
        out.append("GPUs: none")
    else:
        out.append(f"GPUs: none ({d.message})")
    for lost in inv.lostGpus:
        out.append(f"  GPU {lost.index} unreadable: {lost.error}")
    c = inv.cpus
    out.append("")
    out.append(f"CPUs: {c.onlineCount} online ({c.online}), {c.cores} cores" +
               (f", offline {c.offline}" if c.offline else ""))
    for n in c.numaNodes:
        out.append(f"  NUMA node {n.node}: {n.count} CPUs ({n.cpus})")
    out.append(f"  reserved {c.reservedVcpuMilli / 1000:g} vcpu, allocatable {c.allocatableVcpu:g} vcpu")
    m = inv.memory
    out.append(f"Memory: {_gib(m.totalMiB)} total, {_gib(m.hugepagesMiB)} in hugepages, "
               f"{_gib(m.reservedMiB)} reserved, {_gib(m.allocatableMiB)} allocatable")
    for n in m.numaNodes:
        out.append(f"  NUMA node {n.node}: {_gib(n.totalMiB)} ({_gib(n.hugepagesMiB)} in hugepages)")
    out.append("Hugepages:")
    out.append(_pool("1 GiB", inv.hugepages.pages1G))
    out.append(_pool("2 MiB", inv.hugepages.pages2M))
    s = inv.share
    if s.perGpu:
        out.append(f"Per-GPU share: {s.perGpu.vcpu:g} vcpu, {s.perGpu.memoryGiB:.2f} GiB "
                   f"(over {s.bookableGpus} bookable GPUs)")
    elif s.bookableGpus:  # GPUs, but the reserve left no CPU or memory to go with them
        out.append(f"Per-GPU share: none: the reserve leaves no CPU or memory to share over {s.bookableGpus} "
                   "bookable GPUs (lower --reserve-vcpu or --reserve-memory-gib)")
    else:
        out.append("Per-GPU share: none (no bookable GPU)")
    return "\n".join(out) + "\n"
