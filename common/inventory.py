"""The inventory document: what a host has, in the form the control plane books against, and diffs of it.

The agent's discovery writes it and the control plane reads it (register and
heartbeat carry it), so it is defined once, here. One msgspec definition per
shape (camelCase on the wire), frozen, strict (an unknown field or a value out
of its bounds is refused with the field named); `Inventory.to_wire()` /
`Inventory.from_wire()` are the JSON form, `diff(old, new)` says what changed
between two discoveries. docs/inventory.md describes every field and bound.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Hashable, Literal, Sequence

import msgspec
from msgspec import Meta, Struct, field

SCHEMA_VERSION = 1

# Bounds: generous for any real host, tight enough that nonsense is refused.
Index = Annotated[int, Meta(ge=0, le=1023)]
Minor = Annotated[int, Meta(ge=0, le=(1 << 20) - 1)]  # a device minor number (20 bits)
NumaNode = Annotated[int, Meta(ge=0, le=1023)]
Count = Annotated[int, Meta(ge=0, le=1 << 32)]
VcpuMilli = Annotated[int, Meta(ge=0, le=100_000_000)]  # up to 100,000 CPUs
MiB = Annotated[int, Meta(ge=0, le=1 << 40)]
Text = Annotated[str, Meta(max_length=256)]
Uuid = Annotated[str, Meta(min_length=1, max_length=128)]
Name = Annotated[str, Meta(max_length=128)]
CpuList = Annotated[str, Meta(max_length=16384, pattern=r"^[0-9,\-]*$")]
Hostname = Annotated[str, Meta(min_length=1, max_length=253)]
Ms = Annotated[int, Meta(ge=0, le=32503680000000)]  # epoch ms, up to year 3000
MAX_GPUS = 256  # GPUs (and lost GPUs) in one inventory; a --simulate topology is held to it too


class _Doc(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class MigMode(_Doc):
    current: bool
    pending: bool


class Health(_Doc):
    healthy: bool = True
    xid: Annotated[int, Meta(ge=0, le=1 << 31)] | None = None
    reason: Text = ""
    sinceMs: Ms | None = None


HEALTHY = Health()


class CapMinors(_Doc):
    gi: Minor | None = None
    ci: Minor | None = None


class MigPlacement(_Doc):
    """Where a GPU instance sits on its GPU, in memory slices (NVML's nvmlGpuInstancePlacement_t)."""

    start: Index
    size: Annotated[int, Meta(ge=1, le=64)]


class MigDevice(_Doc):
    index: Index  # NVML's MIG device slot on the parent GPU (slots can be sparse)
    gpuInstanceId: Index
    computeInstanceId: Index
    profile: Name | None
    uuid: Uuid
    name: Name
    memoryMiB: MiB
    capMinors: CapMinors = CapMinors()
    health: Health = HEALTHY
    placement: MigPlacement | None = None  # its GPU instance's placement (None: NVML did not say)


class Gpu(_Doc):
    index: Index
    uuid: Uuid
    name: Name
    deviceClass: Annotated[str, Meta(min_length=1, max_length=64)]
    minor: Minor
    pciBusId: Annotated[str, Meta(max_length=32)]
    memoryMiB: MiB
    numaNode: NumaNode | None
    migMode: MigMode | None  # None: the GPU does not support MIG
    health: Health = HEALTHY
    bookable: bool = False
    migDevices: Annotated[tuple[MigDevice, ...], Meta(max_length=64)] = ()


class LostGpu(_Doc):
    """A GPU that NVML counts but cannot read: fell off the bus, or any other per-GPU NVML error."""

    index: Index
    error: Text
    code: Annotated[int, Meta(ge=0, le=1 << 16)] | None = None


DriverStatus = Literal["ok", "not-found", "not-loaded", "error"]


class Driver(_Doc):
    status: DriverStatus
    message: Text = ""
    version: Name | None = None
    cudaVersion: Name | None = None


class GpuInventory(_Doc):
    """What a GpuSource reports: the driver and its GPUs (deviceClass, health and bookable are filled by discovery)."""

    source: str
    driver: Driver
    gpus: tuple[Gpu, ...] = ()
    lostGpus: tuple[LostGpu, ...] = ()


class NumaCpus(_Doc):
    node: NumaNode
    cpus: CpuList  # kernel cpulist of the node's online CPUs
    count: Count


class Cpus(_Doc):
    online: CpuList
    onlineCount: Count
    offline: CpuList
    cores: Count
    threads: Count
    numaNodes: Annotated[tuple[NumaCpus, ...], Meta(max_length=1024)]
    reservedVcpuMilli: VcpuMilli
    allocatableVcpuMilli: VcpuMilli
    allocatableVcpu: Annotated[float, Meta(ge=0, le=100_000)]


class NumaMemory(_Doc):
    node: NumaNode
    totalMiB: MiB
    hugepagesMiB: MiB


class Memory(_Doc):
    totalMiB: MiB
    hugepagesMiB: MiB
    reservedMiB: MiB
    allocatableMiB: MiB
    numaNodes: Annotated[tuple[NumaMemory, ...], Meta(max_length=1024)]


class HugepageNode(_Doc):
    node: NumaNode
    total: Count
    free: Count


class HugepagePool(_Doc):
    sizeKiB: Count
    supported: bool
    total: Count
    free: Count
    numaNodes: Annotated[tuple[HugepageNode, ...], Meta(max_length=1024)] = ()


class Hugepages(_Doc):
    pages1G: HugepagePool = field(name="1G")
    pages2M: HugepagePool = field(name="2M")


class PerGpuShare(_Doc):
    vcpuMilli: VcpuMilli
    vcpu: Annotated[float, Meta(ge=0, le=100_000)]
    memoryMiB: MiB
    memoryGiB: Annotated[float, Meta(ge=0, le=1 << 30)]


class ShareDoc(_Doc):
    bookableGpus: Count
    perGpu: PerGpuShare | None  # None: no bookable GPU, or no CPU or memory left to share after the reserve


class Inventory(_Doc):
    hostname: Hostname
    discoveredAtMs: Ms
    source: Literal["nvml", "simulate"]
    driver: Driver
    gpus: Annotated[tuple[Gpu, ...], Meta(max_length=MAX_GPUS)]
    lostGpus: Annotated[tuple[LostGpu, ...], Meta(max_length=MAX_GPUS)]
    cpus: Cpus
    memory: Memory
    hugepages: Hugepages
    share: ShareDoc
    bootId: Annotated[str, Meta(max_length=64)] | None = None
    schemaVersion: Annotated[int, Meta(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION

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


# -- rules the types cannot state ---------------------------------------------------

# A host name, as the node id `<pool>-<hostname>` and a tenant's ssh command use it (RFC 1123 section 2.1): labels
# of letters, digits and inner hyphens, 1 to 63 characters each, joined by dots, at most 253 in all; underscores
# are taken too, as in labels, since some sites name hosts with them and nothing here breaks on one. The one
# definition: a --simulate topology, the agent's discovery, the bootstrap's declared nodes and the control plane's
# register all check with it.
HOSTNAME_RULE = ("a host name (letters, digits, hyphens and underscores in dot-separated labels of 1 to 63 "
                 "characters, no label starting or ending with a hyphen, at most 253 in all)")
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def is_hostname(name: str) -> bool:
    name = name[:-1] if name.endswith(".") else name  # an absolute name, as DNS writes it (gpu-01.example.net.)
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def first_duplicate(values: Sequence[Hashable]) -> tuple[int, int] | None:
    """(earlier, later): the positions of the first value seen twice; None when all differ."""
    seen: dict[Hashable, int] = {}
    for later, value in enumerate(values):
        if value in seen:
            return seen[value], later
        seen[value] = later
    return None


class InventoryError(ValueError):
    """An inventory breaks a rule its types cannot state; `field` is the path in the document (`gpus[1].uuid`)."""

    def __init__(self, field: str, reason: str, rule: str = "") -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.rule = rule or reason  # the rule alone, short (an API error's details.rule)


def check(inv: Inventory) -> None:
    """What msgspec cannot check of a decoded inventory; InventoryError names the field. The agent runs it before it
    reports an inventory, the control plane on each registration: the hostname is a host name (the node's id is
    made of it), and `check_gpus`."""
    if not is_hostname(inv.hostname):
        raise InventoryError("hostname", f"{inv.hostname!r} is not {HOSTNAME_RULE}: give the host such a name "
                                         "(hostnamectl set-hostname NAME)", HOSTNAME_RULE)
    check_gpus(inv)


def check_gpus(inv: Inventory) -> None:
    """No two GPUs share an index, a uuid or a PCI bus id, and no two MIG devices an index on their GPU or a uuid
    anywhere: a booked unit is named by its indexes (gpu3, gpu3/mig1: two GPUs of one index would be one unit
    booked twice) and the agent finds its device by its uuid, so a second GPU with the uuid of the first would give
    a booking of it the first one's device node. (The control plane runs this alone on a heartbeat's inventory: a
    node registered before the hostname rule keeps working.)"""
    clash = first_duplicate([g.index for g in inv.gpus])
    if clash is not None:
        i, j = clash
        raise InventoryError(f"gpus[{j}].index", f"{inv.gpus[j].index} duplicates gpus[{i}]'s: each GPU has its own "
                             "NVML index; check the driver (nvidia-smi -L) before booking this host",
                             "each GPU has its own index")
    # PCI bus ids only as NVML reports them: an earlier release's --simulate repeated them past 16 GPUs, and its
    # agents must still register (their uuids are distinct)
    for key in ("uuid", "pciBusId") if inv.source == "nvml" else ("uuid",):
        values = [getattr(g, key) for g in inv.gpus]
        clash = first_duplicate([v.upper() for v in values] if key == "pciBusId" else values)
        if clash is not None:
            i, j = clash
            raise InventoryError(f"gpus[{j}].{key}", f"{values[j]} duplicates gpus[{i}]'s (NVML GPUs "
                                 f"{inv.gpus[i].index} and {inv.gpus[j].index} report one {key}): each GPU has its "
                                 "own; check the driver (nvidia-smi -L) before booking this host",
                                 f"each GPU has its own {key}")
    for k, gpu in enumerate(inv.gpus):
        clash = first_duplicate([m.index for m in gpu.migDevices])
        if clash is not None:
            i, j = clash
            raise InventoryError(f"gpus[{k}].migDevices[{j}].index", f"{gpu.migDevices[j].index} duplicates "
                                 f"migDevices[{i}]'s on GPU {gpu.index}: each MIG device has its own slot",
                                 "each MIG device of a GPU has its own index")
    # the GPUs' uuids differ (above), so a clash names a MIG device second
    where = [f"gpus[{k}]" for k in range(len(inv.gpus))] + [
        f"gpus[{k}].migDevices[{j}]" for k, g in enumerate(inv.gpus) for j in range(len(g.migDevices))]
    clash = first_duplicate([g.uuid for g in inv.gpus] + [m.uuid for g in inv.gpus for m in g.migDevices])
    if clash is not None:
        i, j = clash
        raise InventoryError(f"{where[j]}.uuid", f"duplicates {where[i]}'s: each MIG device has its own uuid; check "
                             "the driver (nvidia-smi -L) before booking this host", "each device has its own uuid")


# -- diff ----------------------------------------------------------------------


def _field(name: str) -> Callable[[dict], Any]:
    return lambda item: item.get(name)


def mig_position(item: dict) -> str:
    """Where a MIG device sits on its GPU, whatever its UUID: its GPU instance's placement start (the slot when NVML
    gave no placement), its profile, GPU instance id and compute instance id. A MIG device the driver recreated in
    the same place has a new UUID and the same position."""
    placement = item.get("placement")
    at = f"placement {placement['start']}" if placement else f"slot {item.get('index')}"
    return f"{item.get('profile')} gi {item.get('gpuInstanceId')} ci {item.get('computeInstanceId')} at {at}"


# Lists whose items have an identity: compared item by item, keyed so.
_LIST_KEYS: dict[str, Callable[[dict], Any]] = {
    "gpus": _field("uuid"), "migDevices": _field("uuid"), "lostGpus": _field("index"), "numaNodes": _field("node")}
# The clean check's keys: MIG devices by position, since a restored layout's devices get new UUIDs.
_CLEAN_KEYS = {**_LIST_KEYS, "migDevices": mig_position}
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


def _walk(old: Any, new: Any, path: str, list_key: str | None, out: list[Change],
          keys: dict[str, Callable[[dict], Any]]) -> None:
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
                _walk(old[key], new[key], sub, key, out, keys)
        return
    ident_of = keys.get(list_key or "")
    if ident_of and isinstance(old, list) and isinstance(new, list):
        before = {ident_of(item): item for item in old if isinstance(item, dict)}
        after = {ident_of(item): item for item in new if isinstance(item, dict)}
        for ident in list(before) + [i for i in after if i not in before]:
            sub = f"{path}[{ident}]"
            if ident not in after:
                out.append(Change(op="removed", path=sub, old=before[ident]))
            elif ident not in before:
                out.append(Change(op="added", path=sub, new=after[ident]))
            else:
                _walk(before[ident], after[ident], sub, None, out, keys)
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
    _walk(old.to_wire(), new.to_wire(), "", None, out, _LIST_KEYS)
    return InventoryDiff(changes=tuple(out))


# What changes without anyone having changed the host: the boot id (a reboot), the hostname, health timestamps.
_NOT_COMPARED = ("bootId", "hostname")
_NOT_COMPARED_LEAVES = (".sinceMs",)


def differences(before: Inventory, after: Inventory) -> list[str]:
    """How a host differs from an earlier inventory of it, said plainly (a node binding's clean check, in band by
    the agent or after a BMC reset by the control plane): GPUs by UUID, MIG mode, the MIG layout by position
    (`mig_position`: a recreated MIG device's new UUID is no difference, its slot, memory or cap minors are),
    health, hugepages, CPUs, memory; not what changes by itself."""
    out: list[Change] = []
    _walk(before.to_wire(), after.to_wire(), "", None, out, _CLEAN_KEYS)
    return [c.describe() for c in out
            if c.path not in _NOT_COMPARED and not c.path.endswith(_NOT_COMPARED_LEAVES)
            and not (c.path.endswith("].uuid") and ".migDevices[" in c.path)]

