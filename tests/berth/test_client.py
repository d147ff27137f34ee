"""The Python client against a real server on loopback: typed answers, structured errors, retries with the same key.

The async client talks to the in-process test server (real HTTP, the fake
clock); the sync client to a `berth controlplane serve` subprocess, which
the retry test kills with SIGKILL mid-request.
"""
from __future__ import annotations

import json
import threading
from decimal import Decimal

import pytest
from aiohttp import web

from berth import client as c
from controlplane.api.app import create_app
from controlplane.wiring import Config
from tests.controlplane.conftest import HOUR, T0, TOKENS, Api, bootstrap_doc
from tests.serverproc import ServerProcess
from tests.waiting import wait_for

H100 = {"gpu_count": 1, "duration_hours": 1}


class Faults:
    """A server-side fault for the next N creates: the handler raises, so the real error path answers 503."""

    def __init__(self) -> None:
        self.fail_creates = 0
        self.seen_keys: list[str | None] = []

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path.endswith("/reservations/create"):
            self.seen_keys.append(request.headers.get("Idempotency-Key"))
            if self.fail_creates > 0:
                self.fail_creates -= 1
                raise RuntimeError("injected fault")
        return await handler(request)


@pytest.fixture
async def served(aiohttp_client, tmp_path, bootstrap_file, clock):
    """The test server (reconciler off, fake clock) with a fault injector, and a URL for the clients."""
    faults = Faults()
    config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(), clock=clock,
                    synchronous="NORMAL", reconcile=False)
    app = create_app(config)
    app.middlewares.append(faults.middleware)  # innermost: its exceptions meet the real error middleware
    test_client = await aiohttp_client(app)
    return Api(test_client, clock), faults, str(test_client.make_url("/")).rstrip("/")


@pytest.fixture
async def alice(served):
    _, _, url = served
    async with c.AsyncClient(url, TOKENS["alice"], backoff=0.01, max_backoff=0.02) as client:
        yield client


async def activate(api: Api, reservation_id: str) -> None:
    """Speak for the nodes' agents over the node API: register, report the devices bound; billing starts."""
    from tests.controlplane.test_nodes import node_call, register

    await api.settle()
    res = api.cp.store.reservation(reservation_id)
    for placement in res.placements:
        node = await register(api, api.cp.catalog.current.nodes[placement.node_id].hostname)
        status, doc = await node_call(api, "report", node["nodeToken"],
                                      {"reports": [{"reservationId": reservation_id, "status": "bound"}]})
        assert doc["accepted"] == [reservation_id], doc
    assert api.cp.store.reservation(reservation_id).state == "active"


# ---- async: every method, typed ----------------------------------------------------------

async def test_create_get_list_release_cancel_round_trip_as_typed_results(alice):
    created = await alice.create("h100", "H100_80GB", **H100, idempotency_key="round-trip")
    assert isinstance(created, c.Reservation) and isinstance(created.operation, c.Operation)
    assert ("placed", "alice", "h100", 1, "create", "running") == (
        created.state, created.principal_id, created.pool_id, created.gpu_count, created.operation.kind,
        created.operation.status)
    again = await alice.create("h100", "H100_80GB", **H100, idempotency_key="round-trip")
    assert created.id == again.id
    assert created == await alice.get(created.id)
    page = await alice.list()
    assert ([created.id], None) == ([r.id for r in page.reservations], page.next_cursor)
    future = await alice.create("h100", "H100_80GB", gpu_count=1, start=T0 + HOUR, end=T0 + 2 * HOUR)
    cancelled = await alice.cancel(future.id)
    assert ("cancelled", "cancel") == (cancelled.state, cancelled.reason)
    released = await alice.release(created.id)
    assert ("released", "release") == (released.state, released.reason)
    assert [future.id] == [r.id for r in (await alice.list(state="cancelled")).reservations]


