"""Agents in delegated sessions: a refused create the user would be allowed opens a confirmation."""
from __future__ import annotations

from tests.controlplane.conftest import T0

BIG = {"gpuCount": 4}  # the agent alone may book at most 2 GPUs


async def confirm_call(api, method: str, who: str, body: dict):
    return await api.post(f"/api/iam/confirmations/{method}", who, body)


async def test_refused_agent_gets_confirmation_required_with_what_is_asked(api):
    status, doc = await api.create("agent", key="big", **BIG)
    assert (status, doc["error"]["code"]) == (403, "CONFIRMATION_REQUIRED")
    details = doc["error"]["details"]
    assert details["approver"] == "alice"
    assert T0 < details["expiresAt"] <= T0 + 30 * 60_000
    assert details["asked"]["gpuCount"] == 4 and details["asked"]["poolId"] == "h100"
    assert "agent asks, acting for you, to reserve 4 H100_80GB in pool h100" in doc["error"]["message"]
    assert "reservationId" not in details  # a synchronous refusal names no resource: nothing exists yet
    from controlplane.domain.ids import reservation_id
    status, _ = await api.call("get", "alice", {"reservationId": reservation_id("acme", "agent", "big")})
    assert status == 404  # the draft waits, internal
    assert [e["type"] for e in await api.events()] == ["reservation.awaiting-confirmation"]
    again = (await api.create("agent", key="big", **BIG))[1]
    assert again["error"]["details"]["confirmationId"] == details["confirmationId"]


async def test_approval_by_the_user_lets_the_same_key_continue(api):
    _, doc = await api.create("agent", key="big", **BIG)
    cid = doc["error"]["details"]["confirmationId"]
    listed = (await confirm_call(api, "list", "alice", {}))[1]["confirmations"]
    assert [c["id"] for c in listed] == [cid] and listed[0]["status"] == "pending"
    status, doc = await confirm_call(api, "approve", "alice", {"confirmationId": cid})
    assert status == 200 and doc["confirmation"]["status"] == "approved"
    status, doc = await api.create("agent", key="big", **BIG)
    assert status == 202 and doc["reservation"]["state"] == "placed"
    assert doc["reservation"]["principalId"] == "agent"


async def test_only_the_delegating_user_decides(api):
    _, doc = await api.create("agent", key="big", **BIG)
    cid = doc["error"]["details"]["confirmationId"]
    status, doc = await confirm_call(api, "approve", "agent", {"confirmationId": cid})
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    status, doc = await confirm_call(api, "get", "agent", {"confirmationId": cid})
    assert status == 200  # the agent may read what it asked
    status, doc = await confirm_call(api, "approve", "bob", {"confirmationId": cid})
    assert status == 404
    status, doc = await confirm_call(api, "get", "carol", {"confirmationId": cid})
    assert status == 404


async def test_a_denial_leaves_the_key_access_denied(api):
    _, doc = await api.create("agent", key="big", **BIG)
    cid = doc["error"]["details"]["confirmationId"]
    status, doc = await confirm_call(api, "deny", "alice", {"confirmationId": cid})
    assert doc["confirmation"]["status"] == "denied"
    status, doc = await api.create("agent", key="big", **BIG)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    # a person's denial, said as such (not "no policy permits it"), with the confirmation that carried it
    assert {"confirmationId": cid, "status": "denied", "approver": "alice"}.items() <= doc["error"]["details"].items()
    assert f"denied by alice (confirmation {cid})" in doc["error"]["message"]
    status, doc = await confirm_call(api, "approve", "alice", {"confirmationId": cid})
    assert (status, doc["error"]["code"], doc["error"]["details"]["status"]) == (409, "INVALID_STATE", "denied")
    status, doc = await api.create("agent", key="big", gpuCount=3)  # another request under the refused key
    assert (409, "CONFLICT") == (status, doc["error"]["code"])
    assert "reservationId" not in doc["error"]["details"]  # its draft is no reservation a tenant can get


async def test_a_confirmation_lapses_after_30_minutes(api):
    _, doc = await api.create("agent", key="big", **BIG)
    cid = doc["error"]["details"]["confirmationId"]
    await api.settle(30 * 60_000)
    status, doc = await confirm_call(api, "get", "alice", {"confirmationId": cid})
    assert doc["confirmation"]["status"] == "expired"
    status, doc = await api.create("agent", key="big", **BIG)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    assert ("expired", cid) == (doc["error"]["details"]["status"], doc["error"]["details"]["confirmationId"])
    assert "confirmation.expired" in [e["type"] for e in await api.events()]


async def test_an_approval_not_retried_within_30_minutes_stays_approved_and_the_retry_says_the_draft_lapsed(api):
    _, doc = await api.create("agent", key="big", **BIG)
    cid = doc["error"]["details"]["confirmationId"]
    await api.settle(5 * 60_000)
    status, doc = await confirm_call(api, "approve", "alice", {"confirmationId": cid})
    assert (status, doc["confirmation"]["status"]) == (200, "approved")
    await api.settle(26 * 60_000)
    status, doc = await confirm_call(api, "get", "alice", {"confirmationId": cid})
    assert doc["confirmation"]["status"] == "approved"  # the person's decision stays on record
    status, doc = await confirm_call(api, "list", "alice", {"status": "approved"})
    assert [cid] == [c["id"] for c in doc["confirmations"]]
    status, doc = await api.create("agent", key="big", **BIG)
    assert (status, doc["error"]["code"], doc["error"]["details"]["status"]) == (403, "ACCESS_DENIED", "approved")
    assert "approved by alice, but not retried within the 30 minutes" in doc["error"]["message"], doc
    types = [e["type"] for e in await api.events()]
    assert "confirmation.lapsed" in types and "confirmation.expired" not in types


async def test_what_the_user_could_not_do_either_is_a_plain_refusal(api):
    status, doc = await api.create("agent", key="long", durationHours=200)  # over the 168 h cap for everyone
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")


async def test_an_agent_acting_for_nobody_is_refused_outright(api):
    status, doc = await api.create("robot", key="big", **BIG)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
