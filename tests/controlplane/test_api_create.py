"""create through real HTTP: placement, host resources, idempotency, and every refusal the seed lists."""
from __future__ import annotations

import pytest

from tests.controlplane.conftest import HOUR, NODE_ACCESS, T0


async def test_create_places_a_fitting_request_and_answers_202(api):
    status, doc = await api.create(key="k1", gpuCount=2)
    assert status == 202
    res = doc["reservation"]
    assert res["state"] == "placed"
    assert (res["start"], res["end"]) == (T0, T0 + HOUR)
    assert res["operation"]["status"] == "running" and res["operation"]["kind"] == "create"
    assert len(res["placements"]) == 1 and len(res["placements"][0]["devices"]) == 2
    assert [e["type"] for e in await api.events()] == ["reservation.placed"]


async def test_durationhours_answers_the_windows_length_however_it_was_asked(api):
    asap = (await api.create(key="asap", gpuCount=1, durationHours=2))[1]["reservation"]
    fixed = (await api.create(key="fixed", gpuCount=1, start=T0 + HOUR, durationHours=3))[1]["reservation"]
    ended = (await api.create(key="end", gpuCount=1, durationHours=None, start=T0 + HOUR, end=T0 + 5 * HOUR))[1]
    assert (2, 3, 4) == (asap["durationHours"], fixed["durationHours"], ended["reservation"]["durationHours"])
    status, doc = await api.call("extend", "alice", {"reservationId": fixed["id"], "until": T0 + 5 * HOUR})
    assert (202, 4) == (status, doc["reservation"]["durationHours"])


async def test_whole_gpu_request_books_the_per_gpu_share_which_is_also_the_floor(api):
    # h100 nodes: 64 vcpu, 512 GiB, 8 GPUs -> 8 vcpu and 64 GiB per GPU.
    res = (await api.create(key="a", gpuCount=2))[1]["reservation"]
    assert res["resources"] == {"vcpu": 16.0, "memoryGiB": 128.0, "hugepages1Gi": 0}
    res = (await api.create(key="b", gpuCount=1, resources={}))[1]["reservation"]
    assert res["resources"] == {"vcpu": 8.0, "memoryGiB": 64.0, "hugepages1Gi": 0}
    res = (await api.create(key="c", gpuCount=1, resources={"vcpu": 2, "memoryGiB": 1}))[1]["reservation"]
    assert res["resources"] == {"vcpu": 8.0, "memoryGiB": 64.0, "hugepages1Gi": 0}


async def test_excess_above_the_share_is_charged_and_hugepages_count_as_memory(api):
    # acme has vcpu 32 and memoryGiB 256 of quota for the excess.
    res = (await api.create(key="a", gpuCount=1, resources={"vcpu": 40, "memoryGiB": 64, "hugepages1Gi": 4}))[1]["reservation"]
    assert res["resources"] == {"vcpu": 40.0, "memoryGiB": 64.0, "hugepages1Gi": 4}
    assert api.cp.state.ledger.usage("acme")["vcpu_milli"] == 32_000
    assert api.cp.state.ledger.usage("acme")["memory_mib"] == 4 * 1024
    status, doc = await api.create(key="b", gpuCount=1, resources={"vcpu": 9})
    assert status == 429 and doc["error"]["code"] == "QUOTA_EXCEEDED"
    assert doc["error"]["details"]["resource"] == "vcpu"


async def test_mig_and_slot_requests_book_no_share(api):
    res = (await api.create(key="m", poolId="mig", gpuModel="A100_80GB", migProfile="1g.10gb", gpuCount=3))[1]["reservation"]
    assert res["state"] == "placed" and res["resources"] == {"vcpu": 0.0, "memoryGiB": 0.0, "hugepages1Gi": 0}
    assert all(d.startswith("gpu0/") for d in res["placements"][0]["devices"])  # MIG instances of one GPU first
    res = (await api.create(key="s", poolId="slots", gpuModel="L4_24GB", gpuCount=2))[1]["reservation"]
    devices = res["placements"][0]["devices"]
    assert res["state"] == "placed" and len({d.split("/")[0] for d in devices}) == 2  # slots on distinct GPUs