async def test_extend_renew_and_events(alice):
    res = await alice.create("h100", "H100_80GB", **H100, lease_seconds=60)
    extended = await alice.extend(res.id, until=T0 + 2 * HOUR)
    assert (True, T0 + 2 * HOUR) == (extended.extended, extended.reservation.end)
    again = await alice.extend(res.id, until=T0 + 2 * HOUR)  # already reached: safe to retry
    assert (False, T0 + 2 * HOUR) == (again.extended, again.reservation.end)
    by = await alice.extend(res.id, by_ms=HOUR)
    assert (True, T0 + 3 * HOUR) == (by.extended, by.reservation.end)
    renewed = await alice.renew(res.id)
    assert T0 + 60_000 == renewed.lease_deadline
    page = await alice.list_events()
    assert ["reservation.placed", "reservation.extended", "reservation.extended"] == [e.type for e in page.events]
    assert page.next_cursor == page.events[-1].seq
    assert [] == (await alice.list_events(after=page.next_cursor)).events
    # a cursor past every event numbered (a restored database's clients): InvalidInput saying where they end
    with pytest.raises(c.InvalidInput) as refused:
        await alice.list_events(after=page.next_cursor + 100, wait_ms=5_000)
    assert "after" == refused.value.field
    assert page.next_cursor <= refused.value.details["newest"] < page.next_cursor + 100


async def test_quote_is_typed_with_decimal_money_and_a_create_holds_to_it(alice):
    quote = await alice.quote("h100", "H100_80GB", gpu_count=2, duration_hours=3)
    assert (Decimal("5.000000"), Decimal("15.000000"), True) == (
        quote.total_running_usd_per_hour, quote.total_usd, quote.fits_now)
    assert all(isinstance(a.total_running_usd_per_hour, Decimal) for a in quote.alternatives)
    res = await alice.create("h100", "H100_80GB", gpu_count=2, duration_hours=3, quote_id=quote.id,
                             max_hourly_price=Decimal("5"))
    assert "placed" == res.state
    with pytest.raises(TypeError):
        await alice.create("h100", "H100_80GB", **H100, max_hourly_price=5.0)  # money is never float
    for typo in ("1e3", "1_000", "+3", " 3"):  # a string is sent as written: the wire's grammar or nothing
        with pytest.raises(ValueError, match="plain decimal digits"):
            await alice.create("h100", "H100_80GB", **H100, max_hourly_price=typo)
    assert "1000" == c.price_text(Decimal("1E+3"))  # a Decimal is a number: written out in plain digits


async def test_operations_get_and_wait_until_the_create_succeeds(served, alice):
    api, _, _ = served
    res = await alice.create("h100", "H100_80GB", **H100)
    waited = await alice.wait_operation(res.operation.id, timeout_ms=10)
    assert (False, "running") == (waited.done, waited.operation.status)
    await activate(api, res.id)
    done = await alice.wait_until_done(res.operation.id, timeout_s=5)
    assert (True, "succeeded") == (done.done, done.operation.status)
    assert done.operation == await alice.get_operation(res.operation.id)


