"""Simulated hosts: a topology JSON file stands in for NVML (and, where it says so, for the host's CPUs, memory
and hugepages), so a laptop or CI machine can act as an 8-GPU host.

One schema (`Topology`, validated strictly: a bad field is a TopologyError
naming it), one expansion into concrete devices (`expand`, also used to
write the C stand-in NVML's topology in the tests), and two sources:
`SimulatedGpus` (a GpuSource) and `SimulatedHost` (a HostSource). The file
is read again on every discovery, so editing it is how a simulated GPU
falls off the bus. docs/inventory.md describes the format.
"""
from __future__ import annotations

import dataclasses
import os
import re
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from agent import mig_minors
from agent.cpus import CpuTopology
from agent.errors import TopologyError
from agent.host import HostFacts, HostSource, KernelHost
from agent.hugepages import HugepagePool, NodePool
from common.inventory import (
    HOSTNAME_RULE, MAX_GPUS, CapMinors, Driver, Gpu, GpuInventory, LostGpu, MigDevice, MigMode, MigPlacement,
    first_duplicate, is_hostname,
)
from common.hostfacts import SIZE_1G_KIB, SIZE_2M_KIB, Meminfo, NodeMemory, parse_cpulist

MAX_MIG_SLOTS = 7
_PROFILE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(?:\+[a-z]+)?$")
# GPUs NVML reports as MIG-capable, by model token in the name.
_MIG_MODELS = re.compile(r"(?<![A-Z0-9])(A100|A30|A800|H100|H800|H200|H20|GH200|B200|B100|GB200)(?![A-Z0-9])")

Name = Annotated[str, Meta(min_length=1, max_length=95)]
NodeId = Annotated[int, Meta(ge=0, le=63)]


