"""Creates per second while connections flood the API with made-up bearer tokens, against the same server's creates
alone, in one run: one replica on PostgreSQL, and the SQLite engine.

    python bench/token_flood.py [--seconds 4] [--rounds 3] [--flood-connections 4] [--tree REV_OR_DIR]

Anyone who reaches the API can send tokens nobody issued, and each is refused 401. On PostgreSQL a token a
replica does not know first brings its memory up to the database (another replica may have issued it a moment
ago; docs/scale-out.md), and each such catch-up waits for the speculative commit on its way: those catch-ups are
shared by the requests that ask together and begin at most every 50 ms (controlplane/replicas.py), so a flood
cannot drive them back to back. On SQLite nothing is caught up: each refusal costs the server's loop what its
answer costs. Each round, for each engine: bench/create_throughput.py's 32 clients create for --seconds alone,
then again while --flood-connections connections send creates back to back, each with a fresh random token.
Printed per round: creates/s alone and with the flood, their ratio, and the flood's answers per second with their
statuses; last, each engine's median ratio. There is no target: the figures say what a flood costs (docs/
scale-out.md). --tree runs the servers from a git revision or a directory (to measure an older release; the load
is this tree's). Needs root (the cluster runs as `nobody`) and PostgreSQL's binaries (apt-get install postgresql).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import ab  # noqa: E402  (a tree from a revision)
import create_throughput as ct  # noqa: E402  (the fleet, the load client and the helpers that start servers)
import replicas  # noqa: E402  (a throwaway cluster with the fleet's bootstrap file)

from tests.pgcluster import ClusterError  # noqa: E402

# Each measurement books windows of its own: room for MEASURE_CREATES creates (a minute at 8,000 creates/s), and
# MAX_ROUNDS rounds of two keep every window within the 366 days ahead a create may start.
MEASURE_CREATES = 500_000
MAX_ROUNDS, MAX_SECONDS = 10, 60


async def flood(url: str, seconds: float, connections: int) -> dict:
    """Creates with a fresh random token each, `connections` at a time and back to back, for `seconds`."""
    import aiohttp

    statuses: collections.Counter = collections.Counter()
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:
        async def one_connection() -> None:
            while time.monotonic() < deadline:
                headers = {"Authorization": f"Bearer made-up-{os.urandom(8).hex()}",
                           "Content-Type": "application/json"}
                async with session.post(url, data=b'{"poolId": "fleet"}', headers=headers) as resp:
                    await resp.read()
                    statuses[resp.status] += 1

        started = time.monotonic()
        await asyncio.gather(*(one_connection() for _ in range(connections)))
    return {"rps": sum(statuses.values()) / (time.monotonic() - started), "statuses": dict(statuses)}


def start_flood(url: str, seconds: float, connections: int) -> subprocess.Popen:
    """The flood in a process of its own, as the load's clients are."""
    return subprocess.Popen([sys.executable, __file__, "flood", url, str(seconds), str(connections)],
                            stdout=subprocess.PIPE, text=True)


def main() -> int:
    if sys.argv[1:2] == ["flood"]:
        print(json.dumps(asyncio.run(flood(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="of each measurement (default 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood-connections", type=int, default=4)
    parser.add_argument("--tree", default=str(ROOT), help="git revision or directory to run the servers from")
    args = parser.parse_args()
    if not 0 < args.seconds <= MAX_SECONDS or not 1 <= args.rounds <= MAX_ROUNDS or args.flood_connections < 1:
        parser.error(f"--seconds: above 0 and at most {MAX_SECONDS}; --rounds: 1 to {MAX_ROUNDS}; "
                     "--flood-connections: at least 1 (each measurement books windows of its own, and a create's "
                     "start must lie within 366 days)")
    ratios: dict[str, list[float]] = {"postgresql": [], "sqlite": []}
    try:
        with contextlib.ExitStack() as stack:
            cluster, boot = replicas.cluster_with_fleet(stack, "token_flood")
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="berth-bench-")))
            tree = ab.tree(args.tree, stack)
            urls = {}
            for engine, db in (("postgresql", cluster.createdb("flood")), ("sqlite", tmp / "cp.db")):
                port = ct.free_port()
                stack.callback(ct.stop, ct.serve_berth(db, boot, port, root=tree))
                urls[engine] = f"http://127.0.0.1:{port}/api/compute/reservations/create"
            start = (int(time.time()) // 3600 + 1) * ct.HOUR
            for engine, url in urls.items():
                ct.progress(f"{engine}: warm-up")
                ct.run_client(url, min(args.seconds, 2.0), 32, f"{engine} warm-up", start)
            for rnd in range(args.rounds):
                for engine, url in urls.items():
                    offset = (1 + 2 * rnd) * MEASURE_CREATES
                    alone = ct.run_client(url, args.seconds, 32, f"{engine} alone", start, offset=offset)
                    flooding = start_flood(url, args.seconds, args.flood_connections)
                    loud = ct.run_client(url, args.seconds, 32, f"{engine} flooded", start,
                                         offset=offset + MEASURE_CREATES)
                    bad = json.loads(flooding.communicate()[0])
                    ratio = loud["rps"] / alone["rps"]
                    ratios[engine].append(ratio)
                    ct.progress("")
                    print(f"round {rnd + 1} {engine:10} creates alone {alone['rps']:>7,.0f}/s, with the flood "
                          f"{loud['rps']:>7,.0f}/s ({ratio:.2f}x); the flood {bad['rps']:>6,.0f} answers/s "
                          f"{bad['statuses']}", flush=True)
    except ClusterError as exc:
        print(f"bench/token_flood.py: {exc}", file=sys.stderr)
        return 2
    print(f"with the flood / alone, median of {args.rounds}: "
          + ", ".join(f"{engine} {statistics.median(r):.2f}x" for engine, r in ratios.items())
          + f" ({args.flood_connections} flooding connections, 32 creating clients)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
