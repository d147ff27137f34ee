"""The stand-in libnvidia-ml.so.1: build it from fake_nvml.c with gcc, and write the topology file it answers from.

The topology is the JSON format of `berth agent discover --simulate`,
expanded by `agent.simulate.expand` (one definition of UUIDs, bus ids, MIG
slots) into the line format fake_nvml.c reads.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agent import simulate

SOURCE = Path(__file__).with_name("fake_nvml.c")
TOPOLOGY_ENV = "BERTH_FAKE_NVML_TOPOLOGY"
CALLS_ENV = "BERTH_FAKE_NVML_CALLS"  # where the stand-in writes the reset calls it was given
LIBRARY_NAME = "libnvidia-ml.so.1"
NO_ID = 0xFFFFFFFF
EVENT_XID = 0x8
EVENT_DBE = 0x2
_epochs = itertools.count(int.from_bytes(os.urandom(4), "big") << 16)


@dataclass(frozen=True)
class Event:
    gpu: int
    type: int = EVENT_XID
    data: int = 0  # the XID for an XID event
    gi: int = NO_ID
    ci: int = NO_ID


def build(out_dir: Path) -> Path:
    """Compile the stand-in into out_dir/libnvidia-ml.so.1 (soname libnvidia-ml.so.1); RuntimeError without gcc."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc is not installed")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIBRARY_NAME
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-Wall", f"-Wl,-soname,{LIBRARY_NAME}",
                    "-o", str(lib), str(SOURCE), "-lpthread"], check=True, capture_output=True, text=True)
    return lib


def render(topology: dict | simulate.Topology, *, mode: str = "ok", events: list[Event] = (),
           power: dict[int, tuple[int, int]] | None = None) -> str:
    """The topology's lines; `power`: GPU index -> (default limit, limit) in mW, for the GPUs that have one."""
    top = topology if isinstance(topology, simulate.Topology) else simulate.parse(json.dumps(topology))
    lines = [f"epoch {next(_epochs)}", f"mode {mode}", f"driver {top.driver.version} {top.driver.cuda}"]
    for g in simulate.expand(top):
        lines.append(f"gpu {g.index} {g.minor} {g.memory_mib} {int(g.mig_capable)} {int(g.mig_current)} "
                     f"{int(g.mig_pending)} {int(g.lost)} {g.uuid} {g.pci_bus_id} {g.name}")
        for m in g.mig:
            lines.append(f"mig {g.index} {m.slot} {m.gpu_instance_id} {m.compute_instance_id} {m.memory_mib} "
                         f"{m.uuid} {m.name}")
    for e in events:
        lines.append(f"event {e.gpu} {e.type} {e.data} {e.gi} {e.ci}")
    for gpu, (default_mw, limit_mw) in sorted((power or {}).items()):
        lines.append(f"power {gpu} {default_mw} {limit_mw}")
    return "\n".join(lines) + "\n"


def write(path: Path, topology: dict | simulate.Topology, **kwargs) -> Path:
    path.write_text(render(topology, **kwargs))
    return path