async def test_missing_quota_row_grants_nothing_unless_the_offer_names_the_resource(api):
    # globex has no vcpu row: any excess is refused; initech's offer of h100 names vcpu 8.
    status, doc = await api.create("dave", key="d1", gpuCount=1, resources={"vcpu": 16})
    assert status == 202, doc
    status, doc = await api.create("dave", key="d2", gpuCount=1, resources={"vcpu": 9})
    assert (status, doc["error"]["code"]) == (429, "QUOTA_EXCEEDED")
    assert doc["error"]["details"]["resource"] == "offer:h100:vcpu"
    status, doc = await api.create("carol", key="c1", poolId="k8s", gpuCount=1, resources={"vcpu": 5})
    assert doc["error"]["code"] in ("QUOTA_EXCEEDED", "INVALID_INPUT")


async def test_numa_alignment_keeps_a_reservations_gpus_on_one_numa_node(api):
    first = (await api.create(key="a", gpuCount=3))[1]["reservation"]
    second = (await api.create(key="b", gpuCount=2))[1]["reservation"]
    node = first["placements"][0]["nodeId"]
    assert second["placements"][0]["nodeId"] == node  # packed onto the node already in use
    numa = lambda d: 0 if int(d[3:]) < 4 else 1  # noqa: E731
    assert len({numa(d) for d in second["placements"][0]["devices"]}) == 1


async def test_least_fragmentation_keeps_whole_nodes_whole(api):
    for i in range(7):
        await api.create(key=f"one-{i}", gpuCount=1)
    whole = (await api.create(key="whole", gpuCount=8))[1]["reservation"]
    assert whole["state"] == "placed"
    nodes = {p["nodeId"] for p in whole["placements"]}
    assert len(nodes) == 1


async def test_a_gang_is_placed_all_or_nothing(api):
    await api.create(key="blocker", gpuCount=4)
    status, doc = await api.create(key="gang", gpuCount=4, nodeCount=2)
    res = doc["reservation"]
    assert res["state"] == "placed" and len({p["nodeId"] for p in res["placements"]}) == 2
    status, doc = await api.create(key="gang2", gpuCount=4, nodeCount=2)
    res = doc["reservation"]
    assert res["state"] == "pending" and res["placements"] == []  # one node had room, not two
    assert api.cp.state.calendar.bookings_of(res["id"]) == []


async def test_a_request_that_does_not_fit_is_pending_with_unschedulable(api):
    await api.create(key="full-1", gpuCount=8)
    await api.create(key="full-2", gpuCount=8)
    status, doc = await api.create(key="late", gpuCount=1)
    res = doc["reservation"]
    assert status == 202 and res["state"] == "pending"
    cond = res["conditions"][0]
    assert (cond["type"], cond["status"]) == ("Unschedulable", "True")
    assert "reservation.pending" in [e["type"] for e in await api.events()]


async def test_a_request_the_pool_could_never_hold_is_refused_at_once(api):
    status, doc = await api.create(key="huge", gpuCount=9)
    assert status == 409 and doc["error"]["code"] == "NO_CAPACITY"
    assert doc["error"]["details"]["reason"] == "no_stock"  # no pool offered to acme has 9 H100s on a node
    assert doc["error"]["details"]["alternatives"] == []
    assert (8, 2) == (doc["error"]["details"]["maxGpuCountPerNode"], doc["error"]["details"]["nodesWithMaxGpuCount"])
    assert "its largest node has 8 H100_80GB (the most one node can give): at most 2 x 8" in doc["error"]["message"]
    status, doc = await api.create(key="huge2", gpuCount=1, nodeCount=3)
    assert doc["error"]["code"] == "NO_CAPACITY"
    status, _ = await api.call("get", "alice", {"reservationId": "x"})
    assert status == 404


async def test_fixed_windows_do_not_collide_with_later_bookings(api):
    await api.create(key="f1", gpuCount=8, nodeCount=2, start=T0 + 10 * HOUR, end=T0 + 12 * HOUR)
    now = (await api.create(key="now", gpuCount=8, nodeCount=2, durationHours=10))[1]["reservation"]
    assert now["state"] == "placed"
    overlap = (await api.create(key="ov", gpuCount=1, durationHours=11))[1]["reservation"]
    assert overlap["state"] == "pending"


# ---- idempotency ------------------------------------------------------------

async def test_same_key_same_request_returns_the_stored_reservation(api):
    _, first = await api.create(key="same", gpuCount=1)
    _, again = await api.create(key="same", gpuCount=1, wait={"timeoutMs": 100})  # wait is not compared
    assert first["reservation"]["id"] == again["reservation"]["id"]
    assert len(api.cp.state.calendar.by_reservation) == 1
    assert [e["type"] for e in await api.events()] == ["reservation.placed"]