async def test_usage_lines_and_totals_are_exact_decimals(served, alice):
    api, _, _ = served
    res = await alice.create("h100", "H100_80GB", gpu_count=2, duration_hours=3)
    await activate(api, res.id)
    api.clock.advance(HOUR // 2)
    await alice.release(res.id)
    usage = await alice.list_usage()
    assert [(res.id, Decimal("5.000000"), Decimal("2.500000"), 1800, False)] == [
        (line.reservation_id, line.hourly_usd, line.amount_usd, line.seconds, line.running) for line in usage.lines]
    assert (Decimal("2.500000"), Decimal("2.500000")) == (usage.total_usd, usage.page_total_usd)
    assert [(res.id, Decimal("2.500000"))] == [(t.reservation_id, t.total_usd) for t in usage.by_reservation]
    assert [] == (await alice.list_usage(reservation_id=res.id, since=T0 + 86_400_000)).lines


async def test_confirmations_list_get_approve_and_deny(served, alice):
    _, _, url = served
    async with c.AsyncClient(url, TOKENS["agent"]) as agent:
        with pytest.raises(c.ConfirmationRequired) as asked:
            await agent.create("h100", "H100_80GB", gpu_count=4, duration_hours=1, idempotency_key="big")
        with pytest.raises(c.ConfirmationRequired) as other:
            await agent.create("h100", "H100_80GB", gpu_count=3, duration_hours=1, idempotency_key="other")
        cid = asked.value.confirmation_id
        assert {cid, other.value.confirmation_id} == {x.id for x in await alice.list_confirmations(status="pending")}
        assert ("pending", "alice") == ((await agent.get_confirmation(cid)).status, (await agent.get_confirmation(cid)).approver)
        with pytest.raises(c.AccessDenied):
            await agent.approve_confirmation(cid)  # the agent never decides
        assert "approved" == (await alice.approve_confirmation(cid)).status
        assert "denied" == (await alice.deny_confirmation(other.value.confirmation_id)).status
        res = await agent.create("h100", "H100_80GB", gpu_count=4, duration_hours=1, idempotency_key="big")
        assert asked.value.reservation_id is None  # a synchronous refusal names no resource
        assert "placed" == res.state


# ---- structured errors -----------------------------------------------------------------------

async def test_no_capacity_price_ceiling_keeps_reason_alternatives_and_cheapest_rate(alice):
    with pytest.raises(c.NoCapacity) as refused:
        await alice.create("h100", "H100_80GB", **H100, max_hourly_price="1.000000")
    err = refused.value
    assert ("NO_CAPACITY", 409, "price_ceiling") == (err.code, err.status, err.reason)
    assert Decimal("2.500000") == err.cheapest_eligible_usd_per_hour  # this request, in its pool
    assert ["budget", "k8s"] == [a.pool_id for a in err.alternatives]
    assert "2.500000" == err.details["totalRunningUsdPerHour"]  # every detail as sent
    assert err.idempotency_key is not None  # the key it was sent with, to retry the same intent


async def test_no_capacity_larger_than_the_pool_is_no_stock_naming_the_pool_that_could(alice):
    with pytest.raises(c.NoCapacity) as refused:
        await alice.create("k8s", "H100_80GB", gpu_count=8, node_count=2, duration_hours=1)
    assert ("no_stock", ["h100"], None) == (
        refused.value.reason, [a.pool_id for a in refused.value.alternatives], refused.value.cheapest_eligible_usd_per_hour)
    assert Decimal("40.000000") == refused.value.alternatives[0].total_running_usd_per_hour


async def test_conflict_names_the_reservation_of_the_key(alice):
    first = await alice.create("h100", "H100_80GB", **H100, idempotency_key="k")
    with pytest.raises(c.Conflict) as refused:
        await alice.create("h100", "H100_80GB", gpu_count=2, duration_hours=1, idempotency_key="k")
    assert (first.id, "idempotency-key-reused", 409) == (refused.value.reservation_id, refused.value.reason,
                                                          refused.value.status)


@pytest.mark.parametrize("fields, error, expected", [
    ({"vcpu": 64}, c.QuotaExceeded, {"resource": "vcpu", "limit": 32.0, "used": 0.0, "requested": 56.0}),
    ({"gpu_count": 0}, c.InvalidInput, {"field": "gpuCount"}),
    ({"binding": "vm"}, c.Unsupported, {}),
])
async def test_refusals_raise_the_code_s_class_with_its_details(alice, fields, error, expected):
    with pytest.raises(error) as refused:
        await alice.create("h100", "H100_80GB", **{**H100, **fields})
    assert expected == {k: refused.value.details[k] for k in expected}


async def test_an_empty_idempotency_key_is_sent_and_refused_never_replaced(alice):
    with pytest.raises(c.InvalidInput) as refused:
        await alice.create("h100", "H100_80GB", **H100, idempotency_key="")
    assert "Idempotency-Key" == refused.value.details["field"]  # the client sends the key as that header
    assert [] == (await alice.list()).reservations


def test_a_client_for_a_url_that_is_not_http_is_refused_when_made():
    for url in ("localhost:8080", "ftp://bmc", "http://"):
        with pytest.raises(c.ConfigError, match="is not an http:// or https:// URL"):
            c.AsyncClient(url, "token")


async def test_quota_exceeded_has_convenience_properties(alice):
    with pytest.raises(c.QuotaExceeded) as refused:
        await alice.create("h100", "H100_80GB", **H100, vcpu=64)
    err = refused.value
    assert ("vcpu", 32.0, 0.0, 56.0, 429) == (err.resource, err.limit, err.used, err.requested, err.status)


async def test_unknown_token_is_unauthenticated(served):
    _, _, url = served
    async with c.AsyncClient(url, "not-a-token-at-all") as nobody:
        with pytest.raises(c.Unauthenticated) as refused:
            await nobody.list()
    assert (401, "Authorization") == (refused.value.status, refused.value.field)


# ---- retries ------------------------------------------------------------------------------------

async def test_provider_unavailable_is_retried_with_the_same_key(served, alice):
    _, faults, _ = served
    faults.fail_creates = 2
    res = await alice.create("h100", "H100_80GB", **H100)
    assert 3 == len(faults.seen_keys) and len(set(faults.seen_keys)) == 1
    assert [res.id] == [r.id for r in (await alice.list()).reservations]


async def test_provider_unavailable_retries_are_bounded_and_keep_the_reference(served):
    _, faults, url = served
    faults.fail_creates = 100
    async with c.AsyncClient(url, TOKENS["alice"], retries=2, backoff=0.01) as alice:
        with pytest.raises(c.ProviderUnavailable) as refused:
            await alice.create("h100", "H100_80GB", **H100, idempotency_key="given")
    err = refused.value
    assert (503, "platform", True, "given") == (err.status, err.actor, err.reference.startswith("ref-"), err.idempotency_key)
    assert ["given"] * 3 == faults.seen_keys


async def test_no_server_is_a_transport_error_after_bounded_attempts(unused_tcp_port):
    async with c.AsyncClient(f"http://127.0.0.1:{unused_tcp_port}", "t", retries=2, backoff=0.01) as nobody:
        with pytest.raises(c.TransportError) as failed:
            await nobody.create("h100", "H100_80GB", **H100)
    assert (3, None, False) == (failed.value.details["attempts"], failed.value.status, failed.value.details["sent"])
    assert failed.value.idempotency_key.startswith("py-")


# ---- decoding ---------------------------------------------------------------------------------------

def test_answers_tolerate_unknown_fields_and_keep_money_decimal():
    line = c.decode({"reservationId": "r", "poolId": "p", "day": "2027-01-01", "from": 1, "to": 2, "seconds": 1,
                     "hourlyUsd": "3.420000", "amountUsd": "0.000950", "running": False, "currencyNew": "EUR"},
                    c.UsageLine)
    assert (Decimal("3.420000"), Decimal("0.000950"), 1, 2) == (line.hourly_usd, line.amount_usd, line.start, line.end)
    with pytest.raises(c.BadAnswer):
        c.decode({"poolId": "p"}, c.UsageLine)


def test_an_error_keeps_every_detail_and_reads_well():
    err = c.error_of(409, {"error": {"code": "CONFLICT", "message": "busy", "details": {
        "reason": "extend-in-flight", "retryAfterSeconds": 1, "reservationId": "rsv_1", "extra": [1]}}}, b"")
    assert (c.Conflict, 1.0, "rsv_1", [1], "CONFLICT: busy") == (
        type(err), err.retry_after_seconds, err.reservation_id, err.details["extra"], str(err))
    proxy = c.error_of(502, None, b"<html>bad gateway</html>")
    assert (c.BadAnswer, 502) == (type(proxy), proxy.status)


# ---- the sync client against a server process -------------------------------------------------------

@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("sync")
    (d / "b.json").write_text(json.dumps(bootstrap_doc()))
    server = ServerProcess(d / "cp.db", d / "b.json").start()
    yield server
    server.stop()


def test_sync_client_has_every_method(server_process):
    with c.Client(server_process.url, TOKENS["alice"]) as alice, c.Client(server_process.url, TOKENS["agent"]) as agent:
        quote = alice.quote("h100", "H100_80GB", gpu_count=1, duration_hours=1)
        res = alice.create("h100", "H100_80GB", **H100, lease_seconds=600, quote_id=quote.id)
        assert res.id == alice.get(res.id).id == alice.list().reservations[0].id  # its state moves on (binding)
        assert res.lease_deadline <= alice.renew(res.id).lease_deadline
        assert alice.extend(res.id, by_ms=60_000).extended
        assert res.operation == alice.get_operation(res.operation.id)
        assert not alice.wait_operation(res.operation.id, 10).done
        assert not alice.wait_until_done(res.operation.id, 0.2, step_ms=50).done
        assert isinstance(alice.list_usage().total_usd, Decimal)
        assert "reservation.placed" in [e.type for e in alice.list_events().events]
        with pytest.raises(c.ConfirmationRequired) as asked:
            agent.create("h100", "H100_80GB", gpu_count=4, duration_hours=1, idempotency_key="sync-big")
        cid = asked.value.confirmation_id
        assert [cid] == [x.id for x in alice.list_confirmations()]
        assert "pending" == agent.get_confirmation(cid).status
        assert "denied" == alice.deny_confirmation(cid).status
        with pytest.raises(c.InvalidState):
            alice.approve_confirmation(cid)
        released = alice.release(res.id)
        assert ("released", "cancelled") == (released.state, alice.get_operation(res.operation.id).status)
        with pytest.raises(c.NotFound):
            alice.cancel("rsv_missing")


def test_sync_client_raises_the_same_structured_errors(server_process):
    with c.Client(server_process.url, TOKENS["alice"]) as alice:
        with pytest.raises(c.NoCapacity) as refused:
            alice.create("h100", "H100_80GB", **H100, max_hourly_price="1")
    assert ("price_ceiling", Decimal("2.500000")) == (refused.value.reason, refused.value.cheapest_eligible_usd_per_hour)


def test_a_closed_sync_client_says_so_without_a_never_awaited_warning(server_process):
    import gc
    import warnings

    client = c.Client(server_process.url, TOKENS["alice"])
    client.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="this Client is closed: make a new one"):
            client.whoami()
        gc.collect()  # an unawaited coroutine warns when it is collected
    assert [] == [str(w.message) for w in seen if "never awaited" in str(w.message)]


