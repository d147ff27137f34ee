"""Creates per second on PostgreSQL with one and two control-plane replicas, the SQLite engine and a baseline,
all in one run on one throwaway PostgreSQL cluster (fsync on: every engine's commits are durable).

    python bench/replicas.py [--seconds 8] [--rounds 5] [--connections 32] [--watches 20] [--commit-delay-us 0]

Baseline: an aiohttp handler that decodes the JSON body and does one INSERT and commit per request on the same
PostgreSQL (asyncpg, a pool of 32). Berth: `berth controlplane serve` (bench/create_throughput.py's fleet of
1,000 nodes of 8 GPUs; every create allowed by Cedar, charged, placed, committed before it is acknowledged) on
SQLite, on PostgreSQL alone, and as two replicas on one PostgreSQL database: with the clients split between them,
and with every client on the leading replica (as examples/haproxy.cfg routes them; the other one follows).
The load comes from client processes, so clients and servers do not share an interpreter. A floor is measured too:
the same aiohttp handler without the database (what HTTP and the JSON body cost a server, per request).
Every server is started once; each round measures them one after another, and a server's ratio is the median of
its rounds' ratios to the baseline of the same round: this machine is shared, and its speed drifts by 10-20%
over minutes, so one measurement of each, minutes apart, made the ratio a draw (one round in one run gave one
replica 0.93x, the next run 0.57x). --commit-delay-us makes every commit's WAL flush wait that long first (PostgreSQL's commit_delay, for every
commit): storage whose flush is that much slower (a network volume).

Printed: creates/s of each and its ratio to the baseline (target: one replica >= 1.0x), the errors (target for
two replicas: zero), the races lost and run again inside the store, the memory reloads, the share of groups
committed speculatively (one statement, docs/scale-out.md), and the time from a
create answered by replica B to the binding in the answer of an agent's watch long-polling replica A
(docs/scale-out.md). Then where each run's CPU went, per request: the servers', PostgreSQL's and the load
clients' (they share this machine's cores), with the cores left idle; a run that leaves none idle is bound by
this machine's CPU, not by its commits, and what the replica no client is sent to (in `2 to leader`) spends per
create of the leader, following its commits. From one replica's costs per create two upper bounds are printed: its
event loop (one thread, the server's main one: the "its loop" column) on one whole core, and every core of this
machine busy with servers, PostgreSQL and clients; then the ratio of the two loops' ceilings (the baseline's loop
CPU per request over one replica's per create): what one replica / baseline comes to where both run their loops
flat out, on a machine with cores to spare for PostgreSQL and the clients. Needs root (the cluster runs as
`nobody`) and PostgreSQL's binaries (apt-get install postgresql).
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import create_throughput as ct  # noqa: E402  (the fleet, the load client and the server runner)

from tests.pgcluster import ClusterError, throwaway_cluster  # noqa: E402

ADMIN = "bench-admin-token-000001"
NODE_BOOT = "bench-node-token-000001"

BASELINE = r'''
import asyncio, json, sys
import asyncpg
from aiohttp import web
async def main():
    pool = await asyncpg.create_pool(sys.argv[1], min_size=32, max_size=32)
    async with pool.acquire() as c:
        await c.execute("CREATE TABLE IF NOT EXISTS t (id BIGSERIAL PRIMARY KEY, body BYTEA)")
    async def handle(request):
        body = await request.read()
        json.loads(body)
        async with pool.acquire() as c:
            await c.execute("INSERT INTO t (body) VALUES ($1)", body)  # one transaction, one commit
        return web.json_response({"ok": True}, status=202)
    app = web.Application(); app.router.add_post("/api/compute/reservations/create", handle)
    runner = web.AppRunner(app, access_log=None); await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(sys.argv[2])).start()
    await asyncio.Event().wait()
asyncio.run(main())
'''
FLOOR = BASELINE.replace("""        async with pool.acquire() as c:
            await c.execute("INSERT INTO t (body) VALUES ($1)", body)  # one transaction, one commit
