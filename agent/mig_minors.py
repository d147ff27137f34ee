"""MIG capability minors: which /dev/nvidia-caps/nvidia-capN guards each GPU instance and compute instance.

Source: /proc/driver/nvidia-caps/mig-minors, lines "config 1", "monitor 2",
"gpu<G>/gi<I>/access <minor>", "gpu<G>/gi<I>/ci<C>/access <minor>", where G
is the GPU's minor number (its /dev/nvidiaG). Read again on every discovery:
the table is the driver's, and a repartitioned GPU is looked up afresh.
`render` writes the table the way the driver lays it out, for simulated
hosts and test trees.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from common.hostfacts import HostReadError, read_optional

_LINE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access$")
# The driver's layout: 15 GPU instance ids, each with 8 compute instance ids, after config and monitor.
GI_IDS, CI_IDS = 15, 8
_PER_GPU = GI_IDS * (1 + CI_IDS)


@dataclass(frozen=True, slots=True)
class MigMinors:
    config: int | None = None
    monitor: int | None = None
    # (gpu minor, gi id, ci id or None) -> cap minor
    access: dict[tuple[int, int, int | None], int] = field(default_factory=dict)
    present: bool = False

    def gi(self, gpu_minor: int, gi: int) -> int | None:
        return self.access.get((gpu_minor, gi, None))

    def ci(self, gpu_minor: int, gi: int, ci: int) -> int | None:
        return self.access.get((gpu_minor, gi, ci))


def parse(text: str, path: str = "mig-minors") -> MigMinors:
    config = monitor = None
    access: dict[tuple[int, int, int | None], int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or not parts[1].isdigit():
            raise HostReadError(path, f"line {n}: expected '<name> <minor>', found {line[:60]!r}")
        name, minor = parts[0], int(parts[1])
        if name == "config":
            config = minor
        elif name == "monitor":
            monitor = minor
        elif m := _LINE.match(name):
            gpu, gi, ci = m.groups()
            access[(int(gpu), int(gi), int(ci) if ci is not None else None)] = minor
        # other capability names (future driver additions) are not ours to interpret
    return MigMinors(config=config, monitor=monitor, access=access, present=True)


def read_mig_minors(proc_root: str = "/proc") -> MigMinors:
    """The driver's table; an empty one (present=False) when the driver publishes none (no MIG support)."""
    path = os.path.join(proc_root, "driver/nvidia-caps/mig-minors")
    text = read_optional(path, None, "NVIDIA MIG capabilities (nvidia-caps)")
    return MigMinors() if text is None else parse(text, path)


def driver_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The minor the driver gives gpu<G>/gi<I>[/ci<C>]/access: 3 + 135*G + 9*I (+ 1 + C)."""
    base = 3 + _PER_GPU * gpu_minor + (1 + CI_IDS) * gi
    return base if ci is None else base + 1 + ci


def render(gpu_minors: range | list[int]) -> str:
    """The table as the driver writes it for these GPU minors (for simulated hosts and test trees)."""
    lines = ["config 1", "monitor 2"]
    for g in gpu_minors:
        for gi in range(GI_IDS):
            lines.append(f"gpu{g}/gi{gi}/access {driver_minor(g, gi)}")
            lines.extend(f"gpu{g}/gi{gi}/ci{ci}/access {driver_minor(g, gi, ci)}" for ci in range(CI_IDS))
    return "\n".join(lines) + "\n"
