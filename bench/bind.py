"""Bench: how long the kernel boundary takes to bind and unbind a share, over many cgroups on the real cgroup2.

apply = mkdir + record + limits + device program attached + one process moved in,
in cgroup2 and, on a hybrid host, in each v1 hierarchy that enforces part of the
share (cpu, cpuset, memory, the devices list); remove = cgroup.kill + wait until
empty + rmdir in every hierarchy. Prints medians and p99, and the median apply
cost of the first 10 against the last 10 cgroups (it should not grow with the
number that already exist). Everything is made below a fresh directory under this
process's own cgroup in each hierarchy and removed at the end.

    python bench/bind.py [--count 100]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cgroups import bpf, host, probe_layout  # noqa: E402
from cgroups.devices import harmless_rules, rule  # noqa: E402
from cgroups.share import CgroupShare  # noqa: E402
from cgroups.tree import ALL_CONTROLLERS, Subtree  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def show(label: str, values: list[float]) -> str:
    ms = [v * 1e3 for v in values]
    return f"{label:<22} median {statistics.median(ms):7.3f} ms   p99 {pct(ms, 0.99):7.3f} ms   max {max(ms):7.3f} ms"


def progress(i: int, n: int, what: str) -> None:
    if sys.stderr.isatty():
        print(f"\r{what} {i + 1}/{n}", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)


def restore(own: Path, controllers: list[str], timeout: float = 5.0) -> None:
    """Switch off what the bench switched on; EBUSY lasts while removed cgroups are still dying."""
    deadline = time.monotonic() + timeout
    for c in controllers:
        while True:
            try:
                (own / "cgroup.subtree_control").write_text(f"-{c}")
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    print(f"left {c} enabled in {own}: {exc}", file=sys.stderr)
                    break
                time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="cgroups bound, at least 20 (default 100)")
    args = parser.parse_args()
    if args.count < 20:
        parser.error("--count: at least 20 (the first 10 binds are compared with the last 10)")
    if os.geteuid() != 0:
        print("bench/bind.py needs root (cgroup writes and bpf)", file=sys.stderr)
        return 2
    mount = host.cgroup2_mount()
    if mount is None:
        print("cgroup2 is not mounted", file=sys.stderr)
        return 2
    own = mount / host.own_cgroup2().lstrip("/")
    offered = set((own / "cgroup.controllers").read_text().split())
    layout = probe_layout()
    controllers = tuple(c for c in ALL_CONTROLLERS if c in offered or layout.place(c) == "v1")
    enabled_before = set((own / "cgroup.subtree_control").read_text().split())
    root = own / f"berth-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    st = Subtree(root, controllers=controllers, enable_from=own if host.own_cgroup2() == "/" else None)
    share = CgroupShare(vcpu_milli=1000, memory_bytes=4 << 30, hugepages_1g=0)
    gpu_rules = [rule("c", 195, 0, "rw"), rule("c", 195, 255, "rw"), rule("c", 510, 0, "rw"), rule("c", 510, 1, "rw")]
    rules = list(harmless_rules()) + gpu_rules
    sleepers = [subprocess.Popen(["sleep", "300"]) for _ in range(args.count)]
    names = [f"rsv-bench{i:04d}" for i in range(args.count)]
    apply_s, reapply_s, remove_s = [], [], []
    try:
        st.prepare()
        bpf.has_prog_replace(), bpf.tag_algorithm()  # the one-off probes, so they are not in the first apply
        st.apply("rsv-warmup", share, rules)  # and one cgroup made and removed untimed
        st.remove("rsv-warmup")
        for i, (name, p) in enumerate(zip(names, sleepers)):
            t0 = time.perf_counter()
            st.apply(name, share, rules)
            st.move(name, p.pid)
            apply_s.append(time.perf_counter() - t0)
            progress(i, args.count, "apply")
        for name in names:
            t0 = time.perf_counter()
            st.apply(name, share, rules)
            reapply_s.append(time.perf_counter() - t0)
        for i, name in enumerate(names):
            t0 = time.perf_counter()
            st.remove(name, timeout=10.0)
            remove_s.append(time.perf_counter() - t0)
            progress(i, args.count, "remove")
    finally:
        for p in sleepers:
            if p.poll() is None:
                p.kill()
            p.wait()
        for name in names:
            if (root / name).exists():
                st.remove(name, timeout=10.0)
        st.remove_roots()
        if st.enable_from is not None:
            restore(own, [c for c in controllers if layout.place(c) == "v2" and c not in enabled_before])
    first, last = statistics.median(apply_s[:10]), statistics.median(apply_s[-10:])
    where = ", ".join(f"{c} ({p})" for c, p in st.places.items()) or "none"
    print(f"bench/bind.py: {args.count} cgroups below {own} (enforced: {where}; "
          f"{len(rules)} device rules; kernel {os.uname().release})")
    print(show("apply (bind)", apply_s))
    print(show("re-apply (no change)", reapply_s))
    print(show("remove (kill+rmdir)", remove_s))
    print(f"apply median, first 10 {first * 1e3:.3f} ms, last 10 {last * 1e3:.3f} ms: ratio {last / first:.2f} "
          f"(with {args.count - 10} cgroups already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
