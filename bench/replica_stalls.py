"""How long one replica's memory work holds up the others, with many live reservations, in one run:

    python bench/replica_stalls.py [--fill-seconds 10] [--times 6] [--tree REV_OR_DIR]

Two replicas (`berth controlplane serve`, bench/replicas.py's fleet) on one database of a throwaway PostgreSQL
cluster; every create goes to the leader for --fill-seconds at 32 clients (some 20,000 live reservations on this
machine). Then, and what is printed:

- **a catalog change**: a node cordoned on the leader, then uncordoned, --times changes in all, while a client
  polls the standby's `/healthz` every 5 ms: per change, the longest answer (the standby's loop held while it
  takes the change) and whether the standby rebuilt its memory whole (`berth_store_rebuilds_total`);
- **a start**: a third replica started on the filled database, until it listens (its memory built whole), against
  the first two's start on the empty one;
- **a whole rebuild on both**: the rebuild generation moved (as a `migrate` into the database moves it, without
  its NOTIFY; on a tree older than schema 5, the catalog generation, which then called for the same) and one
  create sent to each replica at once, --times rounds: the longest time one session held the writers' lock
  (pg_locks sampled every 0.5 ms: another replica's writes wait that long), each create's time, and each
  replica's longest `/healthz` answer meanwhile (its loop held while it rebuilds).

--tree runs both servers from a git revision (checked out into a temporary worktree, as bench/ab.py) or a
directory, to measure an earlier release the same way. Needs what bench/replicas.py needs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import asyncpg  # noqa: E402

import ab  # noqa: E402  (a tree from a revision)
import create_throughput as ct  # noqa: E402  (the load client and the server helpers)
import replicas as rb  # noqa: E402  (the fleet, the admin token, the leader)

from controlplane.store.pg_sql import WRITE_LOCK  # noqa: E402

# Which session holds the writers' lock (a bigint advisory lock: its high and low halves)
LOCK_HOLDER = ("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
               f" AND classid = {WRITE_LOCK >> 32} AND objid = {WRITE_LOCK & 0xFFFFFFFF}")
NODE = "n0001"


def rebuilds(base: str) -> float:
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {rb.ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        found = re.search(r"^berth_store_rebuilds_total (\S+)$", resp.read().decode(), re.M)
    return float(found.group(1)) if found else 0.0


@contextlib.contextmanager
def longest_answers(bases: list[str]):
    """While inside, each of bases' `/healthz` polled every 5 ms: yields a list that holds each one's longest
    answer so far in ms (how long its loop was held)."""
    longest = [0.0] * len(bases)
    done = threading.Event()

    def poll(i: int) -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(bases[i] + "/healthz", timeout=30) as resp:
                resp.read()
            longest[i] = max(longest[i], (time.perf_counter() - t0) * 1000)
            time.sleep(0.005)

    pollers = [threading.Thread(target=poll, args=(i,)) for i in range(len(bases))]
    for poller in pollers:
        poller.start()
    try:
        yield longest
    finally:
        done.set()
        for poller in pollers:
            poller.join()


def catalog_changes(leader: str, standby: str, times: int) -> list[tuple[float, float]]:
    """(the standby's longest /healthz answer in ms, its whole rebuilds) per cordon or uncordon on the leader."""
    out = []
    for i in range(times):
        with longest_answers([standby]) as longest:
            time.sleep(0.3)
            before = rebuilds(standby)
            action = "cordon" if i % 2 == 0 else "uncordon"
            status, doc = rb.post(leader, f"/api/admin/nodes/{action}", rb.ADMIN, {"nodeId": NODE})
            if status != 200:
                raise RuntimeError(f"{action} {NODE}: {status} {doc}")
            time.sleep(2.0)
        out.append((longest[0], rebuilds(standby) - before))
        print(f"  {action:8} on the leader: the standby's longest answer {out[-1][0]:7.1f} ms,"
              f" whole rebuilds {out[-1][1]:g}", file=sys.stderr)
    return out


async def rebuilds_on_both(db: str, bases: list[str], start: int,
                           times: int) -> list[tuple[float, list[float], list[float]]]:
    """(the longest hold of the writers' lock in ms, each replica's create in ms, each replica's longest /healthz
    answer in ms) per round."""
    conn = await asyncpg.connect(db)
    try:
        column = "rebuild_generation" if await conn.fetchval(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 'replica_state'"
            " AND column_name = 'rebuild_generation'") else "catalog_generation"
        out = []
        for i in range(times):
            await conn.execute(f"UPDATE replica_state SET generation = generation + 1, {column} = generation + 1")
            holds: list[float] = []
            sampling = True

            async def sample() -> None:
                holder, since = None, 0.0
                while sampling:
                    rows = await conn.fetch(LOCK_HOLDER)
                    now, pid = time.perf_counter(), (rows[0][0] if rows else None)
                    if pid != holder:
                        if holder is not None:
                            holds.append(now - since)
                        holder, since = pid, now
                    await asyncio.sleep(0.0005)
                if holder is not None:
                    holds.append(time.perf_counter() - since)

            def create(base: str, n: int) -> float:
                when = start + 400 * 24 * ct.HOUR // 2 + (i * len(bases) + n) * ct.HOUR  # windows of their own
                body = {"poolId": "fleet", "gpuModel": "H100_80GB", "gpuCount": 1, "start": when,
                        "end": when + ct.HOUR, "idempotencyKey": f"stall-{i}-{n}"}
                t0 = time.perf_counter()
                status, doc = rb.post(base, "/api/compute/reservations/create", ct.TOKEN, body)
                if status != 202:
                    raise RuntimeError(f"create on {base}: {status} {doc}")
                return (time.perf_counter() - t0) * 1000

            sampler = asyncio.ensure_future(sample())
            with longest_answers(bases) as longest:
                took = await asyncio.gather(*(asyncio.to_thread(create, base, n) for n, base in enumerate(bases)))
                await asyncio.sleep(0.05)
            sampling = False
            await sampler
            out.append((max(holds, default=0.0) * 1000, list(took), list(longest)))
            print(f"  round {i + 1}: the writers' lock held at most {out[-1][0]:7.1f} ms; the creates "
                  + ", ".join(f"{t:,.0f} ms" for t in took) + "; the loops' longest /healthz "
                  + ", ".join(f"{t:,.0f} ms" for t in longest), file=sys.stderr)
            await asyncio.sleep(2.5)  # past the pause after another replica's writes
        return out
    finally:
        await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fill-seconds", type=float, default=10, help="creates on the leader first (default 10)")
    parser.add_argument("--times", type=int, default=6, help="catalog changes, and rebuild rounds (default 6)")
    parser.add_argument("--tree", default=str(ROOT), help="git revision or directory to run the servers from")
    args = parser.parse_args()
    start = (int(time.time()) // 3600 + 1) * ct.HOUR
    with contextlib.ExitStack() as stack:
        root = ab.tree(args.tree, stack)
        cluster, boot = rb.cluster_with_fleet(stack, "bench/replica_stalls.py")
        db = cluster.createdb("stalls")
        servers, empty_start = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            proc = ct.serve_berth(db, boot, port := ct.free_port(), root=root)
            empty_start.append(time.perf_counter() - t0)
            stack.callback(ct.stop, proc)
            servers.append(f"http://127.0.0.1:{port}")
        leader = rb.leader_of(servers)
        standby = next(url for url in servers if url != leader)
        filled = ct.run_client(leader + "/api/compute/reservations/create", args.fill_seconds, 32, "filling", start)
        live = asyncio.run(count_live(db))
        print(f"tree {args.tree}: {live:,} live reservations ({filled['errors']} errors while filling)")
        t0 = time.perf_counter()  # a third replica's start: its memory built whole from the filled database
        ct.stop(ct.serve_berth(db, boot, ct.free_port(), root=root))
        filled_start = time.perf_counter() - t0
        print(f"a replica's start until it listens: {min(empty_start):.2f} s on the empty database,"
              f" {filled_start:.2f} s on the filled one")
        time.sleep(3)  # the standby caught up, the pause after the leader's writes over
        changes = catalog_changes(leader, standby, args.times)
        rounds = asyncio.run(rebuilds_on_both(db, servers, start, args.times))
    stalls = [ms for ms, _ in changes]
    print(f"a catalog change on the leader: the standby's loop held {min(stalls):,.1f}-{max(stalls):,.1f} ms"
          f" (the longest /healthz answer), whole rebuilds {sum(n for _, n in changes):g} in {len(changes)} changes")
    holds = [ms for ms, _, _ in rounds]
    took = [t for _, each, _ in rounds for t in each]
    held = [t for _, _, each in rounds for t in each]
    print(f"both replicas rebuilding at once: the writers' lock held at most {min(holds):,.1f}-{max(holds):,.1f} ms"
          f" a round; the creates that rebuilt took {min(took):,.0f}-{max(took):,.0f} ms; the replicas' loops held"
          f" {min(held):,.0f}-{max(held):,.0f} ms (the longest /healthz answer)")
    return 0


async def count_live(db: str) -> int:
    conn = await asyncpg.connect(db)
    try:
        return await conn.fetchval("SELECT count(*) FROM reservations WHERE state NOT IN ('released', 'cancelled')")
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.exit(main())
