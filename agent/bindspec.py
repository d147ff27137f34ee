"""What one binding asks of the kernel: its cgroup share, its device allow-list and the device nodes it opens.

`want_of(binding, host)` translates a hold binding from the watch into a
`Want`, a plain value with a fingerprint, using the host's inventory (GPU
minors, MIG cap minors, NUMA CPUs) and the controllers the host lets the
agent enforce. Every part of the booked share that this host cannot
enforce is named in `Want.unenforced` (reported, logged, counted), never
dropped silently. A binding that cannot be made at all is `BindError` with
the sentence that goes into its `failed` report.

Share -> cgroup: vcpuMilli -> cpu.max; memoryMiB -> memory.max (and
memory.swap.max 0); hugepages1Gi -> hugetlb.1GB.max; numaNodes -> cpuset.cpus
(the nodes' CPUs) and cpuset.mems. Devices: harmless nodes + /dev/nvidiaN of
each unit's GPU, nvidiactl, nvidia-uvm(-tools), and for MIG units the GPU and
compute instance cap minors. Under --simulate the minors are the simulated
ones and the nvidia-uvm / nvidia-caps majors, absent without a driver, come
from a stand-in `devices` file (`simulated_devices_proc`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from agent.errors import AgentError
from common.inventory import Gpu, Inventory, MigDevice
from common.nodewire import Binding
from cgroups import CgroupShare, DeviceRule, harmless_rules, normalise, nvidia_rules, read_proc_devices
from cgroups.errors import CgroupError, InvalidShare
from common.hostfacts import format_cpulist, parse_cpulist

MIB = 1 << 20
SUPPORTED_KINDS = ("hold",)
# Majors a driver would be given dynamically; used only under --simulate on a host without the driver.
SIMULATED_MAJORS = {"nvidia-uvm": 511, "nvidia-caps": 510}


class BindError(AgentError):
    """This binding cannot be made here; the message is the `failed` report's."""


@dataclass(frozen=True)
class HostView:
    """What translation needs to know about the host, fixed between two discoveries."""

    inventory: Inventory
    enforced: frozenset[str]
    devices_proc: Path = Path("/proc")  # the directory whose `devices` file gives nvidia-uvm / nvidia-caps majors
    simulated_cpus: bool = False  # the inventory's CPUs come from a topology, not this kernel
    simulated_memory: bool = False
    simulated_hugepages: bool = False
    real_cpus: int = 0
    real_memory_bytes: int = 0
    real_hugepages_1g: int = 0  # the host's own pool of 1 GiB pages (nr_hugepages)


