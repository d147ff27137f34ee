"""reservation.ending on the fake clock: emitted once, the pool's endingWarningMinutes (default 30) before the
booking's end, again for the new end after an extension, never for a reservation that has not started."""
from __future__ import annotations

from tests.controlplane.conftest import HOUR, T0

MIN = 60_000


async def endings(api, rid: str) -> list[dict]:
    return [e["data"] for e in await api.events() if e["type"] == "reservation.ending" and e["reservationId"] == rid]


async def test_a_warning_30_minutes_before_each_end_once(api):
    res = (await api.create(key="w"))[1]["reservation"]  # now for an hour
    later = (await api.create(key="later", start=T0 + 3 * HOUR, end=T0 + 4 * HOUR))[1]["reservation"]
    await api.settle()
    await api.settle(29 * MIN)
    assert [] == await endings(api, res["id"])
    await api.settle(2 * MIN)
    await api.settle(5 * MIN)
    assert [{"end": T0 + HOUR, "secondsLeft": 29 * 60, "state": "binding", "poolId": res["poolId"]}] == \
        await endings(api, res["id"])
    await api.ok("extend", "alice", {"reservationId": res["id"], "by": HOUR})  # re-arms it for the new end
    await api.settle(53 * MIN)  # T0 + 89 min
    assert [] == [e for e in await endings(api, res["id"]) if e["end"] == T0 + 2 * HOUR]
    await api.settle(2 * MIN)
    assert [T0 + HOUR, T0 + 2 * HOUR] == [e["end"] for e in await endings(api, res["id"])]
    assert [] == await endings(api, later["id"])  # placed, its window ahead: nothing yet


async def test_a_pool_may_turn_it_off(api, bootstrap_file):
    from tests.controlplane.conftest import bootstrap_doc

    doc = bootstrap_doc()
    for pool in doc["pools"]:
        pool.setdefault("policy", {})["endingWarningMinutes"] = 0
    status, answer = await api.post("/api/admin/bootstrap", "admin-token-for-tests-0001", doc)
    assert status == 200, answer
    res = (await api.create(key="quiet"))[1]["reservation"]
    await api.settle()
    await api.settle(45 * MIN)
    assert [] == await endings(api, res["id"])


async def test_the_warning_time_is_checked(api):
    from tests.controlplane.conftest import bootstrap_doc

    doc = bootstrap_doc()
    doc["pools"][0]["policy"]["endingWarningMinutes"] = 1441
    status, answer = await api.post("/api/admin/bootstrap", "admin-token-for-tests-0001", doc)
    assert 400 == status and "endingWarningMinutes" in answer["error"]["message"], answer
