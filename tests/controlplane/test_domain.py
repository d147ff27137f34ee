"""The domain core as plain code: calendar, placement, quota, state machine and admission, and the writer's memory."""
from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane import catalog as catalog_mod
from controlplane.domain import states
from controlplane.domain.admission import CreateRequest, ResourcesAsk, admit, pool_share, profile_of
from controlplane.domain.calendar import Booking, Calendar, DeviceTimeline
from controlplane.domain.errors import DomainError
from controlplane.domain.model import Node, Pool, PoolPolicy, Reservation, Tenant, Unit
from controlplane.domain.placement import Ask, place
from controlplane.domain.quota import QuotaLedger, charge_for
from controlplane.state import WriterState
from common.share import NO_SHARE, Share, host_share_per_gpu, pool_share_per_gpu

H = 3_600_000


def node(node_id: str, gpus: int = 8, vcpu: int = 64, mem_gib: int = 512, numa_split: int = 4) -> Node:
    units = tuple(Unit(f"gpu{i}", i, 0 if i < numa_split else 1) for i in range(gpus))
    return Node(node_id, "p", f"{node_id}.test", units, gpus, Share(vcpu * 1000, mem_gib * 1024, 8))


def calendar_with(*nodes: Node) -> tuple[Calendar, dict[str, Node]]:
    cal = Calendar()
    for n in nodes:
        cal.add_node("p", n.id, [u.id for u in n.units])
    return cal, {n.id: n for n in nodes}


# ---- calendar ----------------------------------------------------------------

@pytest.mark.parametrize(
    "start, end, free",
    [(0, 10, True), (0, 11, False), (10, 20, False), (25, 30, True), (19, 21, False), (20, 25, True), (35, 45, False)],
)
def test_device_timeline_is_free_exactly_outside_its_bookings(start, end, free):
    tl = DeviceTimeline()
    tl.add(10, 20, "a")
    tl.add(30, 40, "b")
    assert free == tl.is_free(start, end)


def test_device_timeline_refuses_an_overlap():
    tl = DeviceTimeline()
    tl.add(10, 20, "a")
    with pytest.raises(ValueError):
        tl.add(15, 25, "b")


def test_release_cuts_running_bookings_and_drops_future_ones():
    cal, _ = calendar_with(node("n1"))
    cal.book(Booking("r1", "p", "n1", ("gpu0",), 0, 100, NO_SHARE))
    cal.book(Booking("r2", "p", "n1", ("gpu1",), 200, 300, NO_SHARE))
    kept = cal.release("r1", 50)
    assert [(b.start, b.end) for b in kept] == [(0, 50)]
    assert cal.release("r2", 50) == []
    assert cal.pools["p"].nodes["n1"].devices["gpu1"].is_free(200, 300)
    assert "n1" in cal.pools["p"].idle


def test_host_peak_sums_only_overlapping_bookings():
    cal, _ = calendar_with(node("n1"))
    cal.book(Booking("a", "p", "n1", ("gpu0",), 0, 10, Share(1000, 10, 0)))
    cal.book(Booking("b", "p", "n1", ("gpu1",), 5, 15, Share(2000, 20, 1)))
    cal.book(Booking("c", "p", "n1", ("gpu2",), 10, 20, Share(4000, 40, 0)))
    ncal = cal.pools["p"].nodes["n1"]
    assert Share(3000, 30, 1) == ncal.host_peak(0, 10)
    assert Share(6000, 60, 1) == ncal.host_peak(10, 15)
    assert Share(4000, 40, 0) == ncal.host_peak(15, 30)


def test_latest_end_is_bounded_by_the_next_booking_of_any_device():
    cal, _ = calendar_with(node("n1"))
    cal.book(Booking("mine", "p", "n1", ("gpu0", "gpu1"), 0, 10, NO_SHARE))
    cal.book(Booking("next", "p", "n1", ("gpu1",), 25, 30, NO_SHARE))
    assert 25 == cal.latest_end("mine", 100)
    assert 20 == cal.latest_end("mine", 20)


