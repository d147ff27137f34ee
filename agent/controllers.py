"""Which cgroup controllers this host lets the agent enforce, and for each missing one the host setting to change.

The agent probes once at start. A controller on cgroup2 is enforceable when
it is offered at the top of the subtree it may write (its `enable_from`
cgroup, or the workloads root, or for a root not made yet what its parent
passes down); hugetlb is never delegated by systemd. A controller a hybrid
host keeps on a cgroup v1 hierarchy (cpu, cpuset, memory on older Ubuntu,
RHEL, DGX OS 5) is enforced there, in the reservation's directory of that
hierarchy (cgroups' v1 backend). The agent enforces what it can, says what
it cannot (log line, /metrics, /status), and every binding that asks for a
missing one is reported with it (agent.bindspec), never silently narrowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cgroups import ALL_CONTROLLERS, Layout, host, probe_layout
from cgroups.errors import CgroupError
from cgroups.files import parse_list, read_file


@dataclass(frozen=True)
class ControllerProbe:
    """What the probe found: enforced controllers, and each missing one with the setting that would add it."""

    top: Path
    enforced: tuple[str, ...]
    missing: dict[str, str] = field(default_factory=dict)  # controller -> hint
    v1: tuple[str, ...] = ()  # the enforced ones that live on a cgroup v1 hierarchy

    def _named(self) -> str:
        return ", ".join(f"{c} (v1)" if c in self.v1 else c for c in self.enforced) or "no controller"

    def summary(self) -> str:
        if not self.missing:
            return f"enforcing {self._named()} below {self.top}"
        return (f"enforcing {self._named()} below {self.top}; missing "
                f"{', '.join(self.missing)}: " + "; ".join(f"{c}: {h}" for c, h in self.missing.items()))

    def to_wire(self) -> dict:
        return {"top": str(self.top), "enforced": list(self.enforced), "v1": list(self.v1),
                "missing": dict(self.missing)}


def offered(top: Path) -> frozenset[str]:
    """The controllers a child of top's parent chain would get at `top`: its cgroup.controllers when it
    exists, else what its nearest existing ancestor passes down (cgroup.subtree_control)."""
    if top.is_dir():
        return frozenset(parse_list(read_file(top, "cgroup.controllers")))
    parent = top.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    return frozenset(parse_list(read_file(parent, "cgroup.subtree_control")))


def hint(controller: str, top: Path, *, proc: Path = Path("/proc")) -> str:
    """The host setting that would give `controller` to `top`."""
    if controller in host.v1_controllers(proc):
        return (f"{controller} is bound to a cgroup v1 hierarchy on this host (hybrid mode): boot with "
                f"systemd.unified_cgroup_hierarchy=1 (or cgroup_no_v1={controller}) to move it to cgroup v2")
    mount = host.cgroup2_mount(proc)
    try:
        at_mount = mount is not None and controller in parse_list(read_file(mount, "cgroup.controllers"))
    except CgroupError:
        at_mount = False
    if mount is not None and not at_mount:
        return f"the kernel offers no {controller} controller ({mount}/cgroup.controllers lacks it)"
    if controller == "hugetlb":
        chain = [mount] if mount is not None else []
        if mount is not None:
            for part in top.parent.relative_to(mount).parts if top.parent != mount and top.is_relative_to(mount) else ():
                chain.append(chain[-1] / part)
        where = " and ".join(f"{d}/cgroup.subtree_control" for d in chain) or "each ancestor's cgroup.subtree_control"
        return (f"systemd does not delegate hugetlb: switch it on above {top} with `echo +hugetlb > FILE` for "
                f"{where}, or start the agent with --cgroup-enable-from {mount} so it does so itself")
    return (f"{controller} is not delegated to {top}: set Delegate=yes on the unit that owns it, or enable it "
            f"in {top.parent}/cgroup.subtree_control")


def probe(top: Path, wanted: tuple[str, ...] = ALL_CONTROLLERS, *, fake: bool = False,
          proc: Path = Path("/proc"), layout: Layout | None = None) -> ControllerProbe:
    """Which of `wanted` can be enforced below `top` (on cgroup2, or on the controller's v1 hierarchy), and a hint
    for each one that cannot. fake: a hand-made cgroupfs at top, with no v1 hierarchies."""
    if layout is None and not fake:
        layout = probe_layout(proc)
    on_v1 = {c for c in wanted if layout is not None and layout.place(c) == "v1"}
    have = offered(top) | on_v1
    enforced = tuple(c for c in ALL_CONTROLLERS if c in wanted and c in have)
    missing = {}
    for c in ALL_CONTROLLERS:
        if c in wanted and c not in have:
            if fake:
                missing[c] = f"{c} is not offered at {top}"
            elif layout is not None and layout.place(c) is None and c in layout.absent:
                missing[c] = layout.why_absent(c)
            else:
                missing[c] = hint(c, top, proc=proc)
    return ControllerProbe(top, enforced, missing, tuple(c for c in enforced if c in on_v1))
