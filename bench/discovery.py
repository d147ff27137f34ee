"""How long one discovery of an 8-GPU MIG host takes (8 x A100 80GB, each 7 x 1g.10gb: 56 MIG devices).

Two backends: the simulated one (--simulate, no NVML) and the real
nvidia-ml-py ctypes path against the stand-in libnvidia-ml.so.1 of the test
suite (built here with gcc). Each figure is the median of N full discoveries
(GPUs, MIG devices and cap minors, CPUs, NUMA, memory, hugepages of this
host); progress goes to stderr, the table to stdout.

    python bench/discovery.py [--runs 50]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPOLOGY = {
    "hostname": "bench-a100-mig-x8",
    "driver": {"version": "550.54.15", "cuda": 12040},
    "gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "count": 8, "numaNodes": [0, 0, 0, 0, 1, 1, 1, 1],
              "mig": {"profile": "1g.10gb", "count": 7}}],
}


def _median_ms(label: str, fn, runs: int) -> tuple[float, float, object]:
    samples, result = [], None
    for i in range(runs):
        t0 = time.perf_counter()
        result = fn()
        samples.append((time.perf_counter() - t0) * 1000)
        if (i + 1) % max(1, runs // 5) == 0:
            print(f"  {label}: {i + 1}/{runs}", file=sys.stderr)
    return statistics.median(samples), max(samples), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50)
    args = p.parse_args(argv)

    from common import logs

    logs.configure(fmt="console", level="warning", stream=sys.stderr)
    from agent import mig_minors
    from agent.discovery import Discovery
    from agent.host import KernelHost
    from agent.nvml import NvmlGpus
    from agent.simulate import SimulatedGpus, SimulatedHost
    from tests.agent import fake_nvml

    rows = []
    with tempfile.TemporaryDirectory(prefix="berth-bench-") as tmp:
        tmp = Path(tmp)
        topo = tmp / "topology.json"
        topo.write_text(json.dumps(TOPOLOGY))

        print("simulated backend", file=sys.stderr)
        sim = SimulatedGpus(topo)
        first = time.perf_counter()
        Discovery(gpus=sim, host=SimulatedHost(sim)).discover()
        cold = (time.perf_counter() - first) * 1000
        med, worst, inv = _median_ms("simulate", Discovery(gpus=sim, host=SimulatedHost(sim)).discover, args.runs)
        rows.append(("simulate (--simulate)", cold, med, worst, inv))

        print("stand-in NVML backend: building libnvidia-ml.so.1 with gcc", file=sys.stderr)
        lib = fake_nvml.build(tmp / "lib")
        fake_nvml.write(tmp / "fake-topology.txt", TOPOLOGY)
        os.environ[fake_nvml.TOPOLOGY_ENV] = str(tmp / "fake-topology.txt")
        proc = tmp / "proc"
        (proc / "driver/nvidia-caps").mkdir(parents=True)
        (proc / "driver/nvidia-caps/mig-minors").write_text(mig_minors.render(range(8)))
        nv = Discovery(gpus=NvmlGpus(library=str(lib), proc_root=str(proc)), host=KernelHost())
        first = time.perf_counter()
        nv.discover()
        cold = (time.perf_counter() - first) * 1000
        med, worst, inv = _median_ms("stand-in", nv.discover, args.runs)
        rows.append(("stand-in libnvidia-ml.so.1 via pynvml", cold, med, worst, inv))

    print(f"discovery of {TOPOLOGY['gpus'][0]['count']} x A100 80GB with 7 x 1g.10gb each, {args.runs} runs")
    print(f"{'backend':40} {'GPUs':>4} {'MIG':>4} {'first ms':>9} {'median ms':>10} {'max ms':>8}")
    for name, cold, med, worst, inv in rows:
        migs = sum(len(g.migDevices) for g in inv.gpus)
        print(f"{name:40} {len(inv.gpus):>4} {migs:>4} {cold:>9.2f} {med:>10.2f} {worst:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