# ---- placement -----------------------------------------------------------------

def test_placement_prefers_the_node_in_use_and_one_numa_node():
    cal, nodes = calendar_with(node("n1"), node("n2"))
    cal.book(Booking("x", "p", "n2", ("gpu0",), 0, H, NO_SHARE))
    got = place(cal.pools["p"], nodes, Ask(gpu_count=3, node_count=1, share=NO_SHARE, start=0, end=H))
    assert got[0].node_id == "n2"
    assert got[0].units == ["gpu1", "gpu2", "gpu3"]  # the NUMA node with 3 free: tightest fit


def test_placement_spreads_over_numa_nodes_only_when_one_cannot_hold_it():
    cal, nodes = calendar_with(node("n1"))
    got = place(cal.pools["p"], nodes, Ask(gpu_count=6, node_count=1, share=NO_SHARE, start=0, end=H))
    assert sorted(got[0].units) == sorted([f"gpu{i}" for i in range(6)])


def test_placement_checks_host_resources_over_the_window():
    cal, nodes = calendar_with(node("n1", vcpu=16))
    cal.book(Booking("x", "p", "n1", ("gpu0",), 0, H, Share(12000, 0, 0)))
    ask = Ask(gpu_count=1, node_count=1, share=Share(8000, 0, 0), start=0, end=H)
    assert place(cal.pools["p"], nodes, ask) is None
    later = Ask(gpu_count=1, node_count=1, share=Share(8000, 0, 0), start=H, end=2 * H)
    assert place(cal.pools["p"], nodes, later) is not None


def test_placement_skips_unschedulable_nodes():
    lost = Node("n1", "p", "h", node("n1").units, 8, Share(64000, 512 * 1024, 0), schedulable=False)
    cal, nodes = calendar_with(lost)
    assert place(cal.pools["p"], nodes, Ask(gpu_count=1, node_count=1, share=NO_SHARE, start=0, end=H)) is None


def test_gang_placement_is_all_or_nothing_on_distinct_nodes():
    cal, nodes = calendar_with(node("n1"), node("n2"), node("n3"))
    cal.book(Booking("x", "p", "n1", tuple(f"gpu{i}" for i in range(6)), 0, H, NO_SHARE))
    got = place(cal.pools["p"], nodes, Ask(gpu_count=4, node_count=2, share=NO_SHARE, start=0, end=H))
    assert sorted(p.node_id for p in got) == ["n2", "n3"]
    assert place(cal.pools["p"], nodes, Ask(gpu_count=4, node_count=3, share=NO_SHARE, start=0, end=H)) is None


# ---- share and quota -----------------------------------------------------------------

def test_per_gpu_share_is_the_smallest_any_host_gives_unless_policy_sets_it():
    hosts = [host_share_per_gpu(64000, 512 * 1024, 8), host_share_per_gpu(96000, 256 * 1024, 8), host_share_per_gpu(0, 0, 8)]
    assert Share(8000, 32 * 1024) == pool_share_per_gpu(hosts)
    assert Share(1, 2) == pool_share_per_gpu(hosts, Share(1, 2))
    assert NO_SHARE == pool_share_per_gpu([None])


def test_quota_ledger_checks_holds_and_refunds():
    tenant = Tenant("t", {"gpu:H100_80GB": 4, "vcpu_milli": 2000})
    pool = Pool("p", "t", "eu", "H100_80GB")
    ledger = QuotaLedger()
    charge = charge_for(pool, None, "gpu:H100_80GB", 3, Share(1000, 0, 0), 1)
    ledger.check(tenant, {"p": pool}, charge)
    ledger.hold("t", charge)
    with pytest.raises(DomainError) as err:
        ledger.check(tenant, {"p": pool}, charge)
    assert err.value.code == "QUOTA_EXCEEDED" and err.value.details["resource"] == "gpu:H100_80GB"
    ledger.refund("t", charge)
    assert dict(ledger.usage("t")) == {}


# ---- state machine ------------------------------------------------------------------

