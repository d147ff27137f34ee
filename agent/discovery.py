"""Discovery: one inventory of this host, assembled from a GpuSource and a HostSource, and re-discovery
on a timer and on demand that yields an inventory diff for every change.

Host policy is applied here and nowhere else: the device class of each
GPU (`DeviceClasses`), health verdicts over what NVML reports, which GPUs
are bookable (healthy, not in MIG mode: MIG GPUs are booked by their
instances), the system reserve of CPUs and memory, and the per-GPU share
through the control plane's own `host_share_per_gpu`. The result is checked
as the control plane would check it (the Inventory type and
common.inventory.check): a document it would refuse is an InventoryInvalid
naming the field, never an inventory the agent registers and retries for ever.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import msgspec
import structlog

from agent.errors import AgentError
from agent.health import HealthPolicy
from agent.host import HostFacts, HostSource, KernelHost
from agent.hugepages import HugepagePool as PoolFacts
from common.argtypes import AMOUNT_MOST
from common.inventory import (
    HEALTHY, Cpus, Gpu, GpuInventory, HugepageNode, HugepagePool, Hugepages, Inventory, InventoryDiff,
    InventoryError, Memory, NumaCpus, NumaMemory, PerGpuShare, ShareDoc, check, diff,
)
from common.hostfacts import format_cpulist
from common.device_classes import DEFAULT as DEFAULT_CLASSES
from common.device_classes import DeviceClassError, DeviceClasses
from common.share import host_share_per_gpu

log = structlog.get_logger(__name__)


class InventoryInvalid(AgentError):
    """The inventory this host would report breaks the document's rules, so the control plane would refuse it at
    every try: discovery fails instead, naming the field (as a kernel file it cannot read fails it)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"inventory {field}: {reason}")
        self.field = field


class GpuSource(Protocol):
    name: str

    def discover(self) -> GpuInventory: ...


@dataclass(frozen=True, slots=True)
class Reserve:
    """What the host keeps for itself: the system reserve, taken out before anything is allocatable."""

    vcpu_milli: int = 1000
    memory_mib: int = 4096

    @classmethod
    def of(cls, vcpu: float, memory_gib: float) -> "Reserve":
        if vcpu < 0 or memory_gib < 0:
            raise ValueError("a reserve cannot be negative")
        if not (vcpu <= AMOUNT_MOST and memory_gib <= AMOUNT_MOST):  # also nan and inf
            raise ValueError(f"a reserve is at most {AMOUNT_MOST} vcpu or GiB")
        return cls(vcpu_milli=round(vcpu * 1000), memory_mib=round(memory_gib * 1024))


@dataclass(frozen=True)
class Discovery:
    """Everything one discovery reads and applies; `discover()` runs it once."""

    gpus: GpuSource
    host: HostSource = field(default_factory=KernelHost)
    reserve: Reserve = Reserve()
    device_classes: DeviceClasses = DEFAULT_CLASSES
    health: HealthPolicy | None = None
    wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)

    def discover(self) -> Inventory:
        return assemble(self.gpus.discover(), self.host.read(), reserve=self.reserve,
                        device_classes=self.device_classes, health=self.health, discovered_at_ms=self.wall_ms())


def _apply_policy(gpu: Gpu, classes: DeviceClasses, health: HealthPolicy | None) -> Gpu:
    verdict = health.health_of(gpu.uuid) if health else HEALTHY
    migs = tuple(
        msgspec.structs.replace(m, health=health.health_of(gpu.uuid, m.gpuInstanceId, m.computeInstanceId))
        for m in gpu.migDevices
    ) if health else gpu.migDevices
    in_mig = bool(gpu.migMode and gpu.migMode.current)
    try:
        device_class = classes.classify(gpu.name, gpu.memoryMiB)
    except DeviceClassError as exc:
        raise InventoryInvalid(f"gpus[{gpu.index}].deviceClass", str(exc)) from None
    return msgspec.structs.replace(
        gpu, deviceClass=device_class, health=verdict, bookable=verdict.healthy and not in_mig, migDevices=migs,
    )


def _checked(inv: Inventory) -> Inventory:
    """The inventory, if the control plane would take it: the rules the types cannot state (common.inventory.check)
    and, as a last net for any value a source let through, the types themselves (msgspec checks bounds only when it
    decodes, never when a Struct is built). InventoryInvalid names the first field that breaks one."""
    try:
        check(inv)
        msgspec.json.decode(msgspec.json.encode(inv), type=Inventory)
    except InventoryError as exc:
        raise InventoryInvalid(exc.field, exc.reason) from None
    except msgspec.ValidationError as exc:  # "Expected `str` of length <= 64 - at `$.gpus[0].deviceClass`"
        reason, _, where = str(exc).rpartition(" - at `$")
        raise InventoryInvalid(where.rstrip("`").lstrip(".") or "(the document)", reason or str(exc)) from None
    return inv


