"""The stand-in libnvidia-ml.so.1: build it from fake_nvml.c with gcc, and write the topology file it answers from.

The topology is the JSON format of `berth agent discover --simulate`,
expanded by `agent.simulate.expand` (one definition of UUIDs, bus ids, MIG
slots and placements) into the line format fake_nvml.c reads, with the GPU
instance profiles each MIG GPU offers and the compute processes that hold a
GPU. `tenant` (tests/agent/fake_nvml/tenant.py) changes a MIG layout the way
a tenant with root would, through pynvml.
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
CALLS_ENV = "BERTH_FAKE_NVML_CALLS"  # where the stand-in writes the calls that changed a GPU
LAYOUT_SUFFIX = ".layout"  # beside the topology: the MIG layout as the calls left it (fake_nvml.c)
LIBRARY_NAME = "libnvidia-ml.so.1"
NO_ID = 0xFFFFFFFF
EVENT_XID = 0x8
EVENT_DBE = 0x2
_epochs = itertools.count(int.from_bytes(os.urandom(4), "big") << 16)


# The GPU instance profiles every MIG GPU offers, by NVML_GPU_INSTANCE_PROFILE_* index (an 80 GB part's).
STANDARD_PROFILES = {0: "1g.10gb", 1: "2g.20gb", 2: "3g.40gb", 3: "4g.40gb", 4: "7g.80gb"}
_FIRST_EXTRA_PROFILE = 7  # where profiles of the topology that are not standard go (the REV1/REV2 indexes)


@dataclass(frozen=True)
class Process:
    """A compute process holding a GPU (nvmlDeviceGetComputeRunningProcesses)."""

    gpu: int
    pid: int
    used_mib: int = 1024
    gi: int = NO_ID
    ci: int = NO_ID


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


def gi_profile_name(profile: str) -> str:
    """The GPU instance profile of a MIG profile ("1c.3g.40gb" -> "3g.40gb": a compute instance of a 3g GPU
    instance)."""
    return profile.split("c.", 1)[1] if "c." in profile else profile


def gi_profiles(gpu: simulate.SimGpu) -> dict[int, str]:
    """The GPU instance profiles the stand-in offers on a MIG GPU: the standard ones and the topology's others."""
    table = dict(STANDARD_PROFILES)
    for m in gpu.mig:
        name = gi_profile_name(m.profile)
        if name not in table.values():
            table[max(_FIRST_EXTRA_PROFILE - 1, *table) + 1] = name
    return table


def render(topology: dict | simulate.Topology, *, mode: str = "ok", events: list[Event] = (),
           power: dict[int, tuple[int, int]] | None = None, processes: list[Process] = ()) -> str:
    """The topology's lines; `power`: GPU index -> (default limit, limit) in mW, for the GPUs that have one."""
    top = topology if isinstance(topology, simulate.Topology) else simulate.parse(json.dumps(topology))
    lines = [f"epoch {next(_epochs)}", f"mode {mode}", f"driver {top.driver.version} {top.driver.cuda}"]
    for g in simulate.expand(top):
        lines.append(f"gpu {g.index} {g.minor} {g.memory_mib} {int(g.mig_capable)} {int(g.mig_current)} "
                     f"{int(g.mig_pending)} {int(g.lost)} {g.uuid} {g.pci_bus_id} {g.name}")
        if not g.mig_capable:
            continue
        profiles = gi_profiles(g)
        for index, name in sorted(profiles.items()):
            lines.append(f"giprofile {g.index} {index} {simulate.profile_slices(name)} "
                         f"{simulate.profile_memory_mib(name)} {name}")
        by_name = {name: index for index, name in profiles.items()}
        for m in g.mig:
            gi_name = gi_profile_name(m.profile)
            ci_slices = int(m.profile.split("c.", 1)[0]) if "c." in m.profile else m.placement_size
            lines.append(f"mig {g.index} {m.slot} {m.gpu_instance_id} {m.compute_instance_id} {m.memory_mib} "
                         f"{by_name[gi_name]} {m.placement_start} {m.placement_size} {ci_slices} {m.uuid} {m.name}")
    for p in processes:
        lines.append(f"proc {p.gpu} {p.pid} {p.used_mib} {p.gi} {p.ci}")
    for e in events:
        lines.append(f"event {e.gpu} {e.type} {e.data} {e.gi} {e.ci}")
    for gpu, (default_mw, limit_mw) in sorted((power or {}).items()):
        lines.append(f"power {gpu} {default_mw} {limit_mw}")
    return "\n".join(lines) + "\n"


def write(path: Path, topology: dict | simulate.Topology, **kwargs) -> Path:
    """Write the topology (a new epoch: the MIG layout left by earlier calls no longer applies)."""
    path.write_text(render(topology, **kwargs))
    return path