def _res(state: str) -> Reservation:
    return Reservation("r", "t", "p", "k", "f", "pool", "eu", state, "hold", "H100_80GB", "exclusive", 1, 1, 0, 0)


@pytest.mark.parametrize("terminal", sorted(states.TERMINAL))
@pytest.mark.parametrize("target", states.PUBLIC_STATES)
def test_terminal_states_are_never_left(terminal, target):
    with pytest.raises(states.IllegalTransition):
        states.move(_res(terminal), target, 1)


def test_a_move_records_the_reason_of_a_terminal_state():
    res = _res(states.PLACED)
    assert states.PLACED == states.move(res, states.RELEASED, 5, "release")
    assert (res.state, res.reason, res.updated_at) == (states.RELEASED, "release", 5)


# ---- admission -------------------------------------------------------------------------

def test_admission_raises_the_asked_resources_to_the_share():
    pool = Pool("p", "t", "eu", "H100_80GB")
    nodes = [node("n1")]
    assert Share(8000, 64 * 1024) == pool_share(pool, nodes)
    req = CreateRequest("p", "H100_80GB", gpu_count=2, duration_ms=H, resources=ResourcesAsk(20000, None, 2))
    plan = admit(req, Tenant("t"), pool, profile_of(pool, nodes), now=0)
    assert Share(20000, 128 * 1024, 2) == plan.resources
    assert {"gpu:H100_80GB": 2, "vcpu_milli": 4000, "memory_mib": 2048} == plan.charge


def test_admission_of_mig_requests_books_no_share():
    pool = Pool("p", "t", "us", "A100_80GB", sharing="mig", policy=PoolPolicy())
    mig = Node("m", "p", "m", tuple(Unit(f"gpu0/mig{i}", 0, 0, "1g.10gb") for i in range(7)), 1, Share(32000, 1024, 0))
    plan = admit(CreateRequest("p", "A100_80GB", gpu_count=2, mig_profile="1g.10gb", duration_ms=H), Tenant("t"), pool, profile_of(pool, [mig]), 0)
    assert NO_SHARE == plan.resources and {"gpu:A100_80GB:1g.10gb": 2} == plan.charge


# ---- the writer's memory ------------------------------------------------------------

def test_forgetting_a_reservation_takes_it_out_of_the_calendar_the_ledger_and_the_queues_only():
    """What a create whose speculative commit did not land leaves behind is undone (WriterState.forget); the other
    reservations stay as they were, and forgetting one the memory never held changes nothing."""
    def held(state: WriterState) -> tuple:
        return ({k: [(b.node_id, b.units, b.start, b.end) for b in v] for k, v in state.calendar.by_reservation.items()},
                {t: dict(+used) for t, used in state.ledger.used.items()},
                {t: sorted(rs) for t, rs in state.charged.items() if rs},
                {p: list(q) for p, q in state.pending.items() if q}, {p: list(q) for p, q in state.spot.items() if q})

    state = WriterState()
    state.calendar.add_node("pool", "n1", [f"gpu{i}" for i in range(8)])
    kept = replace(_res(states.PLACED), id="kept", charge={"gpu:H100_80GB": 1})
    state.calendar.book(Booking("kept", "pool", "n1", ("gpu0",), 0, H, NO_SHARE))
    state.track(kept)
    state.ledger.hold(kept.tenant_id, kept.charge)
    before = held(state)

    placed = replace(_res(states.PLACED), id="placed", spot=True, charge={"gpu:H100_80GB": 2})
    state.calendar.book(Booking("placed", "pool", "n1", ("gpu1", "gpu2"), 0, H, NO_SHARE))
    state.track(placed)
    state.ledger.hold(placed.tenant_id, placed.charge)
    queued = replace(_res(states.PENDING), id="queued", charge={"gpu:H100_80GB": 4})
    state.track(queued)
    state.ledger.hold(queued.tenant_id, queued.charge)
    assert held(state) != before

    for reservation_id in ("placed", "queued", "never-held"):
        state.forget(reservation_id)
    assert held(state) == before
    assert state.calendar.pool("pool").nodes["n1"].devices["gpu1"].is_free(0, H)