@pytest.mark.parametrize("key", ['q"uote \\ back/slash', "ünïcödé ✓ 日本", "nul \u0000 tab \t newline \n",
                                 '{"looks": ["like", "json"]}', "x" * 255])
async def test_a_key_of_any_text_is_stored_and_replayed_as_sent(api, key):
    """The key travels inside the reservation's stored document (one JSON document per row kind on PostgreSQL):
    any text comes back as sent, from the database, and replays the one reservation."""
    status, first = await api.create(key=key, gpuCount=1)
    assert status == 202 and first["reservation"]["idempotencyKey"] == key, first
    rid = first["reservation"]["id"]
    assert [(rid,)] == api.rows("SELECT id FROM reservations WHERE id = ?", rid)
    stored = api.cp.store.reservation(rid)  # read from the database, not the writer's memory
    assert (stored.idempotency_key, stored.state) == (key, "placed")
    assert [(p.node_id, list(p.units)) for p in stored.placements] == \
        [(p["nodeId"], p["devices"]) for p in first["reservation"]["placements"]]
    status, again = await api.create(key=key, gpuCount=1)
    assert (status, again) == (202, first)
    assert [e["type"] for e in await api.events()] == ["reservation.placed"]


async def test_header_key_and_body_key_are_one_key(api):
    body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}
    s1, a = await api.call("create", "alice", body, headers={"Idempotency-Key": "hk"})
    s2, b = await api.call("create", "alice", {**body, "idempotencyKey": "hk"})
    assert a["reservation"]["id"] == b["reservation"]["id"]
    s3, c = await api.call("create", "alice", {**body, "idempotencyKey": "other"}, headers={"Idempotency-Key": "hk"})
    assert (s3, c["error"]["details"]["field"]) == (400, "idempotencyKey")


async def test_same_key_different_request_is_conflict_naming_the_reservation(api):
    _, first = await api.create(key="k", gpuCount=1)
    status, doc = await api.create(key="k", gpuCount=2)
    assert status == 409 and doc["error"]["code"] == "CONFLICT"
    assert doc["error"]["details"]["reservationId"] == first["reservation"]["id"]


async def test_the_key_is_per_principal(api):
    _, a = await api.create("alice", key="k")
    _, b = await api.create("bob", key="k")
    assert a["reservation"]["id"] != b["reservation"]["id"]


async def test_a_refused_key_stays_access_denied(api):
    status, doc = await api.create("robot", key="big", gpuCount=4)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    status, doc = await api.create("robot", key="big", gpuCount=4)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    status, doc = await api.create("robot", key="small", gpuCount=2)
    assert status == 202


async def test_quota_exceeded_keeps_the_draft_so_the_same_key_succeeds_later(api):
    blockers = []
    for i in range(8):  # 64 GPUs of quota, 16 GPUs of pool: use quota with future windows
        _, doc = await api.create(key=f"q{i}", gpuCount=8, start=T0 + (i + 1) * 10 * HOUR, end=T0 + (i + 1) * 10 * HOUR + HOUR)
        blockers.append(doc["reservation"]["id"])
    status, doc = await api.create(key="wait-for-quota", gpuCount=1)
    assert (status, doc["error"]["code"]) == (429, "QUOTA_EXCEEDED")
    status, doc = await api.call("get", "alice", {"reservationId": doc["error"]["details"].get("reservationId", "x")})
    assert status == 404  # the draft is internal
    await api.ok("cancel", "alice", {"reservationId": blockers[0]})
    status, doc = await api.create(key="wait-for-quota", gpuCount=1)
    assert status == 202 and doc["reservation"]["state"] == "placed"


async def test_spend_limit_reached_when_the_pool_or_offer_checks_the_budget(api):
    status, doc = await api.create("carol", key="g")  # globex's offer checks the budget; it has 0 USD
    assert (status, doc["error"]["code"]) == (402, "SPEND_LIMIT_REACHED")
    status, doc = await api.create("alice", key="b", poolId="budget")  # acme has 100 USD unspent
    assert status == 202
    status, doc = await api.create("dave", key="d")  # initech's offer does not check budgets
    assert status == 202


# ---- refusals -------------------------------------------------------------------

