"""A lease renewed on one replica and lapsed by the timers of another (the leader's): the leader ends it by the
renewed deadline, not the one its memory first held, and still ends it once that one passes."""
from __future__ import annotations

import asyncio
import time

import pytest

from controlplane.domain.clock import FakeClock
from controlplane.store import pg_writer
from tests.controlplane.conftest import TOKENS
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
