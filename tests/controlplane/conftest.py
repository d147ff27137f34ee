"""Fixtures for the control plane: a real server on loopback on each store engine (a SQLite file, a throwaway
PostgreSQL database) and a fake clock."""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import uuid
from pathlib import Path

import pytest

from controlplane.api.app import CONTROL_PLANE, create_app
from controlplane.domain.clock import FakeClock
from controlplane.state import WriterState
from controlplane.wiring import Config
from tests import dbrows
from tests.pgcluster import pg_cluster  # noqa: F401 (fixture)
from tests.serverproc import ServerProcess

T0 = 1_800_000_000_000  # the fake clock's start, epoch ms
K8S_BOOT = "node-token-k8s-0000001"  # the kubernetes pool's node bootstrap token
HOUR = 3_600_000

TOKENS = {
    "alice": "token-acme-alice-000001",
    "bob": "token-acme-bob-0000001",
    "agent": "token-acme-agent-000001",
    "robot": "token-acme-robot-000001",
    "carol": "token-globex-carol-0001",
    "dave": "token-initech-dave-00001",
}

POLICIES = """
permit (principal, action, resource) when { principal.tenant == resource.tenant };
forbid (principal is Agent, action == Action::"compute:reservations:create", resource is Reservation)
  when { resource.gpuCount > 2 };
@id("max-week")
@reason("reservations longer than 168 h are not allowed")
forbid (principal, action in [Action::"compute:reservations:create", Action::"compute:reservations:extend"], resource is Reservation)
  when { resource.durationHours > 168 };
forbid (principal == User::"bob", action == Action::"compute:reservations:read", resource is Reservation)
  when { resource.principal != principal };
"""


def ssh_key(n: int = 1, comment: str = "tenant@example") -> str:
    """An Ed25519 public key line as `ssh-keygen -y` prints one (the SSH wire form, 32 bytes of key material)."""
    blob = b"".join(struct.pack(">I", len(p)) + p for p in (b"ssh-ed25519", bytes([n]) * 32))
    return f"ssh-ed25519 {base64.b64encode(blob).decode()} {comment}"


NODE_ACCESS = {"sshKeys": [ssh_key(1)]}  # what a node binding's create carries


def h100_node(node_id: str, pool: str = "h100", vcpu: int = 64, memory: int = 512, hugepages: int = 16) -> dict:
    return {
        "id": node_id, "pool": pool, "hostname": f"{node_id}.test", "vcpu": vcpu, "memoryGiB": memory,
        "hugepages1Gi": hugepages, "gpus": [{"numaNode": 0 if i < 4 else 1} for i in range(8)],
    }


MIG_BOOT = "node-token-mig-0000001"