@pytest.mark.parametrize(
    "who, fields, status, code, field",
    [
        ("alice", {"poolId": "nope"}, 404, "NOT_FOUND", "poolId"),
        ("alice", {"poolId": "old"}, 404, "NOT_FOUND", "poolId"),  # archived
        ("alice", {"poolId": "globex-own"}, 404, "NOT_FOUND", "poolId"),  # neither owned nor offered
        ("carol", {"poolId": "mig", "gpuModel": "A100_80GB", "migProfile": "1g.10gb"}, 404, "NOT_FOUND", "poolId"),
        ("alice", {"gpuModel": "A100_80GB"}, 400, "INVALID_INPUT", "gpuModel"),
        ("alice", {"sharing": "mig"}, 400, "INVALID_INPUT", "sharing"),
        ("alice", {"poolId": "mig", "gpuModel": "A100_80GB"}, 400, "INVALID_INPUT", "migProfile"),
        ("alice", {"poolId": "mig", "gpuModel": "A100_80GB", "migProfile": "7g.80gb"}, 400, "INVALID_INPUT", "migProfile"),
        ("alice", {"migProfile": "1g.10gb"}, 400, "INVALID_INPUT", "migProfile"),
        ("alice", {"poolId": "k8s", "binding": "node"}, 400, "INVALID_INPUT", "binding"),  # no tenantRoot
        ("alice", {"binding": "node", "resources": {"vcpu": 1}}, 400, "INVALID_INPUT", "resources"),
        # less than a node can enforce: cpu.max refuses a quota below 1 ms (it never bound), and less than a MiB
        # rounded to no limit at all
        ("alice", {"resources": {"vcpu": 0.004}}, 400, "INVALID_INPUT", "resources.vcpu"),
        ("alice", {"resources": {"vcpu": 0.0004}}, 400, "INVALID_INPUT", "resources.vcpu"),
        ("alice", {"resources": {"memoryGiB": 0.0004}}, 400, "INVALID_INPUT", "resources.memoryGiB"),
        ("alice", {"binding": "kubernetes"}, 400, "INVALID_INPUT", "binding"),  # no policy.kubernetes
        ("carol", {"poolId": "k8s", "binding": "kubernetes"}, 400, "INVALID_INPUT", "binding"),  # not the owner
        ("alice", {"binding": "vm"}, 422, "UNSUPPORTED", "binding"),
        ("alice", {"binding": ""}, 422, "UNSUPPORTED", "binding"),  # any binding other than hold, node or kubernetes
        ("alice", {"durationHours": None}, 400, "INVALID_INPUT", "durationHours"),
        ("alice", {"end": T0 + HOUR}, 400, "INVALID_INPUT", "end"),  # end and durationHours
        ("alice", {"durationHours": None, "start": T0 - 24 * HOUR, "end": T0 - HOUR}, 400, "INVALID_INPUT", "start"),
        ("alice", {"durationHours": None, "start": T0 + 2 * HOUR, "end": T0 + HOUR}, 400, "INVALID_INPUT", "end"),
        ("alice", {"gpuCount": None}, 400, "INVALID_INPUT", "gpuCount"),
        ("alice", {"leaseSeconds": 5}, 400, "INVALID_INPUT", "leaseSeconds"),
        ("alice", {"leaseSeconds": 0}, 400, "INVALID_INPUT", "leaseSeconds"),
        # a malformed quote id is QUOTE_EXPIRED, as an unknown one (seed 002: "expired or malformed")
        ("alice", {"quoteId": ""}, 410, "QUOTE_EXPIRED", "quoteId"),
        ("alice", {"quoteId": "q" * 300}, 410, "QUOTE_EXPIRED", "quoteId"),
        ("alice", {"wait": {"timeoutMs": 30001}}, 400, "INVALID_INPUT", "wait.timeoutMs"),
        # money in Python's wider grammar is not this API's
        ("alice", {"maxHourlyPrice": "1e3"}, 400, "INVALID_INPUT", "maxHourlyPrice"),
        ("alice", {"maxHourlyPrice": "1_000"}, 400, "INVALID_INPUT", "maxHourlyPrice"),
        ("alice", {"maxHourlyPrice": " 3"}, 400, "INVALID_INPUT", "maxHourlyPrice"),
        ("alice", {"maxHourlyPrice": "-0"}, 400, "INVALID_INPUT", "maxHourlyPrice"),
        ("alice", {"maxHourlyPrice": "3."}, 400, "INVALID_INPUT", "maxHourlyPrice"),
    ],
)
async def test_refusals_name_the_field_and_change_nothing(api, who, fields, status, code, field):
    body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    got_status, doc = await api.call("create", who, body)
    assert (got_status, doc["error"]["code"]) == (status, code), doc
    assert doc["error"]["details"].get("field") == field
    assert api.cp.state.calendar.by_reservation == {}
    assert await api.events(who) == []


