"""Two control-plane replicas (two `berth controlplane serve` processes) on one PostgreSQL database: no double
booking under a burst split across them, idempotency across them (also after a kill -9 of one), exact quota, the
timers taken over when the leader dies, heartbeats heard by the replica that does not lead keeping the node alive on
the leader, an agent on one replica bound by a create on the other, and HAProxy in
front of them as examples/haproxy.cfg configures it (every request to the leader, and on past its death). The
mixed stress of creates, cancels, extends, releases and an operator's node and budget changes runs on SQLite's one
server too."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import pytest

from controlplane.store.pg_connect import LEADER, LISTEN, READ_POOL, READS, SESSIONS, WRITER, Connector
from controlplane.store.pg_sql import WRITE_LOCK
from controlplane.store.pg_writer import SPECULATION_PAUSE_S
from tests import dbrows
from tests.controlplane.conftest import K8S_BOOT, NODE_ACCESS, TOKENS, bootstrap_doc, h100_node
from tests.serverproc import ServerProcess, post
from tests.waiting import wait_for

ADMIN = bootstrap_doc()["adminToken"]
NODE_BOOT = bootstrap_doc()["nodeTokens"][0]["token"]  # pool h100's
ROOT_BOOT = "node-token-root-000001"  # the stress test's pool root (binding: node)
GPUS = 3 * 8  # pool h100 below: h1, h2 and x0, 8 GPUs each
CLIENTS = 32


@pytest.fixture
def database(pg_cluster):
    name = f"berth_{uuid.uuid4().hex[:12]}"
    url = pg_cluster.createdb(name)
    yield url
    pg_cluster.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def bootstrap(tmp_path):
    doc = bootstrap_doc()
    doc["nodes"].append(h100_node("x0"))
    doc["tenants"][0]["quota"]["gpu:H100_80GB"] = 1000
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    return path


def leads(server: ServerProcess) -> bool:
    """Whether the replica leads, by the status of its /healthz/leader (200 it does, 503 it does not), which its
    document must agree with."""
    try:
        with urllib.request.urlopen(server.url + "/healthz/leader", timeout=5) as resp:
            status, doc = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as refused:
        status, doc = refused.code, json.loads(refused.read())
    assert (status, doc) in ((200, {"status": "ok", "leads": True}), (503, {"status": "ok", "leads": False})), doc
    return status == 200


def health(server: ServerProcess) -> dict:
    with urllib.request.urlopen(server.url + "/healthz", timeout=5) as resp:
        return json.loads(resp.read())


def window() -> tuple[int, int]:
    start = (int(time.time()) // 3600 + 2) * 3_600_000  # one window in the future, the same for every create
    return start, start + 3_600_000


def create_body(key: str, gpus: int = 1) -> dict:
    start, end = window()
    return {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": gpus, "start": start, "end": end,
            "idempotencyKey": key}


def check_database(db: str, acked: dict[str, str]) -> None:
    """Zero overlapping bookings (by SQL over all of them), every acknowledged create once, quota exact."""
    overlaps = dbrows.rows(db, "SELECT count(*) FROM booked_units a JOIN booked_units b ON a.node_id = b.node_id"
                               " AND a.unit = b.unit AND a.ctid < b.ctid AND a.during && b.during")
    assert [(0,)] == overlaps
    ids = Counter(r[0] for r in dbrows.rows(db, "SELECT id FROM reservations"))
    assert all(n == 1 for n in ids.values())
    assert set(acked.values()) <= set(ids)
    booked = dbrows.rows(db, "SELECT count(*) FROM booked_units u JOIN bookings b ON b.id = u.booking_id JOIN "
                             "reservations r ON r.id = b.reservation_id WHERE r.state = 'placed'")[0][0]
    assert booked <= GPUS


def used_gpus(server: ServerProcess) -> int:
    status, doc = server.post("/api/admin/tenants/get", ADMIN, {"tenantId": "acme"})
    assert status == 200, doc
    return int(doc["tenant"]["used"].get("gpu:H100_80GB", 0))


def charged_gpus(db: str) -> int:
    rows = dbrows.rows(db, "SELECT doc FROM reservations WHERE state IN ('pending', 'placed', 'binding', 'active')")
    return sum(json.loads(bytes(doc))["charge"].get("gpu:H100_80GB", 0) for (doc,) in rows)


def test_two_replicas_split_a_burst_for_the_last_gpus_without_double_booking(database, bootstrap):
    with ServerProcess(database, bootstrap) as a, ServerProcess(database, bootstrap) as b:
        replicas = [a, b]
        acked: dict[str, str] = {}
        states: Counter = Counter()
        lock = threading.Lock()

        def client(i: int) -> None:
            for j in range(3):  # 96 creates of one GPU for 24 GPUs: most are pending, none double-booked
                key = f"c{i}-{j}"
                status, doc = replicas[i % 2].post("/api/compute/reservations/create", TOKENS["alice"],
                                                   create_body(key))
                assert status == 202, (status, doc)
                with lock:
                    acked[key] = doc["reservation"]["id"]
                    states[doc["reservation"]["state"]] += 1

        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(client, range(CLIENTS)))
        assert states["placed"] == GPUS and states["pending"] == 3 * CLIENTS - GPUS, states
        # the same keys again, each on the other replica: the same reservations, nothing new
        for key, rid in list(acked.items())[:20]:
            i = int(key[1:].split("-")[0])
            status, doc = replicas[(i + 1) % 2].post("/api/compute/reservations/create", TOKENS["alice"],
                                                     create_body(key))
            assert (202, rid) == (status, doc["reservation"]["id"])
        check_database(database, acked)
        assert used_gpus(a) == used_gpus(b) == charged_gpus(database) == 3 * CLIENTS
        # each replica held no more sessions than docs/scale-out.md sizes max_connections by
        held = Counter(r[0].removeprefix("berth-controlplane ") for r in dbrows.rows(
            database, "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() AND "
                      "application_name LIKE 'berth-controlplane %'"))
        assert {WRITER, LISTEN, LEADER} <= set(held) <= {*SESSIONS, READS}, held
        assert held[READS] <= 2 * READ_POOL, held
        assert all(n <= 2 for role, n in held.items() if role != READS), held
        # one key sent to both replicas at once: one reservation, the other call replays it
        before = {r[0] for r in dbrows.rows(database, "SELECT id FROM reservations")}
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda s: s.post("/api/compute/reservations/create", TOKENS["alice"],
                                                  create_body("same-key")), replicas))
        assert [202, 202] == [status for status, _ in both]
        made = {r[0] for r in dbrows.rows(database, "SELECT id FROM reservations")} - before
        assert {doc["reservation"]["id"] for _, doc in both} == made and len(made) == 1
        # and the same key with another request: CONFLICT, from either replica
        for server in replicas:
            status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"],
                                      create_body("same-key", gpus=2))
            assert (409, "CONFLICT") == (status, doc["error"]["code"]), doc


def test_a_session_the_sizing_of_max_connections_does_not_count_is_refused_before_it_connects():
    connector = Connector("postgresql://nobody@/none?host=/nonexistent", "berth-controlplane")
    try:
        with pytest.raises(ValueError, match="'scratch' is not one of SESSIONS"):
            connector.run(connector.connect("scratch"))
        # a listed one does try (and finds no server there)
        with pytest.raises(OSError):
            connector.run(connector.connect(LEADER))
    finally:
        connector.close()


def test_kill_9_of_one_replica_mid_burst_and_a_retry_on_the_other_books_exactly_once(database, bootstrap):
    with ServerProcess(database, bootstrap) as a, ServerProcess(database, bootstrap) as b:  # a is killed below
        acked: dict[str, str] = {}
        lock = threading.Lock()
        enough = threading.Event()
        keys = [f"k{i}" for i in range(120)]

        def send(i: int) -> None:
            server = a if i % 2 == 0 else b
            try:
                status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"], create_body(keys[i]),
                                          timeout=10)
            except OSError:
                return  # replica a died under us: not acknowledged
            if status == 202:
                with lock:
                    acked[keys[i]] = doc["reservation"]["id"]
                    if len(acked) >= 30:
                        enough.set()

        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(send, i) for i in range(len(keys))]
            while not enough.wait(0.02) and not all(f.done() for f in futures):
                pass
            a.kill()
        for key in keys:  # every create again on the survivor, with its key
            status, doc = b.post("/api/compute/reservations/create", TOKENS["alice"], create_body(key))
            assert status == 202, (status, doc)
            if key in acked:
                assert doc["reservation"]["id"] == acked[key], key
            acked[key] = doc["reservation"]["id"]
        check_database(database, acked)
        assert len(set(acked.values())) == len(keys)
        assert used_gpus(b) == charged_gpus(database) == len(keys)


def double_bookings(db: str) -> list[tuple]:
    """Pairs of bookings (every one not ended where it started, whatever its reservation's state) that hold one
    device over overlapping times: (node, device, reservation, reservation)."""
    held: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for node, units, start, end, rid in dbrows.rows(
            db, "SELECT node_id, units, start_ms, end_ms, reservation_id FROM bookings WHERE end_ms > start_ms"):
        for unit in dbrows.units_of(units):
            held.setdefault((node, unit), []).append((start, end, rid))
    found = []
    for (node, unit), spans in held.items():
        spans.sort()
        found += [(node, unit, a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    return found


def transitions_and_billing(db: str, renewed: dict[str, int]) -> list[tuple]:
    """What the database's reservations, events and billing rows do not agree on (nothing: they agree). Each
    reservation became active at most once and ended at most once, by its events; it bills (one row) from the
    moment its active event says to the end it records, and nothing if it never became active; one whose lease
    lapsed ended no earlier than the deadline of the last renewal acknowledged (renewed), by its event."""
    events: dict[str, list[tuple[str, int]]] = {}
    for rid, kind, at in dbrows.rows(db, "SELECT reservation_id, type, at FROM events WHERE reservation_id IS NOT "
                                         "NULL ORDER BY seq"):
        events.setdefault(rid, []).append((kind, at))
    billed = {rid: (start, end) for rid, start, end in dbrows.rows(db, "SELECT reservation_id, start_ms, end_ms "
                                                                       "FROM billing")}
    wrong = []
    for rid, doc in dbrows.rows(db, "SELECT id, doc FROM reservations"):
        res = json.loads(bytes(doc))
        mine = events.get(rid, [])
        active = [at for kind, at in mine if kind == "reservation.active"]
        ended = [(kind, at) for kind, at in mine if kind in ("reservation.released", "reservation.cancelled")]
        if len(active) > 1 or len(ended) > 1:
            wrong.append((rid, "moved twice", mine))
        bills = (res["billing_start"], res["billing_end"]) if res["billing_start"] is not None else None
        if billed.pop(rid, None) != bills or (active[:1] != ([bills[0]] if bills else [])):
            wrong.append((rid, "billed", bills, active, res["state"]))
        if res["reason"] == "lease-lapsed" and (not ended or ended[0][1] < max(res["lease_deadline"],
                                                                              renewed.get(rid, 0))):
            wrong.append((rid, "lapsed early", ended, res["lease_deadline"], renewed.get(rid)))
    return wrong + [(rid, "billed, not a reservation") for rid in billed]


@pytest.mark.parametrize("engine", ["sqlite", "postgresql", "postgresql, kill -9"])
def test_mixed_changes_from_many_clients_leave_one_truth(engine, request, tmp_path):
    """16 clients of two principals of one tenant create (spot and on demand, one node or a gang of two, with or
    without host resources, in overlapping windows or as soon as possible, some on a lease, some bound by
    kubernetes), replay creates, cancel, extend (by and until), renew leases and release, while an operator drains,
    cordons and uncordons nodes, sets the tenant's budget and applies the bootstrap again (the tenant's quota
    changed), an agent per node binds what starts (the kubernetes node's agent reports a release held by a pod,
    then let go), and a node binding is handed over, back and cleaned; on PostgreSQL each request goes to
    either of two replicas (speculative groups, locked groups, catalog changes and the replicas' reloads
    interleave), on SQLite to the one server; and with `kill -9`, the first replica is killed a second in and
    started again (a request it took with it is sent again to the other). Never a 5xx; no device booked twice;
    each key one reservation; no reservation active or ended twice, and its billing row as its events say; and
    the servers, one started afterwards on the same database (its memory read whole from it) and the database's
    own rows agree on every reservation's state, every node's state and the tenant's quota and budget."""
    from tests.controlplane.test_nodes import inventory

    killing = engine.endswith("kill -9")
    database = (request.getfixturevalue("database") if engine.startswith("postgresql")
                else f"sqlite:///{tmp_path / 'cp.db'}")
    doc = bootstrap_doc()
    doc["nodes"].append(h100_node("x0"))
    doc["pools"].append({"id": "root", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "policy": {"tenantRoot": {"turnaroundMinutes": 1}}})
    doc["nodes"].append(h100_node("r1", pool="root"))
    doc["nodeTokens"].append({"pool": "root", "token": ROOT_BOOT})
    acme = doc["tenants"][0]
    acme["budgetUsd"] = "1000000"
    acme["quota"].update({"gpu:H100_80GB": 1000, "vcpu": 100_000, "memoryGiB": 1_000_000})
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    base = (int(time.time()) // 3600 + 2) * 3_600_000
    windows = [(base + h * 1_800_000, base + h * 1_800_000 + 3_600_000 * (1 + h % 2)) for h in range(4)]
    api = "/api/compute/reservations/"
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ServerProcess(database, path)) for _ in range(1 if engine == "sqlite" else 2)]
        statuses: Counter = Counter()
        created: dict[str, str] = {}
        lock = threading.Lock()

        def create_body(rng: random.Random, key: str) -> dict:
            body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": rng.randint(1, 3), "idempotencyKey": key,
                    "spot": rng.random() < 0.25}
            shape = rng.random()
            if shape < 0.1:
                body.update(gpuCount=8, nodeCount=2)  # a gang: two whole nodes
            elif shape < 0.25:
                body["resources"] = {"vcpu": rng.choice([2, 4]), "memoryGiB": rng.choice([8, 16])}
            kubernetes = rng.random() < 0.15
            if kubernetes:  # on the kubernetes pool's one node, half of them from now: a release holds the devices
                body.update(poolId="k8s", binding="kubernetes", gpuCount=rng.choice([1, 2, 4]), spot=False)
                body.pop("nodeCount", None)
                body.pop("resources", None)
            when = rng.random()
            if when < 0.1 or (kubernetes and when < 0.5):
                body["durationHours"] = 1  # as soon as possible: from now, so the leader binds it meanwhile
            elif when < 0.15:
                body["durationHours"] = 0.001  # 3.6 s from now: the leader ends it meanwhile too
            else:
                body["start"], body["end"] = rng.choice(windows)
            if rng.random() < 0.15:  # on a lease, renewed on either server (none lapses within the test: at least
                body["leaseSeconds"] = rng.choice([30, 60])  # 30 s; test_timers_across_replicas.py lapses one)
            return body

        def send(n: int, path: str, token: str, body: dict) -> tuple[int, dict]:
            """POST to server n; where it was killed under the request, the same again to the last one (never
            killed): an extend by some time may then extend twice, as a client's retry would."""
            try:
                return servers[n].post(path, token, body)
            except OSError:
                if not killing:
                    raise
                with lock:
                    statuses["sent again after the kill", 0] += 1
                return servers[-1].post(path, token, body)

        def confirmed(rng: random.Random, body: dict, answer: dict) -> tuple[str, int, dict]:
            """An agent's create that needs alice's confirmation: she approves or denies it (on either server),
            and the agent sends the create again (on either server): placed or pending, or ACCESS_DENIED."""
            cid = answer["error"]["details"]["confirmationId"]
            decision = "approve" if rng.random() < 0.7 else "deny"
            status, decided = send(rng.randrange(len(servers)), f"/api/iam/confirmations/{decision}", TOKENS["alice"],
                                   {"confirmationId": cid})
            assert status == 200, decided
            status, answer = send(rng.randrange(len(servers)), api + "create", TOKENS["agent"], body)
            assert (status == 202) == (decision == "approve") and status in (202, 403), (decision, status, answer)
            return f"create {decision}d", status, answer

        renewed: dict[str, int] = {}  # a reservation's latest lease deadline a renewal was acknowledged with

        def client(i: int) -> None:
            rng = random.Random(i)
            token = TOKENS[("bob", "alice", "bob", "agent")[i % 4]]  # the agent acts for alice
            mine: list[str] = []
            leased: list[str] = []
            for j in range(24):
                n = rng.randrange(len(servers))
                roll = rng.random()
                if roll < 0.5 or not mine:
                    body = create_body(rng, f"m{i}-{j}")
                    if rng.random() < 0.1:  # priced first (on either server), the create names the quote
                        status, answer = send(rng.randrange(len(servers)), api + "quote", token,
                                              {k: v for k, v in body.items() if k != "idempotencyKey"})
                        assert status < 500, (status, answer)
                        with lock:
                            statuses["quote", status] += 1
                        if status == 200:
                            body["quoteId"] = answer["quote"]["id"]
                    elif rng.random() < 0.1:
                        body["maxHourlyPrice"] = rng.choice(["1.000000", "100.000000"])  # refused, or not
                    method = "create with a quote" if "quoteId" in body else "create"
                    if token == TOKENS["agent"] and "gpuCount" in body:
                        body["gpuCount"] = rng.choice([1, 4])  # more than 2 GPUs: alice confirms
                    status, answer = send(n, api + "create", token, body)
                    if status == 403 and answer["error"]["code"] == "CONFIRMATION_REQUIRED":
                        with lock:
                            statuses["create", status] += 1
                        method, status, answer = confirmed(rng, body, answer)
                    if status == 202:
                        mine.append(answer["reservation"]["id"])
                        if "leaseSeconds" in body:
                            leased.append(mine[-1])
                        with lock:
                            created[body["idempotencyKey"]] = mine[-1]
                        if rng.random() < 0.2:  # the same create again, on the other replica: replayed
                            again = send(1 - n if len(servers) == 2 else n, api + "create", token, body)
                            assert (202, mine[-1]) == (again[0], again[1].get("reservation", {}).get("id")), again
                elif roll < 0.62 and leased:
                    rid = rng.choice(leased)
                    method = "renew"
                    status, answer = send(n, api + method, token, {"reservationId": rid})
                    assert status in (200, 409), (status, answer)  # 409: it ended meanwhile
                    if status == 200:
                        with lock:
                            renewed[rid] = max(renewed.get(rid, 0), answer["reservation"]["leaseDeadline"])
                else:
                    rid = rng.choice(mine)
                    method, extra = (
                        ("cancel", {}) if roll < 0.65 else ("extend", {"by": 1_800_000}) if roll < 0.75
                        else ("extend", {"until": rng.choice(windows)[1] + 3_600_000}) if roll < 0.85 else ("release", {}))
                    status, answer = send(n, api + method, token, {"reservationId": rid, **extra})
                assert status < 500, (status, answer, [line for line in servers[n].lines if '"error"' in line])
                with lock:
                    statuses[method, status] += 1

        done = threading.Event()

        def operator() -> None:
            actions = [("nodes/drain", {"nodeId": "x0"}), ("nodes/uncordon", {"nodeId": "x0"}),
                       ("nodes/cordon", {"nodeId": "h2"}), ("nodes/uncordon", {"nodeId": "h2"})]
            for i in range(10_000):
                if done.is_set():
                    return
                method, body = actions[i % len(actions)] if i % 5 else ("tenants/budget", {
                    "tenantId": "acme", "budgetUsd": str(1_000_000 + i)})
                if i % 7 == 3:  # the bootstrap applied again, the tenant's GPU quota one less or back (the
                    # budget the operator set stays: the document declares the one it declared before)
                    method, body = "bootstrap", copy.deepcopy(doc)
                    body["tenants"][0]["quota"]["gpu:H100_80GB"] -= i // 7 % 2
                status, answer = send(i % len(servers), "/api/admin/" + method, ADMIN, body)
                assert status == 200, (method, status, answer)
                time.sleep(0.02)

        def agent(hostname: str, boot: str = NODE_BOOT) -> None:
            """A node's agent as the node API sees one: it registers, then heartbeats, long-polls its bindings on
            either server and reports each new one bound (and each new end), and each one gone unbound. On the
            kubernetes pool's node a released binding is reported held by a pod, then the pod let go
            (AllocationReleased: unbound)."""
            rng = random.Random(hostname)
            status, registered = send(0, "/api/nodes/register", boot,
                                      {"hostname": hostname, "inventory": inventory(hostname)})
            assert status == 200, registered
            token, version, bound, gone, handed_back = registered["nodeToken"], None, {}, set(), []
            node_bindings: set[str] = set()  # the binding: node reservations seen
            last_docs = None  # the bindings of the last answer, whole
            while not done.is_set():
                n = rng.randrange(len(servers))
                status, answer = send(n, "/api/nodes/heartbeat", token, {})
                assert status == 200, answer
                status, answer = send(n, "/api/nodes/watch", token, {"resourceVersion": version, "timeoutMs": 300}
                                      if version is not None else {"timeoutMs": 0})
                assert status == 200, answer
                version = answer["resourceVersion"]
                held = {b["reservationId"]: (b["end"], b.get("released", False)) for b in answer["bindings"]}
                docs = {b["reservationId"]: b for b in answer["bindings"]}
                if answer["changed"] and docs == last_docs:  # a change of nothing: the next replica's version for
                    with lock:  # the same set differed (its long poll would turn busy, moving between replicas)
                        statuses["watch answered a change of nothing", 0] += 1
                last_docs = docs
                nodes = {b["reservationId"] for b in answer["bindings"] if b["kind"] == "node"}
                assert not gone & set(held), (hostname, gone & set(held))  # a binding once gone never comes back
                gone |= set(bound) - set(held)
                reports = []
                for rid, (end, released) in held.items():
                    if released:  # a kubernetes release: held by a pod the first time, then let go (unbound)
                        reports.append({"reservationId": rid, "status": "unbound"} if bound.get(rid, (0, False))[1] else
                                       {"reservationId": rid, "status": "held", "holders": ["team/trainer-0"]})
                    elif bound.get(rid) != (end, released):  # new, or a new end
                        reports.append({"reservationId": rid, "status": "bound", "end": end})
                        if rid in nodes:  # handed over: how the tenant logs in
                            reports[-1]["ssh"] = {"host": hostname, "port": 22, "user": "root",
                                                  "hostKeys": ["SHA256:" + "h" * 43]}
                reports += [{"reservationId": rid, "status": "unbound"} for rid in bound if rid not in held]
                # a node handed back (unbound, above, the round before): its clean check passed
                reports += [{"reservationId": rid, "status": "cleaned", "clean": {"ok": True}} for rid in handed_back]
                handed_back = [rid for rid in bound if rid not in held and rid in node_bindings]
                node_bindings |= nodes
                if reports:
                    status, answer = send(n, "/api/nodes/report", token, {"reports": reports})
                    assert status == 200, answer
                    with lock:
                        statuses["reported", len(answer["accepted"]) > 0] += 1
                bound = held

        followed: list[int] = []

        def follow_events() -> None:
            """The tenant's events, listed after the last cursor on either server, until the clients are done and
            nothing more comes: a cursor never skips an event another replica committed late."""
            rng, cursor, quiet = random.Random("events"), None, 0
            while quiet < 3:
                status, page = send(rng.randrange(len(servers)), "/api/compute/events/list", TOKENS["alice"],
                                    {"after": cursor, "limit": 50} if cursor is not None else {"limit": 50})
                assert status == 200, page
                followed.extend(e["seq"] for e in page["events"])
                cursor = page["nextCursor"]
                quiet = quiet + 1 if done.is_set() and not page["events"] else 0
                time.sleep(0.01)

        begun = threading.Event()

        def handed_over_and_back() -> None:
            """Before the clients begin, a node binding on pool root's one node for 3.6 s and a kubernetes binding on
            pool k8s; then, while they run, each through its whole life on either server: the node handed over (its
            agent reports the ssh), back at the window's end and cleaned by its agent's check; the kubernetes
            binding active, released, held by a pod and let go."""
            rng = random.Random("handed")
            status, node = send(rng.randrange(len(servers)), api + "create", TOKENS["bob"], {
                "poolId": "root", "gpuModel": "H100_80GB", "binding": "node", "access": NODE_ACCESS,
                "durationHours": 0.001, "idempotencyKey": "handed-over"})
            assert status == 202 and node["reservation"]["state"] in ("placed", "binding"), node
            status, held = send(rng.randrange(len(servers)), api + "create", TOKENS["alice"], {
                "poolId": "k8s", "gpuModel": "H100_80GB", "binding": "kubernetes", "gpuCount": 1, "durationHours": 1,
                "idempotencyKey": "held"})
            assert status == 202 and held["reservation"]["state"] in ("placed", "binding"), held
            begun.set()
            rid = held["reservation"]["id"]
            wait_for(lambda: send(rng.randrange(len(servers)), api + "get", TOKENS["alice"], {"reservationId": rid})[
                1]["reservation"]["state"] == "active", timeout=30, interval=0.1)
            status, answer = send(rng.randrange(len(servers)), api + "release", TOKENS["alice"], {"reservationId": rid})
            assert status == 202, answer
            wait_for(lambda: dbrows.rows(database, "SELECT count(*) FROM events WHERE type = 'node.cleaned'")[0][0]
                     and dbrows.rows(database, "SELECT count(*) FROM events WHERE type = 'reservation.hold-ended' "
                                               "AND reservation_id = ?", rid)[0][0], timeout=30, interval=0.1)

        def kill_and_start_again() -> None:
            time.sleep(1)
            servers[0].kill()
            time.sleep(0.5)
            servers[0] = stack.enter_context(ServerProcess(database, path))

        with ThreadPoolExecutor(26) as pool:
            operating = pool.submit(operator)
            agents = [pool.submit(agent, f"{node}.test") for node in ("h1", "h2", "x0")]
            agents += [pool.submit(agent, "k1.test", K8S_BOOT), pool.submit(agent, "r1.test", ROOT_BOOT)]
            following = pool.submit(follow_events)
            killed = pool.submit(kill_and_start_again) if killing else None
            handing = pool.submit(handed_over_and_back)
            try:
                begun.wait(10)
                list(pool.map(client, range(16)))
                handing.result()
            finally:
                done.set()  # (also when a client failed: the operator stops)
            operating.result()
            for running in agents:
                running.result()
            following.result()
            if killed is not None:
                killed.result()
        # each kind of change went through, most of them (refusals are 4xx, never 5xx)
        assert sum(n for (_, status), n in statuses.items() if status == 202) >= 200, statuses
        assert {"quote", "create", "create with a quote", "create approved", "cancel", "extend", "release",
                "renew"} == {
            method for (method, status), n in statuses.items() if status in (200, 202)}, statuses
        assert killing == bool(statuses["sent again after the kill", 0]), statuses
        assert not statuses["watch answered a change of nothing", 0], statuses
        assert statuses["reported", True], statuses  # the agents bound what started meanwhile
        assert [] == double_bookings(database)
        assert followed and followed == [seq for (seq,) in dbrows.rows(
            database, "SELECT seq FROM events WHERE tenant_id = 'acme' AND seq <= ? ORDER BY seq", followed[-1])]

        def in_db() -> dict[str, str]:  # (drafts, and those awaiting a confirmation, are no one's to read)
            return dict(dbrows.rows(database, "SELECT id, state FROM reservations WHERE state NOT IN "
                                              "('draft', 'awaiting-confirmation')"))

        reservations = in_db()
        assert len(set(created.values())) == len(created) and set(created.values()) <= set(reservations)
        try:  # (read in three statements: a transition the leader commits between them reads as a difference)
            wait_for(lambda: not transitions_and_billing(database, renewed), timeout=10, interval=0.2)
        except AssertionError:
            assert [] == transitions_and_billing(database, renewed)
            raise

        def views(server: ServerProcess) -> tuple[dict, dict]:
            states = {}
            for rid in reservations:
                status, answer = server.post(api + "get", TOKENS["alice"], {"reservationId": rid})
                assert status == 200, answer
                states[rid] = answer["reservation"]["state"]
            status, tenant = server.post("/api/admin/tenants/get", ADMIN, {"tenantId": "acme"})
            assert status == 200, tenant
            # what started reservations may still bill, and what the active ones billed so far: time moves both (a
            # read a second later differs; the billing rows are compared by transitions_and_billing)
            del tenant["tenant"]["committedUsd"], tenant["tenant"]["spentUsd"]
            for node in ("h1", "h2", "x0", "k1", "r1"):
                status, answer = server.post("/api/admin/nodes/get", ADMIN, {"nodeId": node})
                assert status == 200, answer
                states[node] = answer["node"]["state"]
            return states, tenant["tenant"]

        def differences(*servers: ServerProcess) -> dict:
            """What the servers and the database do not agree on, by reservation, node or tenant field (nothing:
            they agree). The leader's reconciler may still move a reservation between two reads (a pending one it
            places): the caller reads again."""
            seen = [views(server) for server in servers]
            held = in_db()
            differ = {k: [v[0].get(k) for v in seen] + [held.get(k)] for k in seen[0][0]
                      if len({v[0].get(k) for v in seen} | ({held[k]} if k in held else set())) > 1}
            differ.update({k: [v[1].get(k) for v in seen] for k in seen[0][1]
                           if len({json.dumps(v[1].get(k), sort_keys=True) for v in seen}) > 1})
            used, charged = int(seen[0][1]["used"].get("gpu:H100_80GB", 0)), charged_gpus(database)
            if used != charged:
                differ["GPUs used, charged in the database"] = [used, charged]
            return differ

        def agree(*servers: ServerProcess) -> None:
            try:
                wait_for(lambda: not differences(*servers), interval=0.2)
            except AssertionError:
                assert {} == differences(*servers), "servers, then the database"  # say where they differ
                raise

        agree(*servers)  # a follower caught up
        operators = views(servers[0])  # what the operator set: nodes' states and the budget
        operators = ({node: operators[0][node] for node in ("h1", "h2", "x0", "r1")}, operators[1]["budgetUsd"])
        if engine == "sqlite":
            servers[0].stop()  # one server per file: the next one is its restart
            servers.clear()
        with ServerProcess(database, path) as later:
            agree(*servers, later)
            now = views(later)  # (with one server on SQLite, nobody else to agree with: compared with before)
            assert operators == ({node: now[0][node] for node in ("h1", "h2", "x0", "r1")}, now[1]["budgetUsd"])


