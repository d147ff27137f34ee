"""Interleaved A/B: creates per second of one replica on PostgreSQL from two source trees, in one run.

    python bench/ab.py A B [--pairs 16] [--seconds 3] [--connections 32] [--env-b NAME=VALUE ...]

A and B are git revisions of this repository (each checked out into a temporary worktree, removed after) or
directories holding a tree. Both servers (`berth controlplane serve` run from each tree, with bench/replicas.py's
fleet) stay up on their own database of one throwaway PostgreSQL cluster; each pair measures one after the other,
in alternating order, and the figure is the median of the pairs' ratios B/A, with the lowest and highest. This
machine's speed drifts by 10-20% over minutes, so a change worth a few percent cannot be seen by two runs of
bench/replicas.py minutes apart; pairs of short runs seconds apart can. `--env-b` sets an environment variable
for B's server only (an experiment switched by a variable, or a `PYTHONPATH` with a `sitecustomize.py`).

Also printed: each side's CPU per create (server, PostgreSQL, load clients), its creates per commit and share of
speculative commits. Every create has its own idempotency key and window; a run with errors says so and exits 1
(a refused create costs less than a placed one, so its ratio would mislead). Needs what bench/replicas.py needs.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import create_throughput as ct  # noqa: E402  (the load client and the server helpers)
import replicas as rb  # noqa: E402  (the fleet, the counters and the CPU accounting)

from tests import worktree  # noqa: E402  (another revision's tree)


PAIR_CREATES = 200_000  # windows each pair's measurements book from (rb.ROUND_CREATES: the horizon's arithmetic)
MAX_PAIRS = (rb.MAX_ROUNDS * rb.ROUND_CREATES) // PAIR_CREATES - 1


def tree(spec: str, stack: contextlib.ExitStack) -> Path:
    """A directory holding the tree `spec` names: itself, or a worktree of the revision (removed at exit)."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
                         capture_output=True, text=True)
    if rev.returncode:
        raise SystemExit(f"bench/ab.py: {spec!r} is neither a directory nor a revision of {ROOT}")
    return worktree.checkout(rev.stdout.strip(), stack)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="git revision or directory: the reference")
    parser.add_argument("b", help="git revision or directory: the change")
    parser.add_argument("--pairs", type=int, default=16, help=f"default 16, at most {MAX_PAIRS}")
    parser.add_argument("--seconds", type=float, default=3, help="of each measurement (default 3)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for B's server only")
    args = parser.parse_args()
    if not 1 <= args.pairs <= MAX_PAIRS:
        parser.error(f"--pairs: from 1 to {MAX_PAIRS} (each pair books its own windows, and a create's start must "
                     "lie within 366 days)")
    env_b = {}
    for item in args.env_b:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env-b: {item!r} is not NAME=VALUE")
        env_b[name] = value
    start = (int(time.time()) // 3600 + 1) * ct.HOUR
    measured: dict[str, list[dict]] = {"A": [], "B": []}
    ratios: list[float] = []
    with contextlib.ExitStack() as stack:
        roots = {"A": tree(args.a, stack), "B": tree(args.b, stack)}
        cluster, boot = rb.cluster_with_fleet(stack, "bench/ab.py")
        servers = {}
        for side, root in roots.items():
            port = ct.free_port()
            proc = ct.serve_berth(cluster.createdb(side.lower()), boot, port, root, env_b if side == "B" else None)
            url = f"http://127.0.0.1:{port}"
            stack.callback(ct.stop, proc)
            servers[side] = (proc, url)
            rb.measure([url], 1, args.connections, f"{side} warm-up", start, 0)
        for i in range(args.pairs):
            rps = {}
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                proc, url = servers[side]
                before = rb.counters(url)
                m = rb.measure([url], args.seconds, args.connections, f"pair {i + 1}/{args.pairs}: {side}", start,
                               (i + 1) * PAIR_CREATES, [proc], cluster)
                after = rb.counters(url)
                m.update({k: after[k] - before[k] for k in after})
                measured[side].append(m)
                rps[side] = m["rps"]
            ratios.append(rps["B"] / rps["A"])
            print(f"pair {i + 1:>2}: A {rps['A']:>7,.0f}/s  B {rps['B']:>7,.0f}/s  B/A {ratios[-1]:.3f}", flush=True)
    print(f"\nB/A: {statistics.median(ratios):.3f} (median of {len(ratios)} pairs; lowest {min(ratios):.3f}, "
          f"highest {max(ratios):.3f})")
    print(f"{'':3} {'creates/s':>10} {'server µs':>10} {'postgres µs':>12} {'clients µs':>11} {'jobs/commit':>12} "
          f"{'speculative':>12} {'errors':>7}")
    errors = 0
    for side, ms in measured.items():
        n = max(1, sum(m["requests"] for m in ms))
        groups = sum(m["berth_store_groups_total"] for m in ms)
        jobs = sum(m["berth_store_jobs_total"] for m in ms)
        speculative = sum(m["berth_store_speculative_groups_total"] for m in ms)
        errors += sum(m["errors"] for m in ms)
        print(f"{side:3} {statistics.median(m['rps'] for m in ms):>10,.0f} "
              f"{sum(m['cpu_server'] for m in ms) / n * 1e6:>10.0f} {sum(m['cpu_postgres'] for m in ms) / n * 1e6:>12.0f} "
              f"{sum(m['cpu_clients'] for m in ms) / n * 1e6:>11.0f} {jobs / max(1, groups):>12.1f} "
              f"{speculative / max(1, groups):>12.0%} {sum(m['errors'] for m in ms):>7.0f}")
    if errors:
        print("bench/ab.py: some creates were refused; the ratio above does not compare like with like",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