def bootstrap_doc() -> dict:
    return {
        "adminToken": "admin-token-for-tests-0001",
        "tenants": [
            {"id": "acme", "budgetUsd": "100", "quota": {
                "gpu:H100_80GB": 64, "gpu:A100_80GB:1g.10gb": 14, "gpu:L4_24GB:slot": 16, "vcpu": 32, "memoryGiB": 256}},
            {"id": "globex", "budgetUsd": "0", "quota": {"gpu:H100_80GB": 16}},
            {"id": "initech", "budgetUsd": "50", "quota": {"gpu:H100_80GB": 16}},
        ],
        "principals": [
            {"id": "alice", "tenant": "acme", "token": TOKENS["alice"]},
            {"id": "bob", "tenant": "acme", "token": TOKENS["bob"]},
            {"id": "agent", "tenant": "acme", "kind": "agent", "delegatedBy": "alice", "token": TOKENS["agent"]},
            {"id": "robot", "tenant": "acme", "kind": "agent", "token": TOKENS["robot"]},  # acts for nobody
            {"id": "carol", "tenant": "globex", "token": TOKENS["carol"]},
            {"id": "dave", "tenant": "initech", "token": TOKENS["dave"]},
        ],
        "pools": [
            {"id": "h100", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB", "pricePerGpuHourUsd": "2.5",
             "policy": {"tenantRoot": True},
             "offers": [{"tenant": "globex", "budgetCheck": True},
                        {"tenant": "initech", "quota": {"vcpu": 8}}]},
            {"id": "mig", "owner": "acme", "region": "us", "gpuModel": "A100_80GB", "sharing": "mig"},
            {"id": "k8s", "owner": "acme", "region": "us", "gpuModel": "H100_80GB",
             "policy": {"kubernetes": True, "perGpu": {"vcpu": 4, "memoryGiB": 32}}, "offers": [{"tenant": "globex"}]},
            {"id": "slots", "owner": "acme", "region": "us", "gpuModel": "L4_24GB", "sharing": "slots",
             "policy": {"slotsPerGpu": 2}},
            {"id": "budget", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB", "policy": {"budgetCheck": True}},
            {"id": "old", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB", "archived": True},
            {"id": "globex-own", "owner": "globex", "region": "eu", "gpuModel": "H100_80GB"},
        ],
        "nodes": [
            h100_node("h1"), h100_node("h2"),
            {"id": "m1", "pool": "mig", "hostname": "m1.test", "vcpu": 32, "memoryGiB": 256,
             "gpus": [{"mig": ["1g.10gb"] * 7}, {"mig": ["1g.10gb"] * 5 + ["2g.20gb"]}]},
            h100_node("k1", pool="k8s"),
            {"id": "s1", "pool": "slots", "hostname": "s1.test", "vcpu": 16, "memoryGiB": 64, "gpus": 2},
            h100_node("b1", pool="budget"),
            h100_node("o1", pool="old"),
            h100_node("g1", pool="globex-own"),
        ],
        "nodeTokens": [{"pool": "h100", "token": "node-token-h100-000001"},
                       {"pool": "k8s", "token": K8S_BOOT}, {"pool": "mig", "token": MIG_BOOT}],
        "policies": POLICIES,
    }


class Api:
    """Real HTTP against the test server: call(method, who, body) -> (status, json)."""

    def __init__(self, client, clock: FakeClock):
        self.client = client
        self.clock = clock
        self.registered: dict[str, dict] = {}  # hostname -> the register answer (tests/controlplane/test_nodes.py)

    @property
    def cp(self):
        return self.client.server.app[CONTROL_PLANE]

    @property
    def engine(self) -> str:
        return "postgresql" if self.cp.config.db.startswith("postgresql") else "sqlite"

    def rows(self, sql: str, *args) -> list[tuple]:
        """Rows of one SQL statement on the store's database, whichever the engine (`?` placeholders)."""
        return dbrows.store_rows(self.cp.store, sql, *args)

    async def post(self, path: str, who: str | None, body=None, headers: dict | None = None, raw: bytes | None = None):
        hdrs = dict(headers or {})
        if who is not None:
            hdrs["Authorization"] = f"Bearer {TOKENS.get(who, who)}"
        data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
        hdrs.setdefault("Content-Type", "application/json")
        resp = await self.client.post(path, data=data, headers=hdrs)
        return resp.status, await resp.json()

    async def call(self, method: str, who: str | None, body=None, **kw):
        return await self.post(f"/api/compute/reservations/{method}", who, body, **kw)

    async def create(self, who: str = "alice", key: str | None = None, **fields):
        body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1, **fields}
        if "end" in fields and "durationHours" not in fields:
            body.pop("durationHours")
        body = {k: v for k, v in body.items() if v is not None}
        if key is not None:
            body["idempotencyKey"] = key
        return await self.call("create", who, body)

    async def ok(self, method: str, who: str, body) -> dict:
        status, doc = await self.call(method, who, body)
        assert status in (200, 202), (status, doc)
        return doc["reservation"] if "reservation" in doc else doc

    async def settle(self, advance_ms: int = 0) -> int:
        """Move the fake clock, run the reconciler until nothing is due, and let background work finish."""
        if advance_ms:
            self.clock.advance(advance_ms)
        await self.cp.reconciler.drain()
        moved = await self.cp.reconciler.settle()
        await self.cp.reconciler.drain()
        return moved

    async def events(self, who: str = "alice", after: int | None = None) -> list[dict]:
        status, doc = await self.post("/api/compute/events/list", who, {"after": after} if after else {})
        assert status == 200, doc
        return doc["events"]


def snapshot(state: WriterState) -> dict:
    """What a writer's memory says of the bookings, the quota held and the indexes, comparable."""
    return {
        "bookings": sorted((b.reservation_id, b.pool_id, b.node_id, tuple(b.units), b.start, b.end, b.share)
                           for held in state.calendar.by_reservation.values() for b in held),
        "ledger": {t: {k: v for k, v in used.items() if v} for t, used in state.ledger.used.items()
                   if any(used.values())},
        "charged": {t: sorted(held) for t, held in state.charged.items() if held},
        "pending": {p: list(ids) for p, ids in state.pending.items() if ids},
        "spot": {p: list(ids) for p, ids in state.spot.items() if ids},
    }


async def check_memory(api: Api) -> None:
    """The writer's memory equals one rebuilt from what the database holds (read in a group of the writer)."""
    cp = api.cp

    def both(tx):
        now = cp.clock.compute_now()
        rebuilt = WriterState()
        rebuilt.rebuild(cp.catalog.current, tx.live_reservations(now), tx.live_bookings(now), now)
        return snapshot(cp.state), snapshot(rebuilt)

    held, rebuilt = await cp.store.call(both)
    assert held == rebuilt


@pytest.fixture
def bootstrap_file(tmp_path: Path):
    def write(doc: dict | None = None) -> str:
        path = tmp_path / "bootstrap.json"
        path.write_text(json.dumps(doc or bootstrap_doc()))
        return str(path)

    return write


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


def _engine_url(request, sqlite_dir):
    """The store's URL for request.param: a SQLite file in sqlite_dir, or a fresh database on the session's
    throwaway PostgreSQL cluster (dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{sqlite_dir / 'cp.db'}"
        return
    cluster = request.getfixturevalue("pg_cluster")
    name = f"berth_{uuid.uuid4().hex[:12]}"
    yield cluster.createdb(name)
    cluster.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_db_url(request, tmp_path_factory):
    """As db_url, for a module's one server process (the fuzz and the hostile-input tests), once per engine."""
    yield from _engine_url(request, tmp_path_factory.mktemp("db"))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The store's URL, once per engine: a SQLite file, and a fresh database on the session's throwaway
    PostgreSQL cluster (dropped after the test)."""
    yield from _engine_url(request, tmp_path)


@pytest.fixture
async def api(db_url, aiohttp_client, bootstrap_file, clock) -> Api:  # db_url first: dropped last
    # The reconciler's loop is off: tests move the fake clock and then settle() it, deterministically.
    config = Config(db=db_url, bootstrap=bootstrap_file(), clock=clock, synchronous="NORMAL", reconcile=False)
    client = await aiohttp_client(create_app(config))
    return Api(client, clock)


@pytest.fixture
async def other(api, db_url, tmp_path):
    """Another replica on the api's database (PostgreSQL), in its own process, stopped after the test."""
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    replica = ServerProcess(db_url, boot)
    await asyncio.to_thread(replica.start)  # this replica's loop goes on meanwhile (its writer may hold the lock)
    try:
        yield replica
    finally:
        replica.stop()
