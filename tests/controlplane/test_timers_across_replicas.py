"""Timers one replica sets and another runs: only the leader's reconciler moves what is due, whichever replica
made the change that set the time. A lease renewed on one replica lapses on the leader by the renewed deadline, not
the one its memory first held, and still lapses once that one passes; a node handed back on the replica that does
not lead, and never reported clean, goes to maintenance on the leader at its cleaning's deadline. This replica (the
API under test, on a fake clock, whose reconciler is moved by hand) is the leader; the other one runs on the real
clock, so the fake one starts a little behind it."""
from __future__ import annotations

import asyncio
import time

import pytest

from controlplane.domain.clock import FakeClock
from controlplane.store import pg_writer
from tests.controlplane.conftest import NODE_ACCESS, TOKENS
from tests.controlplane.test_admin_api import ADMIN
from tests.controlplane.test_speculation import WINDOW, caught_up

pytestmark = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)

BEHIND_S = 20  # this replica's fake clock starts that far behind the real one the other replica runs on


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(time.time_ns() // 1_000_000 - BEHIND_S * 1000)


@pytest.fixture(autouse=True)
def short_pause(monkeypatch):
    monkeypatch.setattr(pg_writer, "SPECULATION_PAUSE_S", 0.2)


async def test_a_lease_renewed_on_another_replica_lapses_by_the_renewed_deadline(api, other):
    status, doc = await api.call("create", "alice", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1,
                                                     **WINDOW, "leaseSeconds": 30, "idempotencyKey": "leased"})
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    rid, first = doc["reservation"]["id"], doc["reservation"]["leaseDeadline"]
    status, renewed = await asyncio.to_thread(other.post, "/api/compute/reservations/renew", TOKENS["alice"],
                                              {"reservationId": rid})
    assert status == 200, renewed
    deadline = renewed["reservation"]["leaseDeadline"]
    assert deadline >= first + BEHIND_S * 1000 - 1000  # the other replica's clock is ahead
    await caught_up(api)

    # Past the first deadline, before the renewed one: this replica's timer for the first finds it renewed.
    await api.settle(advance_ms=first + 1000 - api.clock.compute_now())
    status, doc = await api.call("get", "alice", {"reservationId": rid})
    assert doc["reservation"]["state"] == "placed" and doc["reservation"]["leaseDeadline"] == deadline, doc

    # Past the renewed deadline: it lapses, here, at that time.
    await api.settle(advance_ms=deadline + 1000 - api.clock.compute_now())
    status, doc = await api.call("get", "alice", {"reservationId": rid})
    assert doc["reservation"]["state"] == "released" and doc["reservation"]["reason"] == "lease-lapsed", doc
    assert api.rows("SELECT at FROM events WHERE reservation_id = ? AND type = 'reservation.released'", rid) == [
        (deadline + 1000,)]


async def test_a_node_handed_back_on_another_replica_goes_to_maintenance_here_at_its_cleanings_deadline(api, other):
    from tests.controlplane.test_nodes import BOOT, inventory

    status, doc = await api.call("create", "alice", {"poolId": "h100", "gpuModel": "H100_80GB", "binding": "node",
                                                     "access": NODE_ACCESS, "durationHours": 1, "idempotencyKey": "n"})
    assert status == 202, doc
    rid, node_id = doc["reservation"]["id"], doc["reservation"]["placements"][0]["nodeId"]
    status, node = await api.post("/api/nodes/register", BOOT, {"hostname": f"{node_id}.test",
                                                                "inventory": inventory(f"{node_id}.test")})
    assert status == 200, node
    token = node["nodeToken"]
    await api.settle()  # its window started: binding
    status, rep = await api.post("/api/nodes/report", token, {"reports": [{
        "reservationId": rid, "status": "bound", "ssh": {"host": "n.test", "port": 22, "user": "root",
                                                         "hostKeys": ["SHA256:" + "h" * 43]}}]})
    assert [rid] == rep["accepted"], rep
    await caught_up(api)
    # released and handed back, both on the other replica: the node is cleaned there (inband), until its deadline
    for path, body in (("/api/compute/reservations/release", {"reservationId": rid}),
                       ("/api/nodes/report", {"reports": [{"reservationId": rid, "status": "unbound"}]})):
        status, answer = await asyncio.to_thread(other.post, path, TOKENS["alice"] if "compute" in path else token,
                                                 body)
        assert status in (200, 202), answer
    await caught_up(api)

    async def node_here() -> dict:
        status, doc = await api.post("/api/admin/nodes/get", ADMIN, {"nodeId": node_id})
        assert status == 200, doc
        return doc["node"]

    cleaning = api.cp.catalog.current.nodes[node_id].cleaning
    assert cleaning is not None and cleaning.reservation_id == rid and (await node_here())["state"] == "cleaning"
    await api.settle(advance_ms=cleaning.deadline - 60_000 - api.clock.compute_now())
    assert "cleaning" == (await node_here())["state"]  # a minute before: still cleaning
    await api.settle(advance_ms=61_000)
    seen = await node_here()
    assert seen["state"] == "maintenance" and "was not clean" in seen["stateReason"], seen