""", "")  # the same handler without the database (the pool is made, and left unused)
assert FLOOR != BASELINE
HANDLERS = {"baseline": BASELINE, "floor (no database)": FLOOR}
# Creates each round's windows leave room for (a server's clients book from offset + i * 1,000,000): with
# NODES * GPUS creates per two-hour slot, a round spans some 31 days of windows, and a create's start must lie
# within 366 days.
ROUND_CREATES = 3_000_000
MAX_ROUNDS = 11
TO_LEADER = "postgresql, 2 to leader"  # both replicas up, every client on the leading one


def bootstrap(path: Path) -> None:
    """The create bench's fleet, an admin token (for /metrics), and pool `watch`: one node an agent registers."""
    ct.bootstrap(path)
    doc = json.loads(path.read_text())
    doc["adminToken"] = ADMIN
    doc["pools"].append({"id": "watch", "owner": "bench", "region": "eu", "gpuModel": "H100_80GB"})
    doc["nodes"].append({"id": "w1", "pool": "watch", "hostname": "w1.bench", "vcpu": 64, "memoryGiB": 512,
                         "gpus": 8})
    doc["nodeTokens"] = [{"pool": "watch", "token": NODE_BOOT}]
    path.write_text(json.dumps(doc))


def cluster_with_fleet(stack: contextlib.ExitStack, prog: str) -> tuple[Any, Path]:
    """A throwaway cluster (fsync on) and a bootstrap file of the fleet (bootstrap), both gone when `stack`
    closes; where no cluster can be made, `prog` exits 2 saying why."""
    try:
        cluster = stack.enter_context(throwaway_cluster(fsync=True))
    except ClusterError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    boot = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="berth-bench-"))) / "bootstrap.json"
    bootstrap(boot)
    return cluster, boot