@pytest.mark.parametrize("order", ["placed first", "cancelled first"])
def test_another_replicas_changes_move_every_old_booking_out_before_a_new_one_comes(order):
    """Another replica cancelled `gone` and placed `waited` (pending until then) on the device it freed: whichever
    of the two the changes list first (they come in seq order, and the pending one may be the older), the memory
    ends as the database holds them (WriterState.apply), not refusing the new booking as overlapping the old."""
    state = WriterState()
    state.calendar.add_node("pool", "n1", [f"gpu{i}" for i in range(8)])
    gone = replace(_res(states.PLACED), id="gone", charge={"gpu:H100_80GB": 1})
    state.calendar.book(Booking("gone", "pool", "n1", ("gpu0",), 0, H, NO_SHARE))
    waited = replace(_res(states.PENDING), id="waited", charge={"gpu:H100_80GB": 1})
    for res in (gone, waited):
        state.track(res)
        state.ledger.hold(res.tenant_id, res.charge)

    changed = [replace(waited, state=states.PLACED), replace(gone, state=states.CANCELLED)]
    state.apply(changed if order == "placed first" else changed[::-1],
                [Booking("waited", "pool", "n1", ("gpu0",), 0, H, NO_SHARE)], now=0)
    assert {k: [b.units for b in v] for k, v in state.calendar.by_reservation.items() if v} == {"waited": [("gpu0",)]}
    assert dict(+state.ledger.used["t"]) == {"gpu:H100_80GB": 1}
    assert sorted(state.charged["t"]) == ["waited"] and not state.pending.get("pool")


def test_catalog_rows_another_replica_wrote_replace_their_items_and_nothing_else():
    """catalog.with_rows: what a replica takes of another's catalog change (rows written, not the whole catalog)
    equals the catalog loaded whole from the rows after it; a kind this release does not know is left out, as
    load leaves it."""
    h1, h2 = node("h1"), node("h2")
    rows = {("tenant", "acme"): Tenant("acme", {"gpu:H100": 8}), ("pool", "p"): Pool("p", "acme", "eu", "H100"),
            ("node", "h1"): h1, ("node", "h2"): h2}
    stored = {key: catalog_mod.encode_item(item) for key, item in rows.items()}

    def loaded(docs: dict, policies: str) -> catalog_mod.Catalog:
        by_kind: dict[str, list[bytes]] = {}
        for (kind, _), doc in sorted(docs.items()):
            by_kind.setdefault(kind, []).append(doc)
        return catalog_mod.load(by_kind, policies)

    before = loaded(stored, "permit(principal, action, resource);")
    written = [("node", "h2", catalog_mod.encode_item(replace(h2, state="cordoned"))),
               ("node", "h3", catalog_mod.encode_item(node("h3"))),
               ("tenant", "acme", catalog_mod.encode_item(Tenant("acme", {"gpu:H100": 16}))),
               ("policies", "default", b"forbid(principal, action, resource);"),
               ("from-a-newer-release", "x", b"{}")]
    after = catalog_mod.with_rows(before, written)
    stored.update({(kind, ident): doc for kind, ident, doc in written if kind in catalog_mod.KINDS})
    assert after == loaded(stored, "forbid(principal, action, resource);")
    assert after.nodes["h2"].state == "cordoned" and after.nodes["h1"] is before.nodes["h1"]
    assert before.nodes["h2"].state != "cordoned" and "h3" not in before.nodes  # the snapshot before is untouched
    assert catalog_mod.with_rows(before, []) is before


# ---- what a reservation bills, and may still bill -------------------------------------------------------------