async def test_a_value_that_is_none_of_a_fields_choices_names_them(api):
    status, doc = await api.call("list", "alice", {"scope": "everyone"})
    assert (400, "scope: invalid enum value 'everyone': give one of 'all', 'mine'") == (status, doc["error"]["message"])
    status, doc = await api.post("/api/iam/confirmations/list", "alice", {"status": "open"})
    assert (400, "status") == (status, doc["error"]["details"]["field"])
    assert doc["error"]["message"].endswith("give one of 'approved', 'denied', 'expired', 'pending'"), doc


async def test_a_lease_out_of_bounds_is_refused_with_the_bounds_that_hold(api):
    for seconds, rule in ((0, "must be an integer >= 30"), (29, "must be an integer >= 30"),
                          (604801, "must be an integer <= 604800")):
        status, doc = await api.create(key=f"l{seconds}", leaseSeconds=seconds)
        assert (400, f"leaseSeconds: {rule}") == (status, doc["error"]["message"])
    assert 202 == (await api.create(key="l30", leaseSeconds=30))[0]


async def test_node_binding_books_every_gpu_and_the_whole_host(api):
    res = (await api.create(key="n", binding="node", gpuCount=None, access=NODE_ACCESS))[1]["reservation"]
    assert res["state"] == "placed" and res["gpuCount"] == 8
    assert len(res["placements"][0]["devices"]) == 8
    assert res["resources"]["vcpu"] == 64.0
    status, doc = await api.create(key="n1", binding="node", gpuCount=4, access=NODE_ACCESS)
    assert (status, doc["error"]["details"]["field"]) == (400, "gpuCount")
    second = (await api.create(key="n2", binding="node", gpuCount=8, access=NODE_ACCESS))[1]["reservation"]
    assert second["state"] == "placed"
    assert second["placements"][0]["nodeId"] != res["placements"][0]["nodeId"]
    third = (await api.create(key="hold"))[1]["reservation"]
    assert third["state"] == "pending"


async def test_kubernetes_binding_from_the_pool_owner_is_placed(api):
    res = (await api.create(key="k", poolId="k8s", binding="kubernetes", gpuCount=2))[1]["reservation"]
    assert res["state"] == "placed" and res["binding"] == "kubernetes"
    assert res["resources"] == {"vcpu": 8.0, "memoryGiB": 64.0, "hugepages1Gi": 0}  # policy.perGpu


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer wrong-token-000000", "Basic abc"])
async def test_missing_or_unknown_token_is_401_with_the_envelope(api, header):
    headers = {"Authorization": header} if header else {}
    status, doc = await api.call("create", None, {}, headers=headers)
    assert status == 401 and doc["error"]["code"] == "UNAUTHENTICATED"


async def test_iam_sees_totals_over_a_gang(api):
    # the agent may create at most 2 GPUs in total: a 2-node gang of 1 GPU is 2, of 2 GPUs is 4
    status, _ = await api.create("robot", key="g1", gpuCount=1, nodeCount=2)
    assert status == 202
    status, doc = await api.create("robot", key="g2", gpuCount=2, nodeCount=2)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")


async def test_duration_cap_policy_uses_rounded_up_hours(api):
    status, _ = await api.create(key="d1", durationHours=168)
    assert status == 202
    status, doc = await api.create(key="d2", durationHours=168.01)
    err = doc["error"]
    assert ("ACCESS_DENIED", "max-week", "reservations longer than 168 h are not allowed") == (
        err["code"], err["details"]["policy"], err["details"]["reason"])
    assert err["message"].endswith(": reservations longer than 168 h are not allowed")


async def test_a_forbid_without_annotations_is_named_by_cedars_id(api):
    status, doc = await api.create("robot", key="big", gpuCount=4)  # the agents' forbid has no @id or @reason
    assert (403, "policy1", "") == (status, doc["error"]["details"]["policy"], doc["error"]["details"]["reason"])
    assert doc["error"]["message"] == "robot may not create this reservation: forbidden by policy policy1"