class _Spec(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class DriverSpec(_Spec):
    version: Name = "550.54.15"
    cuda: Annotated[int, Meta(ge=1000, le=99990)] = 12040  # NVML's form: 1000 * major + 10 * minor


class MigSpec(_Spec):
    profile: Annotated[str, Meta(pattern=_PROFILE.pattern)]
    count: Annotated[int, Meta(ge=1, le=MAX_MIG_SLOTS)] = 1
    memoryMiB: Annotated[int, Meta(gt=0)] | None = None


class GpuSpec(_Spec):
    name: Name
    memoryMiB: Annotated[int, Meta(gt=0, le=16 * 1024 * 1024)]
    count: Annotated[int, Meta(ge=1, le=64)] = 1
    numaNodes: list[NodeId] | None = None
    migCapable: bool | None = None
    mig: MigSpec | list[MigSpec] | None = None
    migPending: bool | None = None
    migSlots: list[Annotated[int, Meta(ge=0, lt=MAX_MIG_SLOTS)]] | None = None


class HostSpec(_Spec):
    cpus: Annotated[int, Meta(ge=1, le=8192)] | None = None
    threadsPerCore: Annotated[int, Meta(ge=1, le=8)] | None = None
    offlineCpus: str | None = None
    numaNodes: Annotated[int, Meta(ge=1, le=64)] = 1
    memoryGiB: Annotated[float, Meta(gt=0, le=1024 * 1024)] | None = None
    hugepages1G: dict[str, Annotated[int, Meta(ge=0)]] | None = None
    hugepages2M: dict[str, Annotated[int, Meta(ge=0)]] | None = None


class Topology(_Spec):
    hostname: Name | None = None
    driver: DriverSpec = DriverSpec()
    gpus: list[GpuSpec] = []
    lostGpus: list[Annotated[int, Meta(ge=0)]] = []
    host: HostSpec | None = None


# -- the concrete devices a topology describes ------------------------------------


@dataclass(frozen=True, slots=True)
class SimMig:
    slot: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    uuid: str
    name: str
    memory_mib: int
    placement_start: int  # its GPU instance's first slice
    placement_size: int  # the slices the GPU instance spans


@dataclass(frozen=True, slots=True)
class SimGpu:
    index: int
    minor: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_mib: int
    numa_node: int | None
    mig_capable: bool
    mig_current: bool
    mig_pending: bool
    lost: bool
    mig: tuple[SimMig, ...]


def _uuid(kind: str, *parts: object) -> str:
    return f"{kind}-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, 'berth-sim/' + '/'.join(map(str, parts)))}"


def profile_memory_mib(profile: str) -> int:
    """The memory NVML shows for a profile "Ng.Mgb": about 95% of M GiB (1g.10gb -> 9728 MiB)."""
    m = _PROFILE.match(profile)
    assert m, profile
    return int(m.group(3)) * 1024 * 95 // 100 // 256 * 256


def profile_slices(profile: str) -> int:
    m = _PROFILE.match(profile)
    assert m, profile
    return int(m.group(2))


def _mig_specs(spec: GpuSpec) -> list[MigSpec]:
    if spec.mig is None:
        return []
    return [spec.mig] if isinstance(spec.mig, MigSpec) else list(spec.mig)


def _placements(spec: GpuSpec) -> list[tuple[int, int]]:
    """(start, size) of each MIG instance's GPU instance, in the topology's order: at its slot when migSlots is
    given, else packed one after the other. A simulated MIG device's slot is its placement start, as the stand-in
    NVML gives the instances it creates, so a layout rebuilt in place comes back in the same slots."""
    sizes = [profile_slices(m.profile) for m in _mig_specs(spec) for _ in range(m.count)]
    if spec.migSlots is not None:
        return list(zip(spec.migSlots, sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes))


def validate(top: Topology) -> None:
    """Cross-field rules msgspec cannot state; TopologyError names the field."""
    if top.hostname is not None and not is_hostname(top.hostname):
        raise TopologyError(f"hostname: {top.hostname!r} is not {HOSTNAME_RULE}")
    nodes = top.host.numaNodes if top.host else None  # without a host section the real host's (unknown here)
    total = 0
    for i, spec in enumerate(top.gpus):
        where = f"gpus[{i}]"
        if spec.numaNodes is not None:
            if len(spec.numaNodes) != spec.count:
                raise TopologyError(f"{where}.numaNodes: has {len(spec.numaNodes)} entries for count {spec.count}")
            if nodes is not None and any(n >= nodes for n in spec.numaNodes):
                raise TopologyError(f"{where}.numaNodes: node ids must be below host.numaNodes ({nodes})")
        migs = _mig_specs(spec)
        capable = _mig_capable(spec)
        if spec.mig is not None and not capable:
            raise TopologyError(f"{where}.mig: {spec.name!r} does not support MIG (set migCapable to say otherwise)")
        if spec.migPending is not None and not capable:
            raise TopologyError(f"{where}.migPending: {spec.name!r} does not support MIG")
        instances = sum(m.count for m in migs)
        if instances > MAX_MIG_SLOTS:
            raise TopologyError(f"{where}.mig: {instances} instances; a GPU has at most {MAX_MIG_SLOTS}")
        slices = sum(profile_slices(m.profile) * m.count for m in migs)
        if slices > MAX_MIG_SLOTS:
            raise TopologyError(f"{where}.mig: the profiles take {slices} slices; a GPU has {MAX_MIG_SLOTS}")
        for j, m in enumerate(migs):
            if (m.memoryMiB or 0) > spec.memoryMiB:
                raise TopologyError(f"{where}.mig[{j}].memoryMiB: larger than the GPU's memoryMiB")
        # No table of each model's profiles here: a profile of a larger GPU (7 x 1g.10gb on a 40 GB A100, whose
        # smallest is 1g.5gb) is caught by the memory its instances would take.
        memory = sum((m.memoryMiB or profile_memory_mib(m.profile)) * m.count for m in migs)
        if memory > spec.memoryMiB:
            raise TopologyError(f"{where}.mig: the instances take {memory} MiB; the GPU has {spec.memoryMiB} MiB "
                                f"(is a profile one of a larger GPU's?)")
        if spec.migSlots is not None:
            if len(spec.migSlots) != instances or len(set(spec.migSlots)) != instances:
                raise TopologyError(f"{where}.migSlots: needs {instances} distinct slots, one per MIG instance")
            taken: set[int] = set()
            for start, size in _placements(spec):
                span = set(range(start, start + size))
                if start + size > MAX_MIG_SLOTS or span & taken:
                    raise TopologyError(f"{where}.migSlots: the instance at slot {start} spans {size} slices, past "
                                        f"the GPU's {MAX_MIG_SLOTS} or over another instance")
                taken |= span
        total += spec.count
    if total > MAX_GPUS:
        raise TopologyError(f"gpus: {total} GPUs in all; an inventory holds at most {MAX_GPUS}")
    for i, lost in enumerate(top.lostGpus):
        if lost >= total:
            raise TopologyError(f"lostGpus[{i}]: no GPU {lost} (the topology has {total})")
    if top.host:
        h = top.host
        if h.cpus is not None:
            tpc = h.threadsPerCore or 1
            if h.cpus % tpc:
                raise TopologyError(f"host.threadsPerCore: {h.cpus} CPUs do not split into cores of {tpc}")
            if h.cpus < h.numaNodes:
                raise TopologyError("host.cpus: fewer CPUs than host.numaNodes")
        elif h.threadsPerCore is not None or h.offlineCpus is not None:
            raise TopologyError("host.cpus: needed when host.threadsPerCore or host.offlineCpus is given")
        if h.offlineCpus is not None:
            try:
                offline = parse_cpulist(h.offlineCpus)
            except Exception:
                raise TopologyError(f"host.offlineCpus: not a cpulist: {h.offlineCpus!r}") from None
            if any(c >= (h.cpus or 0) for c in offline) or len(offline) >= (h.cpus or 0):
                raise TopologyError("host.offlineCpus: must name CPUs below host.cpus and leave one online")
        for key in ("hugepages1G", "hugepages2M"):
            for node in getattr(h, key) or {}:
                if not node.isdigit() or int(node) >= h.numaNodes:
                    raise TopologyError(f"host.{key}.{node}: keys are NUMA node ids below host.numaNodes ({h.numaNodes})")
        _check_hugepages_fit(h)


def _check_hugepages_fit(h: HostSpec) -> None:
    """Hugepages are carved out of memory, node by node: a node's pools may not hold more than the node has (the
    simulated memory split evenly). Memory that is not simulated is the real host's, unknown until discovery."""
    if h.memoryGiB is None:
        return
    per_node = h.memoryGiB / h.numaNodes
    pages_1g, pages_2m = h.hugepages1G or {}, h.hugepages2M or {}
    for node in sorted(set(pages_1g) | set(pages_2m), key=int):
        need = pages_1g.get(node, 0) + pages_2m.get(node, 0) * SIZE_2M_KIB / SIZE_1G_KIB
        if need > per_node:
            key = "hugepages1G" if node in pages_1g else "hugepages2M"
            raise TopologyError(f"host.{key}.{node}: {need:.4g} GiB of hugepages on node {node}, which has "
                                f"{per_node:.4g} GiB (host.memoryGiB {h.memoryGiB:g} over {h.numaNodes} "
                                f"node{'s' if h.numaNodes > 1 else ''}); hugepages come out of memory: give fewer "
                                "pages or more memory")


def _mig_capable(spec: GpuSpec) -> bool:
    return spec.migCapable if spec.migCapable is not None else bool(_MIG_MODELS.search(spec.name.upper()))


def _check_distinct(gpus: list[SimGpu]) -> None:
    """No two GPUs of a topology may share a uuid or a PCI bus id (the agent finds a booked unit's device by its
    uuid); the expansion makes them distinct, and this keeps it so."""
    for key, of in (("uuid", lambda g: g.uuid), ("pciBusId", lambda g: g.pci_bus_id)):
        clash = first_duplicate([of(g) for g in gpus])
        if clash is not None:
            i, j = clash
            raise TopologyError(f"gpus: GPU {j} would have GPU {i}'s {key} {of(gpus[i])}")


def parse(data: bytes | str, source: str = "topology") -> Topology:
    try:
        top = msgspec.json.decode(data, type=Topology)
    except msgspec.ValidationError as exc:
        raise TopologyError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TopologyError(f"{source}: not JSON: {exc}") from None
    try:
        validate(top)
        _check_distinct(expand(top))
    except TopologyError as exc:
        raise TopologyError(f"{source}: {exc}") from None
    return top


def load(path: str | os.PathLike) -> Topology:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TopologyError(f"{path}: {exc.strerror or exc}") from None
    return parse(data, str(path))


def hostname_of(top: Topology) -> str:
    return top.hostname or "simulated-host"


def pci_bus_id(index: int) -> str:
    """The simulated GPU's PCI address in NVML's form. The first sixteen sit on buses 0x18, 0x28, ... 0xF8, 0x08 as
    device 0 (the ids they always had); later ones take the next device number on the same buses, so every count
    a topology allows (MAX_GPUS) gets distinct ids."""
    return f"00000000:{(0x18 + 0x10 * (index % 16)) % 0x100:02X}:{index // 16:02X}.0"


def expand(top: Topology) -> list[SimGpu]:
    """The topology's GPUs one by one, with stable UUIDs, PCI bus ids, minors and MIG slots."""
    host = hostname_of(top)
    gpus: list[SimGpu] = []
    for spec in top.gpus:
        migs = _mig_specs(spec)
        capable = _mig_capable(spec)
        mig_on = spec.mig is not None  # "mig": [] is MIG mode with no instance yet: not bookable whole
        for k in range(spec.count):
            index = len(gpus)
            devices: list[SimMig] = []
            placements = _placements(spec)
            position = 0
            for m in migs:
                for _ in range(m.count):
                    start, size = placements[position]
                    gi = position + 1
                    devices.append(SimMig(
                        slot=start, gpu_instance_id=gi, compute_instance_id=0, profile=m.profile,
                        uuid=_uuid("MIG", host, index, gi, 0, m.profile), name=f"{spec.name} MIG {m.profile}",
                        memory_mib=m.memoryMiB or profile_memory_mib(m.profile),
                        placement_start=start, placement_size=size,
                    ))
                    position += 1
            devices.sort(key=lambda d: d.slot)
            gpus.append(SimGpu(
                index=index, minor=index, uuid=_uuid("GPU", host, index), name=spec.name,
                pci_bus_id=pci_bus_id(index), memory_mib=spec.memoryMiB,
                numa_node=spec.numaNodes[k] if spec.numaNodes is not None else None,
                mig_capable=capable, mig_current=mig_on,
                mig_pending=spec.migPending if spec.migPending is not None else mig_on,
                lost=index in top.lostGpus, mig=tuple(devices),
            ))
    return gpus


def _driver_status(top: Topology) -> Driver:
    cuda = top.driver.cuda
    return Driver(status="ok", version=top.driver.version, cudaVersion=f"{cuda // 1000}.{cuda % 1000 // 10}")


def gpu_inventory(top: Topology) -> GpuInventory:
    gpus, lost = [], []
    for g in expand(top):
        if g.lost:
            lost.append(LostGpu(index=g.index, error="GPU is lost", code=15))
            continue
        gpus.append(Gpu(
            index=g.index, uuid=g.uuid, name=g.name, deviceClass="", minor=g.minor, pciBusId=g.pci_bus_id,
            memoryMiB=g.memory_mib, numaNode=g.numa_node,
            migMode=MigMode(current=g.mig_current, pending=g.mig_pending) if g.mig_capable else None,
            migDevices=tuple(
                MigDevice(index=m.slot, gpuInstanceId=m.gpu_instance_id, computeInstanceId=m.compute_instance_id,
                          profile=m.profile, uuid=m.uuid, name=m.name, memoryMiB=m.memory_mib,
                          placement=MigPlacement(start=m.placement_start, size=m.placement_size),
                          capMinors=CapMinors(  # the driver's layout, as mig_minors.render writes it
                              gi=mig_minors.driver_minor(g.minor, m.gpu_instance_id),
                              ci=mig_minors.driver_minor(g.minor, m.gpu_instance_id, m.compute_instance_id)))
                for m in g.mig
            ),
        ))
    return GpuInventory(source="simulate", driver=_driver_status(top), gpus=tuple(gpus), lostGpus=tuple(lost))


class _TopologyFile:
    """The topology, read again when the file changes (so editing it changes the simulated host)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._stamp: tuple[int, int] | None = None
        self._top: Topology | None = None

    def get(self) -> Topology:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise TopologyError(f"{self.path}: {exc.strerror or exc}") from None
        stamp = (st.st_mtime_ns, st.st_size)
        if self._top is None or stamp != self._stamp:
            self._top, self._stamp = load(self.path), stamp
        return self._top


class SimulatedGpus:
    """A GpuSource answering from a topology (a file re-read on change, or a Topology given directly)."""

    name = "simulate"

    def __init__(self, topology: str | os.PathLike | Topology) -> None:
        self._file = None if isinstance(topology, Topology) else _TopologyFile(topology)
        self._top = topology if isinstance(topology, Topology) else None

    def topology(self) -> Topology:
        return self._top if self._file is None else self._file.get()

    def discover(self) -> GpuInventory:
        return gpu_inventory(self.topology())

    def hostname(self) -> str:
        return hostname_of(self.topology())


class SimulatedHost:
    """A HostSource: the topology's `host` sections replace the kernel's (cpus, memory, hugepages each on its own)."""

    def __init__(self, gpus: SimulatedGpus, fallback: HostSource | None = None) -> None:
        self.gpus = gpus
        self.fallback = fallback or KernelHost()

    def read(self) -> HostFacts:
        h = self.gpus.topology().host
        real = self.fallback.read()
        if h is None:
            return dataclasses.replace(real, hostname=self.gpus.hostname())
        nodes = tuple(range(h.numaNodes))
        cpus = _sim_cpus(h, nodes) if h.cpus is not None else real.cpus
        pages_1g, pages_2m = real.pages_1g, real.pages_2m
        hugetlb_kib = real.meminfo.hugetlb_kib
        if h.hugepages1G is not None or h.hugepages2M is not None:  # one given: both simulated, the other empty
            pages_1g = _sim_pool(SIZE_1G_KIB, h.hugepages1G or {}, nodes)
            pages_2m = _sim_pool(SIZE_2M_KIB, h.hugepages2M or {}, nodes)
            hugetlb_kib = pages_1g.total * pages_1g.size_kib + pages_2m.total * pages_2m.size_kib
        meminfo = Meminfo(total_kib=real.meminfo.total_kib, hugetlb_kib=hugetlb_kib)
        node_memory = real.node_memory
        if h.memoryGiB is not None:
            meminfo = Meminfo(total_kib=int(h.memoryGiB * 1024 * 1024), hugetlb_kib=hugetlb_kib)
            node_memory = tuple(NodeMemory(n, meminfo.total_kib // len(nodes)) for n in nodes)
        # Every section lists the same nodes: the simulated ones and any real one a section kept, with nothing (0,
        # no CPUs) where that section has nothing, so that a GPU's node is found in each.
        every = tuple(sorted({*nodes, *(n for n, _ in cpus.nodes), *(m.node for m in node_memory),
                              *(p.node for p in pages_1g.nodes), *(p.node for p in pages_2m.nodes)}))
        return HostFacts(cpus=_cpus_on(cpus, every), meminfo=meminfo, node_memory=_memory_on(node_memory, every),
                         pages_1g=_pool_on(pages_1g, every), pages_2m=_pool_on(pages_2m, every),
                         boot_id=real.boot_id, hostname=self.gpus.hostname())


def _sim_cpus(h: HostSpec, nodes: tuple[int, ...]) -> CpuTopology:
    """host.cpus CPUs (host.offlineCpus of them offline) in cores of host.threadsPerCore, on `nodes`."""
    offline = parse_cpulist(h.offlineCpus or "")
    online = tuple(c for c in range(h.cpus) if c not in offline)
    tpc = h.threadsPerCore or (2 if h.cpus % 2 == 0 and h.cpus >= 4 else 1)
    ncores = h.cpus // tpc
    # Linux numbering: thread t of core c is CPU c + t * ncores; cores split evenly across nodes.
    per_node = -(-ncores // h.numaNodes)
    node_of = {c + t * ncores: min(c // per_node, h.numaNodes - 1) for c in range(ncores) for t in range(tpc)}
    cores = {cpu % ncores for cpu in online}
    return CpuTopology(online=online, offline=offline, cores=len(cores),
                       nodes=tuple((n, tuple(c for c in online if node_of[c] == n)) for n in nodes))


def _cpus_on(cpus: CpuTopology, nodes: tuple[int, ...]) -> CpuTopology:
    have = dict(cpus.nodes)
    return dataclasses.replace(cpus, nodes=tuple((n, have.get(n, ())) for n in nodes))


def _memory_on(memory: tuple[NodeMemory, ...], nodes: tuple[int, ...]) -> tuple[NodeMemory, ...]:
    have = {m.node: m for m in memory}
    return tuple(have.get(n, NodeMemory(n, 0)) for n in nodes)


def _pool_on(pool: HugepagePool, nodes: tuple[int, ...]) -> HugepagePool:
    have = {p.node: p for p in pool.nodes}
    return dataclasses.replace(pool, nodes=tuple(have.get(n, NodePool(n, 0, 0)) for n in nodes))


def _sim_pool(size_kib: int, counts: dict[str, int], nodes: tuple[int, ...]) -> HugepagePool:
    per = tuple(NodePool(n, counts.get(str(n), 0), counts.get(str(n), 0)) for n in nodes)
    total = sum(p.total for p in per)
    return HugepagePool(size_kib=size_kib, supported=True, total=total, free=total, nodes=per)