def test_a_reservations_lines_and_what_it_may_still_bill_come_to_its_whole_time_rounded_once():
    """However UTC midnights cut its billed time and whenever the budget check looks, billed so far plus what it may
    still bill is the whole window's ticks at its price rounded once, what a budget check and a quote count."""
    from decimal import Decimal
    from controlplane.billing import Billing
    from controlplane.domain.pricing import DAY_MS, charge, day_spans, line_amount
    hourly = Decimal("1.333333")
    midnight = 1_800_000_000_000 // DAY_MS * DAY_MS + DAY_MS
    for start, end in ((midnight - 2_000, midnight + 2_000), (midnight - 1_500, midnight + 2 * DAY_MS + 700),
                       (midnight + 250, midnight + 9_999)):
        whole = charge(hourly, start, end)[1]
        assert sum(line_amount(hourly, start, a, b) for _, a, b in day_spans(start, end)) == whole
        res = replace(_res(states.ACTIVE), start=start, end=end, hourly_usd=hourly, billing_start=start)
        for now in range(start, end + 1, max(1, (end - start) // 37)):
            billed = sum(line_amount(hourly, start, a, b) for _, a, b in day_spans(start, now))
            assert billed + Billing.may_still_bill(res, now) == whole, (start, end, now)
    # an extension adds what the longer window rounds to less what the shorter did (not the added time rounded)
    res = replace(_res(states.ACTIVE), start=midnight, end=midnight + 2_000, hourly_usd=hourly,
                  billing_start=midnight)
    added = Billing.may_still_bill(res, midnight, midnight + 4_000) - Billing.may_still_bill(res, midnight)
    assert (added, charge(hourly, 0, 2_000)[1]) == (Decimal("0.000740"), Decimal("0.000741"))


# ---- timers ---------------------------------------------------------------------------------------------------

def test_timers_keep_what_reservations_need_not_every_save_they_had():
    """Every save pushed every timer again and nothing took the old ones out before they fell due: a reservation
    renewed 20,000 times grew the heap by three entries a renew (13 MB), and released ones kept theirs until their
    windows' ends, 30 days on (QA soak). The heap now holds about what is wanted, and what is due still pops."""
    from controlplane.domain.timers import END, LEASE, Timers
    timers = Timers()
    res = replace(_res(states.ACTIVE), start=0, end=720 * H, lease_deadline=H)
    for renew in range(20_000):
        res.lease_deadline = H + renew * 1000
        timers.schedule(res)
    assert len(timers) < 1_000
    others = []
    for i in range(5_000):
        other = replace(_res(states.PLACED), id=f"p{i}", start=10 * H, end=30 * 24 * H)
        timers.schedule(other)
        others.append(other)
    for other in others[:4_000]:
        other.state = states.RELEASED
        timers.schedule(other)
    timers.add(5 * H, "cleaning", "node-1")  # a node's timer and one set aside survive a rebuild of the heap
    timers.add(5 * H, END, "p4999")
    assert len(timers) < 4_000
    due = timers.pop_due(10 * H, 10_000)
    assert (H + 19_999_000, LEASE, "r") in due and (5 * H, "cleaning", "node-1") in due
    assert [d for d in due if d[2] == "p4999"] == [(5 * H, END, "p4999"), (10 * H, "start", "p4999")]
    assert sorted(ident for _, kind, ident in due if kind == "start") == sorted(f"p{i}" for i in range(4_000, 5_000))
    assert len(due) == 1 + 2 + 1_000  # the lease, the node's and the set-aside timer, the placed ones' starts
    later = timers.pop_due(30 * 24 * H, 10_000)
    assert sorted(later) == sorted([(30 * 24 * H, END, f"p{i}") for i in range(4_000, 5_000)] + [(720 * H, END, "r")])
    assert len(timers) == 0


def test_a_pools_retries_leave_nothing_behind_once_they_ran():
    """retry_pool went through add(), whose bookkeeping only a pop of a non-retry entry cleared: every retry of a
    pool with a pending queue (one each 30 s) stayed in memory for good."""
    from controlplane.domain.timers import RETRY, Timers
    timers = Timers()
    for i in range(1_000):
        timers.retry_pool("p", i * 30_000)
        assert timers.pop_due(i * 30_000, 10) == [(i * 30_000, RETRY, "p")]
    assert len(timers) == 0 and not timers._extra and not timers._retry_due
