"""kill -9 in the middle of a burst of creates, on each store engine: after a restart and a retry of every create
with its key, every acknowledged reservation exists exactly once, nothing overlaps and quota adds up."""
from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tests import dbrows
from tests.controlplane.conftest import TOKENS, bootstrap_doc, h100_node
from tests.serverproc import ServerProcess

CREATES = 240
QUOTA = 400  # GPUs: about 100 of the creates fit in it, the rest are QUOTA_EXCEEDED


def _bodies() -> list[dict]:
    rng = random.Random(7)
    base = (int(time.time()) // 3600 + 2) * 3_600_000
    out = []
    for i in range(CREATES):
        body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": rng.choice([1, 1, 2, 4, 8]),
                "nodeCount": rng.choice([1, 1, 1, 2]), "idempotencyKey": f"burst-{i}"}
        if rng.random() < 0.5:
            body["durationHours"] = rng.choice([1, 2, 3])
        else:
            start = base + rng.randrange(0, 10) * 3_600_000
            body.update(start=start, end=start + rng.choice([1, 2]) * 3_600_000)
        out.append(body)
    return out


def test_kill_9_mid_burst_loses_and_duplicates_nothing(tmp_path, db_url):
    doc = bootstrap_doc()
    doc["nodes"] += [h100_node(f"x{i}") for i in range(6)]  # 8 nodes of 8 GPUs in pool h100
    doc["tenants"][0]["quota"]["gpu:H100_80GB"] = QUOTA
    (tmp_path / "b.json").write_text(json.dumps(doc))
    db = db_url  # each engine (conftest.db_url)
    bodies = _bodies()
    acked: dict[str, str] = {}
    lock = threading.Lock()
    server = ServerProcess(db, tmp_path / "b.json").start()
    enough = threading.Event()

    def send(body: dict) -> None:
        try:
            status, answer = server.post("/api/compute/reservations/create", TOKENS["alice"], body, timeout=5)
        except OSError:
            return  # the server died under us: not acknowledged
        if status == 202:
            with lock:
                acked[body["idempotencyKey"]] = answer["reservation"]["id"]
                if len(acked) >= 60:
                    enough.set()

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(send, body) for body in bodies]
        while not enough.wait(0.05) and not all(f.done() for f in futures):
            pass
        server.kill()  # SIGKILL, requests in flight
    assert 60 <= len(acked) < CREATES, len(acked)

    with ServerProcess(db, tmp_path / "b.json") as again:
        answers = {}
        for body in bodies:
            status, answer = again.post("/api/compute/reservations/create", TOKENS["alice"], body)
            assert status in (202, 429), (status, answer)
            answers[body["idempotencyKey"]] = (status, answer)
        for key, rid in acked.items():
            status, answer = answers[key]
            assert status == 202 and answer["reservation"]["id"] == rid, (key, answer)
        # a second retry changes nothing
        for body in bodies[:40]:
            status, answer = again.post("/api/compute/reservations/create", TOKENS["alice"], body)
            assert answer == answers[body["idempotencyKey"]][1]

    ids = [r[0] for r in dbrows.rows(db, "SELECT id FROM reservations")]
    assert len(ids) == len(set(ids))
    assert set(acked.values()) <= set(ids)
    live = dbrows.rows(db, "SELECT id, doc FROM reservations WHERE state IN ('pending','placed','binding','active')")
    held = Counter()
    booked = Counter(r[0] for r in dbrows.rows(db, "SELECT reservation_id FROM bookings"))
    for rid, raw in live:
        res = json.loads(bytes(raw))
        held.update(res["charge"])
        if res["state"] == "placed":
            assert booked[rid] == res["node_count"], rid
    assert held["gpu:H100_80GB"] <= QUOTA
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for node, units, start, end in dbrows.rows(
        db, "SELECT b.node_id, b.units, b.start_ms, b.end_ms FROM bookings b JOIN reservations r ON r.id = b.reservation_id"
        " WHERE r.state = 'placed'"
    ):
        for unit in dbrows.units_of(units):
            spans.setdefault((node, unit), []).append((start, end))
    for s in spans.values():
        s.sort()
        assert all(a[1] <= b[0] for a, b in zip(s, s[1:]))
