"""One-shot, read-only discovery on a real GPU machine, for the record in docs/discovery.md.

Runs `berth agent discover` (table and JSON) against the real NVML, times
20 in-process discoveries, watches NVML XID/ECC events for a few seconds,
and prints what nvidia-smi says in read-only query mode next to it, so the
two can be compared. It changes no GPU setting: only queries (no -mig,
-pm, -r, -c, -lgc or any other setter), and the event set it registers is
freed at the end.

    python bench/real_gpu_discovery.py [--out DIR] [--watch-seconds 3]

Writes DIR/real-gpu-discovery.md (default: $OUT if set, else ./real-gpu-run)
plus inventory.json; prints the same report on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READ_ONLY_QUERIES = [
    ["nvidia-smi", "-L"],
    ["nvidia-smi", "--query-gpu=index,uuid,name,pci.bus_id,memory.total,mig.mode.current,mig.mode.pending,"
                   "driver_version", "--format=csv"],
    ["nvidia-smi", "mig", "-lgi"],
    ["nvidia-smi", "mig", "-lci"],
    ["nvidia-smi", "topo", "-m"],
]


def _run(cmd: list[str], timeout: float = 60) -> str:
    if shutil.which(cmd[0]) is None and not cmd[0].startswith(sys.executable):
        return f"({cmd[0]} not found)"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({' '.join(cmd)} failed: {exc})"
    text = out.stdout + (("\n[stderr]\n" + out.stderr) if out.stderr.strip() else "")
    return text.rstrip() + (f"\n[exit {out.returncode}]" if out.returncode else "")


def _read(path: str, limit: int = 40) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        return f"({path}: {exc.strerror})"
    return "\n".join(lines[:limit]) + (f"\n... ({len(lines)} lines)" if len(lines) > limit else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "real-gpu-run")
    p.add_argument("--watch-seconds", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    berth = [sys.executable, "-m", "berth", "agent", "discover"]
    sections: list[tuple[str, str]] = []

    sections.append(("machine", f"{platform.platform()}, python {platform.python_version()}, "
                                f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"))
    sections.append(("berth agent discover", _run(berth)))
    done = subprocess.run(berth + ["--json"], capture_output=True, text=True, timeout=120)
    (out_dir / "inventory.json").write_text(done.stdout)
    try:
        doc = json.loads(done.stdout)
        pretty = json.dumps(doc, indent=2)
    except ValueError:
        doc, pretty = None, done.stdout
    sections.append((f"berth agent discover --json (exit {done.returncode})",
                     pretty + (f"\n[stderr]\n{done.stderr.strip()}" if done.stderr.strip() else "")))

    from common import logs

    logs.configure(fmt="console", level="warning", stream=sys.stderr)
    from agent.discovery import Discovery
    from agent.health import HealthPolicy, XidWatcher
    from agent.host import KernelHost
    from agent.nvml import NvmlEvents, NvmlGpus

    discovery = Discovery(gpus=NvmlGpus(), host=KernelHost())
    samples = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        inv = discovery.discover()
        samples.append((time.perf_counter() - t0) * 1000)
    migs = sum(len(g.migDevices) for g in inv.gpus)
    sections.append(("timing", f"{args.runs} discoveries: median {statistics.median(samples):.2f} ms, "
                               f"first {samples[0]:.2f} ms, max {max(samples):.2f} ms "
                               f"({len(inv.gpus)} GPUs, {migs} MIG devices, driver {inv.driver.status})"))

    if inv.driver.status == "ok":
        policy = HealthPolicy()
        try:
            with NvmlEvents() as events:
                watcher = XidWatcher(events, policy, timeout_ms=500)
                deadline = time.monotonic() + args.watch_seconds
                while time.monotonic() < deadline:
                    watcher.poll()
                unwatched = dict(events.unwatched)
            marks = [(m.target, m.xid, m.reason) for m in policy.marks()]
            sections.append(("XID watcher", f"watched {args.watch_seconds:g} s; unwatched GPUs: {unwatched or 'none'}; "
                                            f"marks: {marks or 'none'}"))
        except Exception as exc:  # record, never fail the run
            sections.append(("XID watcher", f"failed: {exc}"))

    for cmd in READ_ONLY_QUERIES:
        sections.append((" ".join(cmd), _run(cmd)))
    sections.append(("/proc/driver/nvidia-caps/mig-minors (head)", _read("/proc/driver/nvidia-caps/mig-minors")))
    if doc:
        numa = [f"{g['pciBusId']}: inventory numaNode {g['numaNode']}" for g in doc.get("gpus", [])]
        sections.append(("GPU NUMA nodes", "\n".join(numa) or "(no GPUs)"))
        smi = _run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
        ours = sorted(g["uuid"] for g in doc.get("gpus", []))
        theirs = sorted(line.strip() for line in smi.splitlines() if line.strip().startswith("GPU-"))
        sections.append(("comparison", f"GPU UUIDs agree with nvidia-smi: {ours == theirs} "
                                       f"({len(ours)} ours, {len(theirs)} nvidia-smi)"))

    report = "\n\n".join(f"### {title}\n\n```\n{body}\n```" for title, body in sections) + "\n"
    (out_dir / "real-gpu-discovery.md").write_text(report)
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