def test_a_create_retried_after_kill_9_mid_request_returns_the_same_reservation(tmp_path):
    """The server stores the create and dies before answering; the retry with the same key gets that reservation."""
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    server = ServerProcess(tmp_path / "cp.db", tmp_path / "b.json").start()
    port = int(server.url.rsplit(":", 1)[1])
    blockers = []
    for key in ("fill-1", "fill-2"):  # pool h100's 16 GPUs, so alice's create waits, pending, holding its answer
        status, doc = server.post("/api/compute/reservations/create", TOKENS["bob"], {
            "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 8, "durationHours": 1, "idempotencyKey": key})
        assert status == 202, doc
        blockers.append(doc["reservation"]["id"])
    outcome: dict = {}
    retried: list[bool] = []  # per retry: whether the failed attempt had been sent

    def create() -> None:
        with c.Client(server.url, TOKENS["alice"], retries=30, backoff=0.1, max_backoff=0.3,
                      on_retry=lambda attempt, err, delay: retried.append(err.details["sent"])) as alice:
            try:
                outcome["reservation"] = alice.create("h100", "H100_80GB", **H100, wait_ms=20_000)
            except c.BerthError as err:
                outcome["error"] = err

    thread = threading.Thread(target=create)
    thread.start()

    def pending() -> list[str]:
        return [r["id"] for r in server.post("/api/compute/reservations/list", TOKENS["alice"], {})[1]["reservations"]]

    wait_for(lambda: len(pending()) == 1, timeout=10)
    stored = pending()[0]
    server.kill()  # SIGKILL while the create's answer is held
    server = ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", extra=["--listen", f"127.0.0.1:{port}"]).start()
    try:
        for rid in blockers:
            assert server.post("/api/compute/reservations/release", TOKENS["bob"], {"reservationId": rid})[0] == 202
        thread.join(30)
        assert not thread.is_alive()
        assert "error" not in outcome, outcome
        assert stored == outcome["reservation"].id
        assert outcome["reservation"].state in ("placed", "binding")  # its window starts as soon as it is placed
        assert [stored] == pending()  # no duplicate
        assert retried[0] is True  # the first attempt reached the server and lost its answer: retried anyway
    finally:
        server.stop()


def test_the_python_client_page_lists_every_result_type_and_field():
    import re
    from pathlib import Path

    import msgspec

    from berth.client import answers

    doc = (Path(__file__).resolve().parents[2] / "docs" / "python-client.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$", doc, re.M)}
    for name, cls in vars(answers).items():
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__module__ == answers.__name__:
            assert name in rows, f"docs/python-client.md lacks {name}"
            listed = re.findall(r"`(\w+)`", rows[name])
            assert [f.name for f in msgspec.structs.fields(cls)] == listed, name
