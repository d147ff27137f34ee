"""Create throughput and latency of the control plane against a baseline measured in the same run.

    python bench/create_throughput.py [--seconds 8] [--connections 32] [--prefill 100000]

Baseline: an aiohttp handler that decodes the JSON body and does one
durable SQLite commit (WAL, synchronous=FULL) per request. Berth: `berth
controlplane serve` with 1,000 declared nodes of 8 GPUs; every create is a
hold, allowed by Cedar, charged, placed, and durably committed before it is
acknowledged. Both servers run as their own process and the load comes from
a third, so client and server do not share an interpreter.

Printed: requests/s of each, the ratio (target >= 1.0), and the median and
p99 latency of sequential creates on an empty calendar and with --prefill
bookings already in it (target: ratio <= 1.5).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOUR = 3_600_000
TOKEN = "bench-token-0000000001"
NODES = 1000
GPUS = 8

BASELINE = r'''
import sqlite3, sys, json
from aiohttp import web
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA journal_mode=WAL"); conn.execute("PRAGMA synchronous=FULL")
conn.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, body BLOB)")
async def handle(request):
    body = await request.read()
    json.loads(body)
    conn.execute("BEGIN"); conn.execute("INSERT INTO t (body) VALUES (?)", (body,)); conn.execute("COMMIT")
    return web.json_response({"ok": True}, status=202)
app = web.Application(); app.router.add_post("/api/compute/reservations/create", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)
    else:
        print(msg, file=sys.stderr, flush=True)


def bootstrap(path: Path) -> None:
    doc = {
        "tenants": [{"id": "bench", "quota": {"gpu:H100_80GB": 10_000_000}}],
        "principals": [{"id": "bench-user", "tenant": "bench", "token": TOKEN}],
        "pools": [{"id": "fleet", "owner": "bench", "region": "eu", "gpuModel": "H100_80GB", "pricePerGpuHourUsd": "2.5"}],
        "nodes": [
            {"id": f"n{i:04d}", "pool": "fleet", "hostname": f"n{i:04d}.bench", "vcpu": 128, "memoryGiB": 1024,
             "gpus": [{"numaNode": g // 4} for g in range(GPUS)]}
            for i in range(NODES)
        ],
        "policies": 'permit (principal, action, resource) when { principal.tenant == resource.tenant };',
    }
    path.write_text(json.dumps(doc))


def prefill(db: Path, boot: Path, count: int, base: int) -> None:
    """Book `count` one-hour windows in even slots (base + 2k hours) through the service itself."""
    from controlplane.domain.clock import Clock
    from controlplane.schemas import CreateBody, create_command
    from controlplane.wiring import Config, ControlPlane

    cp = ControlPlane(Config(db=f"sqlite:///{db}", bootstrap=str(boot), clock=Clock(), synchronous="OFF")).open()
    principal = cp.catalog.current.principals["bench-user"]

    async def run() -> None:
        sem = asyncio.Semaphore(256)
        done = 0

        async def one(i: int) -> None:
            nonlocal done
            slot = i // (NODES * GPUS)
            start = base + 2 * slot * HOUR
            body = CreateBody(poolId="fleet", gpuModel="H100_80GB", gpuCount=1, start=start, end=start + HOUR)
            async with sem:
                await cp.reservations.create(principal, create_command(body, f"prefill-{i}"))
            done += 1
            if done % 5000 == 0:
                progress(f"prefill: {done}/{count} bookings")

        await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(run())
    cp.close()
    progress(f"prefill: {count} bookings done\n")


async def load(url: str, seconds: float, connections: int, body_of, label: str) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    counter = 0
    deadline = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            nonlocal errors, counter
            while time.perf_counter() < deadline:
                counter += 1
                data = json.dumps(body_of(counter)).encode()
                t = time.perf_counter()
                async with session.post(url, data=data, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 202:
                        errors += 1
                latencies.append(time.perf_counter() - t)

        async def ticker() -> None:
            start = time.perf_counter()
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.5)
                progress(f"{label}: {len(latencies) / (time.perf_counter() - start):,.0f} req/s")

        started = time.perf_counter()
        await asyncio.gather(ticker(), *(worker() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else 0,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000 if latencies else 0,
    }


def client(args) -> None:
    """Run one load as its own process; print its result as JSON."""
    base = args.base
    rng = random.Random(args.seed)

    def body_of(i: int) -> dict:
        # Odd hour slots, so these never collide with the prefilled even ones; each slot holds NODES*GPUS.
        slot = (args.offset + i) // (NODES * GPUS)
        start = base + (2 * slot + 1) * HOUR
        # The key names the window's place (offset + i) too: a later load with the same label books other windows,
        # and the same key with another window would be a CONFLICT, measured as a cheap refusal.
        return {"poolId": "fleet", "gpuModel": "H100_80GB", "gpuCount": 1, "start": start, "end": start + HOUR,
                "idempotencyKey": f"{args.label}-{args.seed}-{args.offset + i}-{rng.random()}"}

    result = asyncio.run(load(args.url, args.seconds, args.connections, body_of, args.label))
    print(json.dumps(result))


def run_client(url: str, seconds: float, connections: int, label: str, base: int, offset: int = 0) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "client", url, "--seconds", str(seconds), "--connections", str(connections),
         "--label", label, "--base", str(base), "--offset", str(offset)],
        capture_output=True, text=True, check=True,
    )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def serve_berth(db: Path | str, boot: Path, port: int, root: Path = ROOT,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """`berth controlplane serve` on db (a SQLite file's path, or a database URL), run from the source tree at root
    (its packages first on the path, whatever is installed), with env added to the environment."""
    url = db if isinstance(db, str) else f"sqlite:///{db}"
    env = env or {}
    path = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(root)) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", f"127.0.0.1:{port}",
         "--db", url, "--bootstrap", str(boot), "--log-level", "warning"],
        cwd=root, env={**os.environ, **env, "PYTHONPATH": path}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(port, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=100_000)
    parser.add_argument("--latency-seconds", type=float, default=4)
    args = parser.parse_args()
    base = (int(time.time()) // 3600 + 1) * HOUR

    with tempfile.TemporaryDirectory(prefix="berth-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        boot = tmp / "bootstrap.json"
        bootstrap(boot)

        port = free_port()
        baseline = subprocess.Popen([sys.executable, "-c", BASELINE, str(tmp / "baseline.db"), str(port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, baseline)
        url = f"http://127.0.0.1:{port}/api/compute/reservations/create"
        run_client(url, 1, args.connections, "baseline warm-up", base)
        base_tp = run_client(url, args.seconds, args.connections, "baseline", base)
        stop(baseline)

        port = free_port()
        server = serve_berth(tmp / "empty.db", boot, port)
        url = f"http://127.0.0.1:{port}/api/compute/reservations/create"
        run_client(url, 1, args.connections, "berth warm-up", base, offset=0)
        berth_tp = run_client(url, args.seconds, args.connections, "berth", base, offset=100_000)
        stop(server)

        port = free_port()
        server = serve_berth(tmp / "latency-empty.db", boot, port)
        url = f"http://127.0.0.1:{port}/api/compute/reservations/create"
        run_client(url, 0.5, 1, "latency warm-up", base)
        empty_lat = run_client(url, args.latency_seconds, 1, "latency, empty calendar", base, offset=10_000)
        stop(server)

        progress(f"prefill: {args.prefill} bookings...")
        prefill(tmp / "full.db", boot, args.prefill, base)
        port = free_port()
        server = serve_berth(tmp / "full.db", boot, port)
        url = f"http://127.0.0.1:{port}/api/compute/reservations/create"
        run_client(url, 0.5, 1, "latency warm-up", base)
        full_lat = run_client(url, args.latency_seconds, 1, f"latency, {args.prefill:,} bookings", base, offset=10_000)
        stop(server)

    ratio = berth_tp["rps"] / base_tp["rps"]
    lat_ratio = full_lat["p50_ms"] / empty_lat["p50_ms"]
    print(f"baseline (one durable SQLite commit per request): {base_tp['rps']:,.0f} req/s "
          f"(p50 {base_tp['p50_ms']:.2f} ms, p99 {base_tp['p99_ms']:.2f} ms, {args.connections} connections)")
    print(f"berth create (hold, allowed, placed, durable):     {berth_tp['rps']:,.0f} creates/s "
          f"(p50 {berth_tp['p50_ms']:.2f} ms, p99 {berth_tp['p99_ms']:.2f} ms, errors {berth_tp['errors']})")
    print(f"throughput ratio berth/baseline: {ratio:.2f}x (target >= 1.0x)")
    print(f"create latency, empty calendar:       p50 {empty_lat['p50_ms']:.2f} ms, p99 {empty_lat['p99_ms']:.2f} ms")
    print(f"create latency, {args.prefill:,} bookings: p50 {full_lat['p50_ms']:.2f} ms, p99 {full_lat['p99_ms']:.2f} ms")
    print(f"latency ratio full/empty: {lat_ratio:.2f}x (target <= 1.5x)")
    return 0 if ratio >= 1.0 and lat_ratio <= 1.5 and not berth_tp["errors"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("url")
        p.add_argument("--seconds", type=float)
        p.add_argument("--connections", type=int)
        p.add_argument("--label")
        p.add_argument("--base", type=int)
        p.add_argument("--offset", type=int, default=0)
        p.add_argument("--seed", type=int, default=1)
        client(p.parse_args())
    else:
        sys.exit(main())
