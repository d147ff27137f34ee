"""Instructions a server process spends per create, counted by valgrind's callgrind: Berth (one replica on
PostgreSQL, and on SQLite) against bench/replicas.py's baseline (an aiohttp handler doing one INSERT and commit
per request on the same PostgreSQL) and its floor (that handler without the database), in one run.

    python bench/create_cost.py [--creates 1500] [--connections 12] [--tree REV_OR_DIR] [--engine both]

Why instructions: on a shared 2-core machine the same code's creates/s and CPU seconds per create vary by 10-20%
from one run to the next, more than most changes to the server's code save. The instructions a process executes
for the same requests vary by about 1%, so a change can be measured here, and its effect on throughput read in
bench/replicas.py. They count the server's own process only (all its threads): PostgreSQL's work and the load
client's are not in them (bench/replicas.py measures those, in CPU seconds).

Each server runs under callgrind with counting off while it starts and serves a warm-up burst; counting is
switched on (callgrind_control -i on) for --creates creates sent by this process at --connections at once, and
off again. Under callgrind a server runs some 50 times slower, so every create that waits joins the next group:
--connections 12 keeps Berth's groups (creates per commit, printed) near what 32 clients give it at full speed.
--tree runs Berth's servers from a git revision (checked out into a temporary worktree, as bench/ab.py) or a
directory, to count an older release against this one (the baseline and the floor are the same code either way);
--engine counts Berth on one engine only (a release before the PostgreSQL engine: `--engine sqlite`).
Printed: thousands of instructions per create for each, and the ratio to the baseline. Needs root (the cluster
runs as `nobody`), PostgreSQL's binaries (apt-get install postgresql) and valgrind (apt-get install valgrind).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import ab  # noqa: E402  (a tree from a revision)
import create_throughput as ct  # noqa: E402  (the fleet, the token and the helpers that start servers)
import replicas  # noqa: E402  (the baseline and floor handlers, the bootstrap with an admin token, /metrics)

from tests.pgcluster import ClusterError, throwaway_cluster  # noqa: E402


async def burst(url: str, creates: int, connections: int, offset: int, start: int) -> int:
    """`creates` creates, `connections` at a time, each for a free device; how many were not accepted (202)."""
    import aiohttp

    gate = asyncio.Semaphore(connections)
    refused = 0
    headers = {"Authorization": f"Bearer {ct.TOKEN}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:
        async def one(i: int) -> None:
            nonlocal refused
            slot = (offset + i) // (ct.NODES * ct.GPUS)  # each slot holds every GPU of the fleet once
            at = start + (2 * slot + 1) * ct.HOUR
            body = {"poolId": "fleet", "gpuModel": "H100_80GB", "gpuCount": 1, "start": at, "end": at + ct.HOUR,
                    "idempotencyKey": f"cost-{offset + i}"}
            async with gate, session.post(url, data=json.dumps(body).encode(), headers=headers) as resp:
                await resp.read()
                refused += resp.status != 202

        await asyncio.gather(*(one(i) for i in range(creates)))
    return refused


def counted(argv: list[str], port: int, creates: int, connections: int, start: int, label: str,
            metrics: bool, cwd: Path = ROOT) -> dict:
    """Run the server `argv` (from the tree `cwd`) under callgrind and count its instructions over `creates`
    creates."""
    ct.progress(f"{label}: starting under valgrind")
    server = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
                               *argv], cwd=cwd, env={**os.environ, "PYTHONHASHSEED": "0"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ct.wait_port(port, server, timeout=600)
        url = f"http://127.0.0.1:{port}"
        ct.progress(f"{label}: warm-up")
        if asyncio.run(burst(url + "/api/compute/reservations/create", 300, connections, 0, start)):
            raise RuntimeError(f"{label}: the warm-up's creates were refused")
        before = _counters(url) if metrics else {}
        subprocess.run(["callgrind_control", "-i", "on", str(server.pid)], check=True, capture_output=True)
        ct.progress(f"{label}: {creates} creates, {connections} at once, counted")
        refused = asyncio.run(burst(url + "/api/compute/reservations/create", creates, connections, 1000, start))
        subprocess.run(["callgrind_control", "-i", "off", str(server.pid)], check=True, capture_output=True)
        after = _counters(url) if metrics else {}
    finally:
        server.terminate()
        try:
            err = server.communicate(timeout=120)[1].decode(errors="replace")
        except subprocess.TimeoutExpired:
            server.kill()
            err = server.communicate()[1].decode(errors="replace")
    found = re.search(r"Collected : (\d+)", err)
    if found is None:
        raise RuntimeError(f"{label}: callgrind reported no count:\n{err[-2000:]}")
    if refused:
        raise RuntimeError(f"{label}: {refused} of {creates} creates were not accepted")
    groups = after.get("berth_store_groups_total", 0) - before.get("berth_store_groups_total", 0)
    jobs = after.get("berth_store_jobs_total", 0) - before.get("berth_store_jobs_total", 0)
    return {"instructions": int(found.group(1)) / creates, "per_group": jobs / groups if groups else None}


def _counters(url: str) -> dict:
    """The store's counters from /metrics; none from an older release whose /metrics refuses the admin token
    (its creates per commit are then left blank)."""
    try:
        return replicas.counters(url)
    except urllib.error.HTTPError:
        return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=1500)
    parser.add_argument("--connections", type=int, default=12)
    parser.add_argument("--tree", default=str(ROOT), help="git revision or directory to run Berth from")
    parser.add_argument("--engine", choices=("both", "postgresql", "sqlite"), default="both")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"bench/create_cost.py: {tool} is not installed (apt-get install valgrind)", file=sys.stderr)
            return 2
    start = (int(time.time()) // 3600 + 1) * ct.HOUR
    python = os.path.realpath(sys.executable)  # the interpreter itself, not a launcher script valgrind would count
    results: dict[str, dict] = {}
    try:
        with contextlib.ExitStack() as stack:
            cluster = stack.enter_context(throwaway_cluster(fsync=True))
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="berth-bench-",
                                                                  dir=os.environ.get("BENCH_TMP")))
            tree = ab.tree(args.tree, stack)
            boot = Path(tmp) / "bootstrap.json"
            replicas.bootstrap(boot)
            for label, handler in replicas.HANDLERS.items():
                port = ct.free_port()
                argv = [python, "-c", handler, cluster.createdb(f"h{len(results)}"), str(port)]
                results[label] = counted(argv, port, args.creates, args.connections, start, label, metrics=False)
            for label, db in (("postgresql, 1 replica", cluster.createdb("one")),
                              ("sqlite", f"sqlite:///{Path(tmp) / 'cp.db'}")):
                if args.engine != "both" and not label.startswith(args.engine):
                    continue
                port = ct.free_port()
                argv = [python, "-m", "berth", "controlplane", "serve", "--listen", f"127.0.0.1:{port}", "--db", db,
                        "--bootstrap", str(boot), "--log-level", "warning"]
                results[label] = counted(argv, port, args.creates, args.connections, start, label, metrics=True,
                                         cwd=tree)
    except ClusterError as exc:
        print(f"bench/create_cost.py: {exc}", file=sys.stderr)
        return 2
    ct.progress("")
    base = results["baseline"]["instructions"]
    print(f"{'':24} {'k instructions':>15} {'x baseline':>10} {'creates/commit':>14}")
    for label, r in results.items():
        per_group = f"{r['per_group']:.1f}" if r["per_group"] else ""
        print(f"{label:24} {r['instructions'] / 1000:>15,.1f} {r['instructions'] / base:>9.2f}x {per_group:>14}")
    print(f"(per create, in the server's process; {args.creates} creates, {args.connections} at once; Berth from "
          f"{args.tree})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