def test_when_the_leader_is_killed_another_replica_takes_the_timers_over(database, bootstrap):
    grace = ["--node-grace", "6"]
    with contextlib.ExitStack() as stack:  # each stopped whatever happens (a is killed below)
        a = stack.enter_context(ServerProcess(database, bootstrap, grace))
        wait_for(lambda: leads(a))
        b = stack.enter_context(ServerProcess(database, bootstrap, grace))
        assert not leads(b)
        assert {"status": "ok", "leads": False} == health(b) and health(a)["leads"]  # alive, whoever leads
        start = int(time.time() * 1000) + 1500
        status, doc = b.post("/api/compute/reservations/create", TOKENS["alice"], {
            "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "start": start, "end": start + 3_600_000})
        assert (202, "placed") == (status, doc["reservation"]["state"])
        rid = doc["reservation"]["id"]
        a.kill()
        killed = time.monotonic()
        wait_for(lambda: leads(b), timeout=6)

        def state() -> str:
            return b.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": rid})[1][
                "reservation"]["state"]

        wait_for(lambda: state() != "placed", timeout=6)
        assert time.monotonic() - killed < 6  # within the node grace
        assert state() in ("binding", "released")  # its window started: binding (no agent here: it fails later)
        moved = [r[0] for r in dbrows.rows(database, "SELECT type FROM events WHERE reservation_id = ? ORDER BY seq",
                                           rid)]
        assert moved.count("reservation.binding") == 1, moved


def test_heartbeats_heard_by_a_replica_that_does_not_lead_keep_the_node_alive_on_the_leader(database, bootstrap):
    """An agent behind a balancer beats on any replica: one whose heartbeats all reach the replica that does not
    lead is not declared lost by the one that does (each replica records what it heard in node_seen, and the
    leader merges that in before it judges); once they stop, the leader declares it lost within the grace."""
    from tests.controlplane.test_nodes import inventory

    grace = 2.0
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(ServerProcess(database, bootstrap, ["--node-grace", str(grace)]))
        wait_for(lambda: leads(a))
        b = stack.enter_context(ServerProcess(database, bootstrap, ["--node-grace", str(grace)]))
        assert not leads(b)
        status, node = a.post("/api/nodes/register", NODE_BOOT,
                              {"hostname": "h1.test", "inventory": inventory("h1.test")})
        assert status == 200, node

        def lost() -> bool:
            status, doc = a.post("/api/admin/nodes/get", ADMIN, {"nodeId": "h1"})
            assert status == 200, doc
            return doc["node"]["lost"]

        beating = time.monotonic()
        while time.monotonic() - beating < 3 * grace:  # every heartbeat to the replica that does not lead
            status, doc = b.post("/api/nodes/heartbeat", node["nodeToken"], {})
            assert status == 200, doc
            assert not lost(), "the leader declared lost a node whose heartbeats the other replica heard"
            time.sleep(grace / 8)
        stopped = time.monotonic()
        wait_for(lambda: lost(), timeout=3 * grace, interval=0.1)
        assert grace <= time.monotonic() - stopped < 3 * grace
        # the replica that heard the heartbeats agrees, from the database
        wait_for(lambda: b.post("/api/admin/nodes/get", ADMIN, {"nodeId": "h1"})[1]["node"]["lost"], timeout=5)


def test_a_replica_that_does_not_lead_shows_the_heartbeats_the_leader_heard(database, bootstrap):
    """A replica that does not lead showed only the heartbeats it heard itself: none for a node whose agent beats on
    the leader, or an age growing past the grace for a healthy node (an alert scraping it fired)."""
    from tests.controlplane.test_nodes import inventory

    with contextlib.ExitStack() as stack:
        a = stack.enter_context(ServerProcess(database, bootstrap, ["--node-grace", "30"]))
        wait_for(lambda: leads(a))
        b = stack.enter_context(ServerProcess(database, bootstrap, ["--node-grace", "30"]))
        status, node = a.post("/api/nodes/register", NODE_BOOT,
                              {"hostname": "h1.test", "inventory": inventory("h1.test")})
        assert status == 200, node
        beating = time.monotonic()
        shown: list = []
        while time.monotonic() - beating < 5.5:  # every heartbeat to the leader
            assert 200 == a.post("/api/nodes/heartbeat", node["nodeToken"], {})[0]
            shown.append(b.post("/api/admin/nodes/get", ADMIN, {"nodeId": "h1"})[1]["node"]["heartbeatAgeSeconds"])
            time.sleep(0.5)
        assert shown[-1] is not None and shown[-1] < 5, shown


def test_an_agent_watching_one_replica_is_bound_by_a_create_on_the_other(database, tmp_path):
    from tests.controlplane.test_nodes import inventory

    doc = bootstrap_doc()
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] != "h2"]  # pool h100 is h1 alone: the create lands there
    bootstrap = tmp_path / "one-node.json"
    bootstrap.write_text(json.dumps(doc))
    with ServerProcess(database, bootstrap) as a, ServerProcess(database, bootstrap) as b:
        status, reg = a.post("/api/nodes/register", "node-token-h100-000001",
                             {"hostname": "h1.test", "inventory": inventory("h1.test")})
        assert status == 200, reg
        node = reg["nodeToken"]
        status, first = a.post("/api/nodes/watch", node, {"timeoutMs": 0})
        assert status == 200 and first["bindings"] == [], first
        answer: dict = {}

        def watch() -> None:
            answer["doc"] = a.post("/api/nodes/watch", node, {"resourceVersion": first["resourceVersion"],
                                                              "timeoutMs": 20_000}, timeout=30)[1]
            answer["at"] = time.monotonic()

        watcher = threading.Thread(target=watch)
        watcher.start()
        time.sleep(0.3)  # the long poll is waiting on replica a
        now = int(time.time() * 1000)
        status, doc = b.post("/api/compute/reservations/create", TOKENS["alice"], {
            "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 2, "start": now, "end": now + 3_600_000})
        assert status == 202, doc
        created = time.monotonic()
        watcher.join(25)
        assert answer["doc"]["changed"], answer
        bound = [bnd["reservationId"] for bnd in answer["doc"]["bindings"]]
        assert bound == [doc["reservation"]["id"]]
        assert answer["at"] - created < 5  # the figure itself is measured by bench/replicas.py
        # Replica b versions the node's set as a does (both from the database's generation): the agent moving to
        # b with a's version is not answered afresh; its long poll waits there for the next change.
        rv = answer["doc"]["resourceVersion"]
        assert wait_for(lambda: b.post("/api/nodes/watch", node, {"timeoutMs": 0})[1]["resourceVersion"] == rv,
                        timeout=5)
        status, moved = b.post("/api/nodes/watch", node, {"resourceVersion": rv, "timeoutMs": 300})
        assert status == 200 and not moved["changed"] and moved["resourceVersion"] == rv, moved
        assert moved["bindings"] == answer["doc"]["bindings"]


@contextlib.contextmanager
def write_lock_held(db: str):
    """The replicas' write lock held by a session of its own, as a replica holds it while it commits."""
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(db))
    try:
        loop.run_until_complete(conn.execute(f"SELECT pg_advisory_lock({WRITE_LOCK})"))
        yield
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


def scrape(server: ServerProcess) -> str:
    """The replica's /metrics (with the admin token)."""
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def metric(server: ServerProcess, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", scrape(server), re.M).group(1))


def reloads(server: ServerProcess) -> float:
    return metric(server, "berth_store_reloads_total")


def test_a_replica_reads_another_replicas_commit_without_taking_the_write_lock(database, bootstrap):
    """A replica that follows must not hold up the one that writes: it reads each commit it hears of in a snapshot,
    not in a transaction under the write lock (which every commit of the writing replica then waited for)."""
    with ServerProcess(database, bootstrap) as a:
        status, doc = a.post("/api/compute/reservations/create", TOKENS["alice"], create_body("before"))
        assert status == 202, doc
        before = reloads(a)
        with write_lock_held(database):  # another replica commits, and goes on holding the lock
            (generation,), = dbrows.rows(database, "UPDATE replica_state SET generation = generation + 1 "
                                                   "WHERE id = 1 RETURNING generation")
            dbrows.rows(database, "SELECT pg_notify('berth_changes', ?)", str(generation))
            wait_for(lambda: reloads(a) > before, timeout=5)
            status, doc = a.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": doc[
                "reservation"]["id"]})
            assert status == 200, doc  # and reads are served meanwhile
        status, doc = a.post("/api/compute/reservations/create", TOKENS["alice"], create_body("after"))
        assert status == 202, doc