def _pool(p: PoolFacts) -> HugepagePool:
    return HugepagePool(sizeKiB=p.size_kib, supported=p.supported, total=p.total, free=p.free,
                        numaNodes=tuple(HugepageNode(node=n.node, total=n.total, free=n.free) for n in p.nodes))


def _cpus(facts: HostFacts, reserve: Reserve) -> Cpus:
    c = facts.cpus
    total_milli = c.threads * 1000
    reserved = min(reserve.vcpu_milli, total_milli)
    allocatable = total_milli - reserved
    return Cpus(
        online=format_cpulist(c.online), onlineCount=c.threads, offline=format_cpulist(c.offline), cores=c.cores,
        threads=c.threads,
        numaNodes=tuple(NumaCpus(node=n, cpus=format_cpulist(cpus), count=len(cpus)) for n, cpus in c.nodes),
        reservedVcpuMilli=reserved, allocatableVcpuMilli=allocatable, allocatableVcpu=allocatable / 1000,
    )


def _memory(facts: HostFacts, reserve: Reserve) -> Memory:
    total = facts.meminfo.total_kib // 1024
    huge = facts.meminfo.hugetlb_kib // 1024
    reserved = min(reserve.memory_mib, max(0, total - huge))
    per_node_huge: dict[int, int] = {}
    for pool in (facts.pages_1g, facts.pages_2m):
        for n in pool.nodes:
            per_node_huge[n.node] = per_node_huge.get(n.node, 0) + n.total * pool.size_kib // 1024
    return Memory(
        totalMiB=total, hugepagesMiB=huge, reservedMiB=reserved, allocatableMiB=max(0, total - huge - reserved),
        numaNodes=tuple(NumaMemory(node=m.node, totalMiB=m.total_kib // 1024, hugepagesMiB=per_node_huge.get(m.node, 0))
                        for m in facts.node_memory),
    )


def assemble(gpus: GpuInventory, facts: HostFacts, *, reserve: Reserve = Reserve(),
             device_classes: DeviceClasses = DEFAULT_CLASSES, health: HealthPolicy | None = None,
             discovered_at_ms: int = 0) -> Inventory:
    """The inventory from what the sources said, with the host's policy applied; InventoryInvalid (naming the field)
    rather than a document the control plane would refuse."""
    placed = tuple(_apply_policy(g, device_classes, health) for g in gpus.gpus)
    cpus = _cpus(facts, reserve)
    memory = _memory(facts, reserve)
    bookable = sum(1 for g in placed if g.bookable)
    share = host_share_per_gpu(cpus.allocatableVcpuMilli, memory.allocatableMiB, bookable)
    per_gpu = None if share is None else PerGpuShare(
        vcpuMilli=share.vcpu_milli, vcpu=share.vcpu_milli / 1000,
        memoryMiB=share.memory_mib, memoryGiB=share.memory_mib / 1024,
    )
    return _checked(Inventory(
        hostname=facts.hostname or socket.gethostname(), discoveredAtMs=discovered_at_ms, source=gpus.source,
        driver=gpus.driver, gpus=placed, lostGpus=gpus.lostGpus, cpus=cpus, memory=memory,
        hugepages=Hugepages(pages1G=_pool(facts.pages_1g), pages2M=_pool(facts.pages_2m)),
        share=ShareDoc(bookableGpus=bookable, perGpu=per_gpu), bootId=facts.boot_id,
    ))


class Rediscovery:
    """Re-discovery on a timer and on demand; every change is reported as a diff, never a silent rewrite.

    `refresh()` discovers now (on the caller's thread) and returns the diff
    against the previous inventory; `request()` asks the timer thread to
    refresh at once (from any thread: the XID watcher, an operator);
    `start()`/`stop()` run the timer. `on_change(diff, inventory)` is called
    for every non-empty diff, the first discovery included.
    """

    def __init__(self, discover: Callable[[], Inventory], *, interval_s: float = 60.0,
                 on_change: Callable[[InventoryDiff, Inventory], None] | None = None) -> None:
        self._discover = discover
        self.interval_s = interval_s
        self.on_change = on_change or (lambda d, inv: None)
        self.current: Inventory | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> InventoryDiff:
        with self._lock:
            new = self._discover()
            change = diff(self.current, new)
            self.current = new
        if not change.empty:
            log.info("inventory changed", changes=change.summary()[:20], count=len(change.changes))
            self.on_change(change, new)
        return change

    def request(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # keep the timer alive; the next tick tries again
                log.error("discovery failed", error=str(exc))
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def start(self) -> "Rediscovery":
        self._thread = threading.Thread(target=self._run, name="berth-rediscovery", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


def discover(gpus: GpuSource, host: HostSource | None = None, **kwargs) -> Inventory:
    """One discovery: `discover(NvmlGpus(), KernelHost(), reserve=Reserve.of(2, 8))`."""
    return Discovery(gpus=gpus, host=host or KernelHost(), **kwargs).discover()