@dataclass(frozen=True)
class Want:
    """The kernel state one binding should have."""

    reservation_id: str
    tenant_id: str
    principal_id: str
    share: CgroupShare
    rules: tuple[DeviceRule, ...]
    devices: tuple[str, ...]
    unenforced: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    end: int = 0  # the window's end (reported, so the control plane knows an extension reached this node)
    awaiting: bool = False  # the control plane has not heard `bound` for this end: report it again (not compared)

    @property
    def fingerprint(self) -> str:
        doc = {"share": self.share.to_dict(), "rules": [str(r) for r in self.rules]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def refusal(binding: Binding, *, kubernetes: bool = False) -> str | None:
    """Why this agent will not make a binding of this kind (None: it will). kubernetes: the agent serves device
    plugins (agent/kubernetes.py), which make kubernetes bindings."""
    if binding.kind in SUPPORTED_KINDS or (kubernetes and binding.kind == "kubernetes"):
        return None
    if binding.kind == "node":
        return ("node bindings are off on this agent: start it with --ssh-keys-dir (the directory sshd's "
                "AuthorizedKeysFile names; docs/node-binding.md)")
    if binding.kind == "kubernetes":
        return "kubernetes bindings are off on this agent (it serves no device plugins)"
    return f"binding kind {binding.kind!r} is unknown to this agent (it makes: {', '.join(SUPPORTED_KINDS)})"


def _find_unit(inv: Inventory, unit) -> tuple[Gpu, MigDevice | None]:
    if unit.uuid:
        for g in inv.gpus:
            if g.uuid == unit.uuid:
                return g, None
            for m in g.migDevices:
                if m.uuid == unit.uuid:
                    return g, m
    if unit.gpuIndex is not None and not (unit.uuid or "").startswith("MIG-"):
        for g in inv.gpus:
            if g.index == unit.gpuIndex:
                if unit.uuid and g.uuid != unit.uuid:
                    break
                return g, None
    name = unit.uuid or (f"index {unit.gpuIndex}" if unit.gpuIndex is not None else unit.unit)
    raise BindError(f"unit {unit.unit or name}: GPU {name} is not in this host's inventory "
                    f"({len(inv.gpus)} GPU(s): {', '.join(g.uuid for g in inv.gpus) or 'none'})")


def devices_of(binding: Binding, inv: Inventory) -> tuple[list[int], list[int]]:
    """GPU minors and MIG cap minors of the binding's units."""
    minors: set[int] = set()
    caps: list[int] = []
    for unit in binding.units:
        gpu, mig = _find_unit(inv, unit)
        if unit.migProfile and mig is None:
            raise BindError(f"unit {unit.unit}: a MIG unit ({unit.migProfile}) must name its MIG device uuid; "
                            f"got {unit.uuid!r}")
        minors.add(gpu.minor)
        if mig is not None:
            if mig.capMinors.gi is None or mig.capMinors.ci is None:
                raise BindError(f"unit {unit.unit}: no /proc/driver/nvidia-caps/mig-minors entry for "
                                f"{mig.uuid} (gi {mig.gpuInstanceId}, ci {mig.computeInstanceId}); cannot allow its "
                                "cap devices")
            caps += [mig.capMinors.gi, mig.capMinors.ci]
    return sorted(minors), sorted(set(caps))


def device_paths(minors: list[int], caps: list[int]) -> tuple[str, ...]:
    out = [f"/dev/nvidia{m}" for m in minors]
    out += ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    out += [f"/dev/nvidia-caps/nvidia-cap{c}" for c in caps]
    return tuple(out)


def _numa_cpus(inv: Inventory, nodes: list[int]) -> str | None:
    by_node = {n.node: n.cpus for n in inv.cpus.numaNodes}
    cpus: set[int] = set()
    for n in nodes:
        text = by_node.get(n)
        if not text:
            return None
        cpus.update(parse_cpulist(text))
    return format_cpulist(frozenset(cpus)) if cpus else None


def want_of(binding: Binding, host: HostView) -> Want:
    """The Want of a hold binding on this host; BindError when it cannot be made."""
    why = refusal(binding)
    if why:
        raise BindError(why)
    inv = host.inventory
    if not binding.units:
        raise BindError("the binding names no units")
    minors, caps = devices_of(binding, inv)
    try:
        rules = normalise(harmless_rules() + nvidia_rules(minors, caps, proc=host.devices_proc))
    except CgroupError as exc:
        raise BindError(str(exc)) from None
    enforced = host.enforced
    s = binding.share
    unenforced: list[str] = []
    notes: list[str] = []
    vcpu_milli = memory = cpus = mems = None
    hugepages = 0
    if s.vcpuMilli:
        if "cpu" not in enforced:
            unenforced.append(f"cpu (vcpuMilli {s.vcpuMilli})")
        elif host.simulated_cpus and host.real_cpus and s.vcpuMilli > host.real_cpus * 1000:
            vcpu_milli = host.real_cpus * 1000
            notes.append(f"vcpuMilli {s.vcpuMilli} capped at this host's {host.real_cpus} real CPUs (--simulate)")
        else:
            vcpu_milli = s.vcpuMilli
    if s.memoryMiB:
        want_bytes = s.memoryMiB * MIB
        if "memory" not in enforced:
            unenforced.append(f"memory (memoryMiB {s.memoryMiB})")
        elif host.simulated_memory and host.real_memory_bytes and want_bytes > host.real_memory_bytes:
            memory = host.real_memory_bytes
            notes.append(f"memoryMiB {s.memoryMiB} capped at this host's real {host.real_memory_bytes // MIB} MiB "
                         "(--simulate)")
        else:
            memory = want_bytes
    if s.hugepages1Gi:
        if "hugetlb" not in enforced:
            unenforced.append(f"hugetlb (hugepages1Gi {s.hugepages1Gi})")
        elif host.simulated_hugepages and s.hugepages1Gi > host.real_hugepages_1g:
            hugepages = host.real_hugepages_1g
            notes.append(f"hugepages1Gi {s.hugepages1Gi} capped at this host's real {host.real_hugepages_1g} "
                         "(--simulate)")
        else:
            hugepages = s.hugepages1Gi
    if binding.numaNodes:
        nodes = sorted(set(binding.numaNodes))
        if "cpuset" not in enforced:
            unenforced.append(f"cpuset (numaNodes {nodes})")
        elif host.simulated_cpus:
            notes.append(f"cpuset for numaNodes {nodes} not pinned: the simulated CPUs do not exist on this host")
        else:
            cpus = _numa_cpus(inv, nodes)
            if cpus is None:
                raise BindError(f"numaNodes {nodes}: the inventory lists no CPUs for them "
                                f"(nodes: {[n.node for n in inv.cpus.numaNodes]})")
            near = len(parse_cpulist(cpus))
            if vcpu_milli is not None and vcpu_milli > near * 1000:
                # The booked share comes first: the GPUs' nodes are a preference, and pinning to them would make a
                # booking the control plane placed (sized from the whole host) fail to bind for its whole window.
                notes.append(f"cpuset not pinned to numaNodes {nodes}: their {near} CPUs are fewer than the share's "
                             f"{vcpu_milli / 1000:g} vcpu, so the workload may run on any CPU of the host")
                cpus = None
            else:
                mems = format_cpulist(frozenset(nodes))
    try:
        share = CgroupShare(vcpu_milli=vcpu_milli, memory_bytes=memory, hugepages_1g=hugepages, cpus=cpus, mems=mems)
    except InvalidShare as exc:
        raise BindError(f"share {s}: {exc}") from None
    return Want(binding.reservationId, binding.tenantId, binding.principalId, share, rules,
                device_paths(minors, caps), tuple(unenforced), tuple(notes), binding.end, binding.awaitingBound)


def simulated_devices_proc(real_proc: Path, into: Path) -> Path:
    """A directory with a `devices` file: this host's /proc/devices plus the nvidia-uvm and nvidia-caps majors
    a driver would register (for --simulate on a host without the driver). Returns `into`."""
    majors = read_proc_devices(real_proc)
    lines = ["Character devices:"]
    taken = set(majors.values())
    for name, major in sorted(majors.items(), key=lambda kv: kv[1]):
        lines.append(f"{major:3d} {name}")
    for name, major in SIMULATED_MAJORS.items():
        if name not in majors:
            while major in taken:
                major -= 1
            taken.add(major)
            lines.append(f"{major:3d} {name}")
    lines += ["", "Block devices:", ""]
    into.mkdir(parents=True, exist_ok=True)
    (into / "devices").write_text("\n".join(lines))
    return into