def test_a_replica_that_followed_writes_on_from_where_the_other_left(database, bootstrap):
    """What a following replica read (the generation, the next reservation's seq) is what its first commits build
    on, when it writes after a quiet spell: none of them loses a race to rows it has already read."""
    with ServerProcess(database, bootstrap) as a, ServerProcess(database, bootstrap) as b:
        rebuilt = metric(b, "berth_store_rebuilds_total")
        assert rebuilt >= 1  # its memory, read whole at start
        for i in range(30):  # a writes, b follows
            status, doc = a.post("/api/compute/reservations/create", TOKENS["alice"], create_body(f"a{i}"))
            assert status == 202, doc
        settled = [reloads(b)]

        def b_caught_up() -> bool:  # b's refreshes after a's commits are over
            time.sleep(0.3)
            settled.append(reloads(b))
            return settled[-1] == settled[-2] > 0

        wait_for(b_caught_up)
        # b read only what a changed (a's reservations with their bookings, read ahead in one snapshot), each time;
        # had it missed a booking, its creates below would pick a's devices and lose races to them
        assert metric(b, "berth_store_rebuilds_total") == rebuilt
        time.sleep(SPECULATION_PAUSE_S + 1)  # past the pause after another replica's writes: b speculates again
        for i in range(10):
            status, doc = b.post("/api/compute/reservations/create", TOKENS["alice"], create_body(f"b{i}"))
            assert status == 202, doc
        assert metric(b, "berth_store_race_retries_total") == 0
        assert metric(b, "berth_store_speculative_groups_total") > 0
        seqs = [r[0] for r in dbrows.rows(database, "SELECT seq FROM reservations ORDER BY seq")]
        assert len(seqs) == 40