def post(base: str, path: str, token: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def counters(base: str) -> dict[str, float]:
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for name in ("berth_store_race_retries_total", "berth_store_reloads_total", "berth_store_groups_total",
                 "berth_store_jobs_total", "berth_store_speculative_groups_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def leader_of(urls: list[str], timeout: float = 30) -> str:
    """The one of urls whose /healthz says it leads (the replicas elect one within a second of starting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for url in urls:
            with urllib.request.urlopen(url + "/healthz", timeout=10) as resp:
                if json.loads(resp.read())["leads"]:
                    return url
        time.sleep(0.1)
    raise RuntimeError(f"no replica of {urls} leads after {timeout:g} s")


def serve(db: str | Path, boot: Path) -> tuple[subprocess.Popen, str]:
    port = ct.free_port()
    return ct.serve_berth(db, boot, port), f"http://127.0.0.1:{port}"


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User and system CPU of one process so far, or of one of its threads (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_pids(cluster) -> list[int]:
    """The cluster's postmaster and its children (the backends, the WAL writer, the checkpointer...)."""
    postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return pids


def idle_seconds() -> float:
    """The machine's idle CPU time so far, all cores."""
    return int(Path("/proc/stat").read_text().split()[4]) / os.sysconf("SC_CLK_TCK")


def measure(bases: list[str], seconds: float, connections: int, label: str, start: int, offset: int,
            servers: list[subprocess.Popen] = (), cluster=None, followers: int = 0) -> dict:
    """One load split evenly across the servers, at once; the sums, the worst latency, and the CPU seconds the
    servers, the cluster and the load clients spent (the cluster's as the processes alive at the end saw it);
    followers: how many of the servers, the last ones, get no load (they follow the others' commits)."""
    per = max(1, connections // len(bases))
    url = "/api/compute/reservations/create"
    pg = cluster_pids(cluster) if cluster is not None else []
    loops = [cpu_seconds(p.pid, p.pid) for p in servers]  # a server's main thread runs its event loop
    before = ([cpu_seconds(p.pid) for p in servers], sum(map(cpu_seconds, pg)), resource.getrusage(
        resource.RUSAGE_CHILDREN), idle_seconds(), time.perf_counter())
    with ThreadPoolExecutor(len(bases)) as pool:
        results = list(pool.map(lambda i: ct.run_client(bases[i] + url, seconds, per, f"{label} [{i + 1}]", start,
                                                        offset + i * 1_000_000), range(len(bases))))
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the clients, waited for
    pg = cluster_pids(cluster) if cluster is not None else []
    wall = time.perf_counter() - before[4]
    return {"rps": sum(r["rps"] for r in results), "errors": sum(r["errors"] for r in results),
            "requests": sum(r["requests"] for r in results), "p50_ms": max(r["p50_ms"] for r in results),
            "p99_ms": max(r["p99_ms"] for r in results),
            "cpu_server": sum(cpu_seconds(p.pid) - b for p, b in zip(servers, before[0])),
            "cpu_followers": sum(cpu_seconds(p.pid) - b for p, b in list(zip(servers, before[0]))[
                len(servers) - followers:]) if followers else 0.0,
            "cpu_loop": sum(cpu_seconds(p.pid, p.pid) - b for p, b in zip(servers, loops)),
            "cpu_postgres": max(0.0, sum(map(cpu_seconds, pg)) - before[1]),
            "cpu_clients": (children.ru_utime + children.ru_stime) - (before[2].ru_utime + before[2].ru_stime),
            "idle_cores": (idle_seconds() - before[3]) / wall, "wall": wall}


def watch_latency(a: str, b: str, rounds: int) -> list[float]:
    """Seconds from replica B's answer to a create to the answer of a watch long-polling replica A with it."""
    sys.path.insert(0, str(ROOT))
    from tests.controlplane.test_nodes import inventory

    status, reg = post(a, "/api/nodes/register", NODE_BOOT,
                       {"hostname": "w1.bench", "inventory": inventory("w1.bench")})
    assert status == 200, reg
    node = reg["nodeToken"]
    seen: list[float] = []
    for i in range(rounds):
        ct.progress(f"watch across replicas: {i + 1}/{rounds}")
        while True:  # the previous round's release seen on replica A first
            now_doc = post(a, "/api/nodes/watch", node, {"timeoutMs": 0})[1]
            if not now_doc["bindings"]:
                break
            time.sleep(0.01)
        answer: dict = {}

        def watch() -> None:
            rv = now_doc["resourceVersion"]
            while True:  # until the binding is in an answer (a wake may carry something else first)
                doc = post(a, "/api/nodes/watch", node, {"resourceVersion": rv, "timeoutMs": 20_000})[1]
                rv = doc["resourceVersion"]
                if doc["bindings"]:
                    answer.update(doc=doc, at=time.perf_counter())
                    return

        watcher = threading.Thread(target=watch)
        watcher.start()
        time.sleep(0.2)
        now = int(time.time() * 1000)
        status, created = post(b, "/api/compute/reservations/create", ct.TOKEN, {
            "poolId": "watch", "gpuModel": "H100_80GB", "gpuCount": 1, "start": now, "end": now + 3_600_000})
        answered = time.perf_counter()
        assert status == 202, created
        watcher.join(25)
        rid = created["reservation"]["id"]
        assert rid in [x["reservationId"] for x in answer["doc"]["bindings"]], answer
        seen.append(answer["at"] - answered)
        post(b, "/api/compute/reservations/release", ct.TOKEN, {"reservationId": rid})
    ct.progress("")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8, help="of each measurement (default 8)")
    parser.add_argument("--rounds", type=int, default=5,
                        help=f"each server measured once per round (default 5, at most {MAX_ROUNDS})")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--watches", type=int, default=20)
    parser.add_argument("--commit-delay-us", type=int, default=0, help="PostgreSQL's commit_delay, in every commit")
    args = parser.parse_args()
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds: from 1 to {MAX_ROUNDS} (each round books its own month of windows, and a create's "
                     "start must lie within 366 days)")
    start = (int(time.time()) // 3600 + 1) * ct.HOUR
    rounds: list[dict[str, dict]] = []
    try:
        cluster_cm = throwaway_cluster(fsync=True)
        cluster = cluster_cm.__enter__()
    except ClusterError as exc:
        print(f"bench/replicas.py: {exc}", file=sys.stderr)
        return 2
    try:
        if args.commit_delay_us:
            cluster.psql(f"ALTER SYSTEM SET commit_delay = {args.commit_delay_us:d}")
            cluster.psql("ALTER SYSTEM SET commit_siblings = 0")  # every commit waits, not only busy ones
            cluster.psql("SELECT pg_reload_conf()")
        with tempfile.TemporaryDirectory(prefix="berth-bench-", dir=os.environ.get("BENCH_TMP")) as tmp, \
                contextlib.ExitStack() as stack:
            tmp = Path(tmp)
            boot = tmp / "bootstrap.json"
            bootstrap(boot)
            # Every server is started once and stays up (an idle one costs nothing); each round measures them one
            # after another, so a slow spell of this shared machine falls on one round, not on one server.
            # label: the clients' urls, the server processes, the urls whose counters are read (Berth's), and where
            # in each round's windows its clients book (two loads on one database must not book the same windows)
            servers: dict[str, tuple[list[str], list[subprocess.Popen], list[str], int]] = {}
            for label, handler in HANDLERS.items():
                port = ct.free_port()
                proc = subprocess.Popen([sys.executable, "-c", handler, cluster.createdb(f"b{len(servers)}"),
                                         str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                stack.callback(ct.stop, proc)  # whatever fails below, the servers stop
                ct.wait_port(port, proc)
                servers[label] = ([f"http://127.0.0.1:{port}"], [proc], [], 0)
            for label, db in (("sqlite", tmp / "cp.db"), ("postgresql, 1 replica", cluster.createdb("one"))):
                proc, url = serve(db, boot)
                stack.callback(ct.stop, proc)
                servers[label] = ([url], [proc], [url], 0)
            two = cluster.createdb("two")
            (a, url_a), (b, url_b) = serve(two, boot), serve(two, boot)
            stack.callback(ct.stop, a)
            stack.callback(ct.stop, b)
            # Every client on the leading replica, as examples/haproxy.cfg routes them (docs/scale-out.md): its
            # counters (the other one's refreshes after each of its commits show in the servers' CPU). Measured
            # before the split load, not right after it: a replica that finds another's writes commits under the
            # lock for a while (SPECULATION_PAUSE_S), as it would after any change of the balancer's choice.
            leader = leader_of([url_a, url_b])
            led, following = (a, b) if leader == url_a else (b, a)
            servers[TO_LEADER] = ([leader], [led, following], [leader], 2_000_000)  # the split load: 0 and 1,000,000
            servers["postgresql, 2 replicas"] = ([url_a, url_b], [a, b], [url_a, url_b], 0)
            for label, (urls, _, _, first) in servers.items():
                measure(urls, 1, args.connections, f"{label} warm-up", start, first)
            for n in range(args.rounds):
                results: dict[str, dict] = {}
                for label, (urls, procs, counted, first) in servers.items():
                    before = [counters(u) for u in counted]
                    results[label] = measure(urls, args.seconds, args.connections,
                                             f"round {n + 1}/{args.rounds}: {label}",
                                             start, 100_000 + n * ROUND_CREATES + first,
                                             procs, cluster if label != "sqlite" else None,
                                             followers=1 if label == TO_LEADER else 0)
                    after = [counters(u) for u in counted]
                    for key in (after[0] if after else ()):
                        results[label][key] = sum(a[key] - b[key] for a, b in zip(after, before))
                rounds.append(results)
            seen = watch_latency(url_a, url_b, args.watches)
    finally:
        cluster_cm.__exit__(None, None, None)
    return report(rounds, seen, args)


def report(rounds: list[dict[str, dict]], seen: list[float], args: argparse.Namespace) -> int:
    """Each server's creates/s (median over the rounds) and its ratio to the baseline (the median of the rounds'
    ratios: each round's figures were measured minutes apart at most), and the sums of the rest."""
    labels = list(rounds[0])
    total = {label: {key: sum(r[label].get(key, 0) for r in rounds) for key in rounds[0][label]} for label in labels}
    rps = {label: statistics.median(r[label]["rps"] for r in rounds) for label in labels}
    ratio = {label: statistics.median(r[label]["rps"] / r["baseline"]["rps"] for r in rounds) for label in labels}
    spread = {label: (min(r[label]["rps"] / r["baseline"]["rps"] for r in rounds),
                      max(r[label]["rps"] / r["baseline"]["rps"] for r in rounds)) for label in labels}
    print(f"{'':24} {'creates/s':>10} {'x baseline':>10} {'(rounds)':>13} {'errors':>7} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'jobs/commit':>11} {'retries':>7} {'reloads':>7} {'speculative':>11}")
    for label in labels:
        r = total[label]
        groups = r.get("berth_store_groups_total", 0)
        per_commit = f"{r['berth_store_jobs_total'] / groups:.1f}" if groups else "1.0"
        speculative = (f"{r.get('berth_store_speculative_groups_total', 0) / groups:.0%}"
                       if groups and label.startswith("postgresql") else "")
        extra = {"baseline": f"{'1.0':>11}", "floor (no database)": ""}.get(label) if label in HANDLERS else (
            f"{per_commit:>11} {r.get('berth_store_race_retries_total', 0):>7.0f} "
            f"{r.get('berth_store_reloads_total', 0):>7.0f} {speculative:>11}")
        low, high = spread[label]
        p50 = statistics.median(x[label]["p50_ms"] for x in rounds)
        p99 = max(x[label]["p99_ms"] for x in rounds)
        print(f"{label:24} {rps[label]:>10,.0f} {ratio[label]:>9.2f}x {f'{low:.2f}-{high:.2f}':>13} "
              f"{r['errors']:>7.0f} {p50:>7.2f} {p99:>7.2f} {extra}")
    print(f"(median of {len(rounds)} rounds of {args.seconds:g} s each; the ratio is the median of each round's ratio "
          f"to that round's baseline, with the lowest and highest)")
    print(f"\nCPU per request, in microseconds (this machine: {os.cpu_count()} cores, shared by all of them):")
    print(f"{'':24} {'server':>8} {'its loop':>8} {'postgres':>8} {'clients':>8} {'total':>8} {'idle cores':>10}")
    for label in labels:
        r = total[label]
        n = max(1, r["requests"])
        parts = [r["cpu_server"] / n * 1e6, r["cpu_postgres"] / n * 1e6, r["cpu_clients"] / n * 1e6]
        print(f"{label:24} {parts[0]:>8.0f} {r['cpu_loop'] / n * 1e6:>8.0f} {parts[1]:>8.0f} {parts[2]:>8.0f} "
              f"{sum(parts):>8.0f} {r['idle_cores'] / len(rounds):>10.2f}")
    two = total["postgresql, 2 replicas"]
    retries = two.get("berth_store_race_retries_total", 0)
    print(f"2 replicas: {two['requests']:,.0f} creates, {two['errors']:.0f} errors, {retries:.0f} lost races run "
          f"again inside the store ({retries / max(1, two['requests']):.2%}), "
          f"{two.get('berth_store_reloads_total', 0):.0f} reloads after the other replica's writes")
    led = total[TO_LEADER]
    follows = led["cpu_followers"] / max(1, led["requests"]) * 1e6
    print(f"2 to leader: the replica no client is sent to spent {follows:.0f} us per create of the leader (it "
          "refreshes its memory after each of the leader's commits)")
    seen_ms = sorted(s * 1000 for s in seen)
    print(f"a create on replica B seen by a watch on replica A: p50 {statistics.median(seen_ms):.1f} ms, "
          f"max {seen_ms[-1]:.1f} ms over {len(seen_ms)} creates (includes the window start's transition)")

    # Upper bounds at the costs per create measured: a loop cannot run on more than one core, and the servers,
    # PostgreSQL and the clients cannot use more than this machine's cores together.
    r, base_rps = total["postgresql, 1 replica"], rps["baseline"]
    per = {key: r[key] / max(1, r["requests"]) for key in ("cpu_loop", "cpu_server", "cpu_postgres", "cpu_clients")}
    loop_bound = 1 / per["cpu_loop"] / base_rps
    cores_bound = os.cpu_count() / (per["cpu_server"] + per["cpu_postgres"] + per["cpu_clients"]) / base_rps
    floor, base = total["floor (no database)"], total["baseline"]
    base_loop = base["cpu_loop"] / max(1, base["requests"])
    print(f"one replica's bounds at these costs: its event loop on one whole core {loop_bound:.2f}x, every core of "
          f"this machine busy {cores_bound:.2f}x (of its loop's {per['cpu_loop'] * 1e6:.0f} us per create, "
          f"{floor['cpu_loop'] / max(1, floor['requests']) * 1e6:.0f} are HTTP and the JSON body: the floor)")
    # With cores to spare for PostgreSQL and the clients, each server runs into its own loop's thread.
    print(f"with cores to spare, both servers' loops flat out: one replica / baseline "
          f"{base_loop / per['cpu_loop']:.2f}x (the baseline's loop {base_loop * 1e6:.0f} us per request)")
    one = ratio["postgresql, 1 replica"]
    print(f"one replica / baseline: {one:.2f}x (target >= 1.0x); two replicas errors: {two['errors']:.0f} (target 0)")
    return 0 if one >= 1.0 and two["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
