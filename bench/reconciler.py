"""Reconciler pass cost: it must follow the number of changes, not the number of live reservations.

    python bench/reconciler.py [--live 100000] [--changes 1000]

Builds a control plane (1,000 nodes of 8 GPUs, real SQLite, fake clock) with
--live placed reservations, of which --changes start in one minute; the rest
start hours later. Times one pass with nothing due, the pass that moves the
--changes reservations placed -> binding, and the same pass on a calendar
holding only those --changes reservations. Targets: the pass with 1,000
changes under 0.5 s, and its cost with 100,000 live within 1.5x of its cost
with 1,000 live.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.domain.clock import FakeClock  # noqa: E402
from controlplane.schemas import CreateBody, create_command  # noqa: E402
from controlplane.wiring import Config, ControlPlane  # noqa: E402

HOUR = 3_600_000
T0 = 1_800_000_000_000
NODES, GPUS = 1000, 8


def progress(msg: str) -> None:
    end = "" if sys.stderr.isatty() else "\n"
    print(("\r\033[K" if sys.stderr.isatty() else "") + msg, end=end, file=sys.stderr, flush=True)


def bootstrap(path: Path) -> None:
    path.write_text(json.dumps({
        "tenants": [{"id": "t", "quota": {"gpu:H100_80GB": 10_000_000}}],
        "principals": [{"id": "u", "tenant": "t", "token": "bench-token-000000001"}],
        "pools": [{"id": "p", "owner": "t", "region": "eu", "gpuModel": "H100_80GB"}],
        "nodes": [{"id": f"n{i:04d}", "pool": "p", "hostname": f"n{i}.bench", "vcpu": 128, "memoryGiB": 1024, "gpus": GPUS}
                  for i in range(NODES)],
        "policies": "permit (principal, action, resource) when { principal.tenant == resource.tenant };",
    }))


def build(tmp: Path, live: int, changes: int) -> ControlPlane:
    clock = FakeClock(T0)
    cp = ControlPlane(Config(db=f"sqlite:///{tmp / f'cp-{live}.db'}", bootstrap=str(tmp / "b.json"), clock=clock,
                             synchronous="OFF", reconcile=False)).open()
    user = cp.catalog.current.principals["u"]

    async def fill() -> None:
        sem = asyncio.Semaphore(256)
        done = 0

        async def one(i: int) -> None:
            nonlocal done
            if i < changes:
                start = T0 + 60_000
            else:
                start = T0 + (1 + (i - changes) // (NODES * GPUS)) * 2 * HOUR
            body = CreateBody(poolId="p", gpuModel="H100_80GB", gpuCount=1, start=start, end=start + HOUR)
            async with sem:
                answer = await cp.reservations.create(user, create_command(body, f"r{i}"))
            assert answer.reservation.state == "placed", answer.reservation.state
            done += 1
            if done % 5000 == 0:
                progress(f"building: {done}/{live} live reservations")

        await asyncio.gather(*(one(i) for i in range(live)))

    asyncio.run(fill())
    return cp


def timed_pass(cp: ControlPlane) -> tuple[float, int]:
    async def once() -> tuple[float, int]:
        t = time.perf_counter()
        moved = await cp.reconciler.run_once()
        return time.perf_counter() - t, moved

    return asyncio.run(once())


def measure(tmp: Path, live: int, changes: int) -> dict:
    cp = build(tmp, live, changes)
    try:
        cp.clock.advance(30_000)
        idle, idle_moved = timed_pass(cp)
        cp.clock.advance(30_000)
        busy, moved = timed_pass(cp)
        assert idle_moved == 0 and moved == changes, (idle_moved, moved)
    finally:
        cp.close()
    return {"live": live, "idle_s": idle, "busy_s": busy, "moved": moved}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=100_000)
    parser.add_argument("--changes", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="berth-bench-") as tmp:
        tmp = Path(tmp)
        bootstrap(tmp / "b.json")
        small = measure(tmp, args.changes, args.changes)
        progress(f"measured {args.changes:,} live\n")
        big = measure(tmp, args.live, args.changes)
        progress(f"measured {args.live:,} live\n")
    ratio = big["busy_s"] / small["busy_s"]
    print(f"pass with nothing due, {big['live']:,} live:          {big['idle_s'] * 1000:8.2f} ms")
    print(f"pass with {big['moved']:,} changes, {small['live']:,} live:        {small['busy_s'] * 1000:8.2f} ms")
    print(f"pass with {big['moved']:,} changes, {big['live']:,} live:      {big['busy_s'] * 1000:8.2f} ms (target < 500 ms)")
    print(f"cost ratio {big['live']:,} live / {small['live']:,} live: {ratio:.2f}x (target <= 1.5x: grows with changes, not live count)")
    return 0 if big["busy_s"] < 0.5 and ratio <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