# ---- behind a load balancer ----------------------------------------------------------------------------------
HAPROXY_CFG = Path(__file__).resolve().parents[2] / "examples" / "haproxy.cfg"


def via(url: str, path: str, body: dict) -> tuple[int, dict]:
    return post(url, path, TOKENS["alice"], body)


def creates_answered(server: ServerProcess) -> float:
    """The creates this replica answered, whatever the outcome."""
    return sum(float(n) for n in re.findall(r"^berth_create_duration_seconds_count\{[^}]*\} (\S+)$", scrape(server),
                                             re.M))


@pytest.fixture
def haproxy(tmp_path):
    """Start HAProxy on examples/haproxy.cfg as the docs give it, with the example's addresses replaced: a
    function of the replicas' URLs, answering the balancer's URL."""
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy; .ci/run installs it)")
    procs: list[subprocess.Popen] = []

    def start(a: str, b: str) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        text = HAPROXY_CFG.read_text()
        for example, real in (("10.0.0.1:8080", a.split("//", 1)[1]), ("10.0.0.2:8080", b.split("//", 1)[1]),
                              ("bind :8080", f"bind 127.0.0.1:{port}")):
            assert example in text, f"examples/haproxy.cfg no longer has {example!r}: update this test with it"
            text = text.replace(example, real)
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(text)
        checked = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        log = tmp_path / "haproxy.log"
        with log.open("w") as out:
            procs.append(subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=out, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            assert procs[-1].poll() is None, "haproxy exited:\n" + log.read_text()
            try:
                return via(url, "/api/compute/reservations/list", {})[0] == 200
            except OSError:
                return False

        wait_for(answers)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def test_behind_haproxy_the_leader_takes_every_request_and_its_death_moves_them_on(database, bootstrap, haproxy):
    grace = ["--node-grace", "6"]
    with ServerProcess(database, bootstrap, grace) as a, ServerProcess(database, bootstrap, grace) as b:
        wait_for(lambda: leads(a) or leads(b))
        if leads(b):  # a is the one to kill below
            a, b = b, a
        lb = haproxy(a.url, b.url)

        def lb_leads() -> bool:
            with urllib.request.urlopen(lb + "/healthz", timeout=5) as resp:
                return json.loads(resp.read())["leads"]

        wait_for(lambda: all(lb_leads() for _ in range(5)))  # the leader's backend is up: it answers them all
        answered = creates_answered(a), creates_answered(b)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: via(lb, "/api/compute/reservations/create", create_body(f"lb{i}")),
                                    range(40)))
        assert [202] * 40 == [status for status, _ in answers], answers
        assert creates_answered(b) == answered[1]  # the other replica answered none of them
        assert creates_answered(a) - answered[0] == 40
        acked = {f"lb{i}": doc["reservation"]["id"] for i, (_, doc) in enumerate(answers)}

        # The leader killed mid-burst: each create is sent again, with its key, until the balancer's answer is 202.
        keys = [f"lb-kill{i}" for i in range(200)]
        lock = threading.Lock()
        enough = threading.Event()
        refused: Counter = Counter()

        def send(key: str) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    status, doc = via(lb, "/api/compute/reservations/create", create_body(key))
                except OSError:
                    status, doc = 0, {}
                if status == 202:
                    with lock:
                        assert acked.setdefault(key, doc["reservation"]["id"]) == doc["reservation"]["id"]
                        if len(acked) >= 50:  # 10 of this burst
                            enough.set()
                    return
                with lock:
                    refused[status] += 1
                assert status in (0, 502, 503, 504), (status, doc)  # the balancer's or a replica's "try again"
                time.sleep(0.2)
            raise AssertionError(f"{key}: not acknowledged within 60 s")

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(send, key) for key in keys]
            enough.wait(30)
            a.kill()
            for future in futures:
                future.result()
        assert set(keys) <= set(acked)
        assert creates_answered(b) > answered[1], refused  # the leader died mid-burst: b answered the rest
        check_database(database, acked)
        assert len(set(acked.values())) == len(acked) == 240
        assert used_gpus(b) == charged_gpus(database) == 240

        # b leads now, and the balancer sends it everything
        wait_for(lambda: leads(b), timeout=10)
        wait_for(lambda: all(lb_leads() for _ in range(5)), timeout=10)
        before = creates_answered(b)
        for i in range(10):
            status, doc = via(lb, "/api/compute/reservations/create", create_body(f"lb-after{i}"))
            assert status == 202, doc
        assert creates_answered(b) - before == 10
