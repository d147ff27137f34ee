"""The inventory document: what this host has, in the form the control plane books against, and diffs of it.

One msgspec definition per shape (camelCase on the wire, like the control
plane's schemas), frozen; `Inventory.to_wire()` / `Inventory.from_wire()`
are the JSON form, `diff(old, new)` says what changed between two
discoveries. docs/inventory.md describes every field.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct, field

SCHEMA_VERSION = 1


class _Doc(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class MigMode(_Doc):
    current: bool
    pending: bool


class Health(_Doc):
    healthy: bool = True
    xid: int | None = None
    reason: str = ""
    sinceMs: int | None = None


HEALTHY = Health()


class CapMinors(_Doc):
    gi: int | None = None
    ci: int | None = None


class MigDevice(_Doc):
    index: int  # NVML's MIG device slot on the parent GPU (slots can be sparse)
    gpuInstanceId: int
    computeInstanceId: int
    profile: str | None
    uuid: str
    name: str
    memoryMiB: int
    capMinors: CapMinors = CapMinors()
    health: Health = HEALTHY


class Gpu(_Doc):
    index: int
    uuid: str
    name: str
    deviceClass: str
    minor: int
    pciBusId: str
    memoryMiB: int
    numaNode: int | None
    migMode: MigMode | None  # None: the GPU does not support MIG
    health: Health = HEALTHY
    bookable: bool = False
    migDevices: tuple[MigDevice, ...] = ()


class LostGpu(_Doc):
    """A GPU that NVML counts but cannot read: fell off the bus, or any other per-GPU NVML error."""

    index: int
    error: str
    code: int | None = None


DriverStatus = Literal["ok", "not-found", "not-loaded", "error"]


class Driver(_Doc):
    status: DriverStatus
    message: str = ""
    version: str | None = None
    cudaVersion: str | None = None


class GpuInventory(_Doc):
    """What a GpuSource reports: the driver and its GPUs (deviceClass, health and bookable are filled by discovery)."""

    source: str
    driver: Driver
    gpus: tuple[Gpu, ...] = ()
    lostGpus: tuple[LostGpu, ...] = ()


class NumaCpus(_Doc):
    node: int
    cpus: str  # kernel cpulist of the node's online CPUs
    count: int


class Cpus(_Doc):
    online: str
    onlineCount: int
    offline: str
    cores: int
    threads: int
    numaNodes: tuple[NumaCpus, ...]
    reservedVcpuMilli: int
    allocatableVcpuMilli: int
    allocatableVcpu: float


class NumaMemory(_Doc):
    node: int
    totalMiB: int
    hugepagesMiB: int


class Memory(_Doc):
    totalMiB: int
    hugepagesMiB: int
    reservedMiB: int
    allocatableMiB: int
    numaNodes: tuple[NumaMemory, ...]


class HugepageNode(_Doc):
    node: int
    total: int
    free: int


class HugepagePool(_Doc):
    sizeKiB: int
    supported: bool
    total: int
    free: int
    numaNodes: tuple[HugepageNode, ...] = ()


class Hugepages(_Doc):
    pages1G: HugepagePool = field(name="1G")
    pages2M: HugepagePool = field(name="2M")


class PerGpuShare(_Doc):
    vcpuMilli: int
    vcpu: float
    memoryMiB: int
    memoryGiB: float


class ShareDoc(_Doc):
    bookableGpus: int
    perGpu: PerGpuShare | None  # None: no bookable GPU (or no CPU/memory to share)


class Inventory(_Doc):
    hostname: str
    discoveredAtMs: int
    source: str  # "nvml" or "simulate"
    driver: Driver
    gpus: tuple[Gpu, ...]
    lostGpus: tuple[LostGpu, ...]
    cpus: Cpus
    memory: Memory
    hugepages: Hugepages
    share: ShareDoc
    bootId: str | None = None
    schemaVersion: int = SCHEMA_VERSION

    def to_wire(self) -> dict[str, Any]:
        """The JSON form as plain dicts and lists."""
        return msgspec.json.decode(msgspec.json.encode(self))

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Inventory":
        return msgspec.convert(data, cls)

    @classmethod
    def from_json(cls, data: bytes | str) -> "Inventory":
        return msgspec.json.decode(data, type=cls)

    def gpu(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


# -- diff ----------------------------------------------------------------------

# Lists whose items have an identity: compared item by item, keyed so.
_LIST_KEYS = {"gpus": "uuid", "migDevices": "uuid", "lostGpus": "index", "numaNodes": "node"}
# Values that change without the host changing.
_VOLATILE = frozenset({"discoveredAtMs", "free"})


class Change(_Doc):
    op: Literal["added", "removed", "changed"]
    path: str  # e.g. "gpus[GPU-1f..].migMode.current", "hugepages.1G.total"
    old: Any = None
    new: Any = None

    def describe(self) -> str:
        if self.op == "changed":
            return f"{self.path}: {_short(self.old)} -> {_short(self.new)}"
        item = self.new if self.op == "added" else self.old
        return f"{self.path} {self.op}" + (f" ({_label(item)})" if _label(item) else "")


class InventoryDiff(_Doc):
    changes: tuple[Change, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.changes

    def summary(self) -> list[str]:
        return [c.describe() for c in self.changes]

    def to_wire(self) -> dict[str, Any]:
        return msgspec.json.decode(msgspec.json.encode(self))


def _label(item: Any) -> str:
    if not isinstance(item, dict):
        return ""
    bits = [f"{k} {item[k]}" for k in ("index", "deviceClass", "profile", "error") if item.get(k) is not None]
    return ", ".join(bits)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _walk(old: Any, new: Any, path: str, list_key: str | None, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            if key in _VOLATILE:
                continue
            sub = f"{path}.{key}" if path else key
            if key not in new:
                out.append(Change(op="removed", path=sub, old=old[key]))
            elif key not in old:
                out.append(Change(op="added", path=sub, new=new[key]))
            else:
                _walk(old[key], new[key], sub, key, out)
        return
    id_key = _LIST_KEYS.get(list_key or "")
    if id_key and isinstance(old, list) and isinstance(new, list):
        before = {item.get(id_key): item for item in old if isinstance(item, dict)}
        after = {item.get(id_key): item for item in new if isinstance(item, dict)}
        for ident in list(before) + [i for i in after if i not in before]:
            sub = f"{path}[{ident}]"
            if ident not in after:
                out.append(Change(op="removed", path=sub, old=before[ident]))
            elif ident not in before:
                out.append(Change(op="added", path=sub, new=after[ident]))
            else:
                _walk(before[ident], after[ident], sub, None, out)
        return
    if old != new:
        out.append(Change(op="changed", path=path, old=old, new=new))


def diff(old: Inventory | None, new: Inventory) -> InventoryDiff:
    """What changed from `old` to `new`: GPUs and MIG devices by UUID, NUMA nodes by id, other fields by path.

    Volatile values (the discovery time, free counters) are not changes. With
    no `old` (the first discovery) the whole document is one addition.
    """
    if old is None:
        return InventoryDiff(changes=(Change(op="added", path="", new=new.to_wire()),))
    out: list[Change] = []
    _walk(old.to_wire(), new.to_wire(), "", None, out)
    return InventoryDiff(changes=tuple(out))
