"""The PostgreSQL writer's speculative groups (store/pg_writer.py, Writer._speculate): creates are run while the
group before them commits, and committed by one compare-and-set statement. When another replica writes between a
group's read and its commit, or a job needs more of the database than its prefetched reads, the group is run
again under the write lock: nothing lost, doubled or overbooked, and the memory is what the database holds."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from controlplane import catalog as catalog_mod
from controlplane import schemas, wiring
from controlplane.domain.errors import DomainError
from controlplane.store import pg_sql, pg_tx, pg_writer
from tests.controlplane.conftest import T0, TOKENS, bootstrap_doc, check_memory, h100_node
from tests.controlplane.test_metrics import scrape

pytestmark = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)

START = (T0 // 3_600_000 + 2) * 3_600_000  # one window ahead of the fake clock and of the real one
WINDOW = {"start": START, "end": START + 3_600_000}
GPUS = 16  # pool h100: nodes h1 and h2, 8 GPUs each


@pytest.fixture(autouse=True)
def short_pause(monkeypatch):
    monkeypatch.setattr(pg_writer, "SPECULATION_PAUSE_S", 0.2)  # after another replica wrote: 0.2 s, not 2


def body(key: str) -> dict:
    return {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, **WINDOW, "idempotencyKey": key}


def check_database(api) -> list[str]:
    """Zero overlapping bookings, each reservation once; the placed reservations' ids."""
    assert [(0,)] == api.rows("SELECT count(*) FROM booked_units a JOIN booked_units b ON a.node_id = b.node_id"
                              " AND a.unit = b.unit AND a.ctid < b.ctid AND a.during && b.during")
    assert [] == api.rows("SELECT id FROM reservations GROUP BY id HAVING count(*) > 1")
    # every booked device carries its own key (looked up by the writer's statement, or set by the trigger)
    assert [(0,)] == api.rows("SELECT count(*) FROM booked_units b LEFT JOIN unit_keys k ON k.id = b.unit_id"
                              " WHERE k.id IS NULL OR (k.node_id, k.unit) <> (b.node_id, b.unit)")
    return [r[0] for r in api.rows("SELECT id FROM reservations WHERE state = 'placed'")]


async def fill(api, prefix: str) -> int:
    """Creates for the window until one is not placed: how many were."""
    placed = 0
    for i in range(GPUS + 1):
        status, doc = await api.call("create", "alice", body(f"{prefix}-{i}"))
        assert status in (200, 202), doc
        if doc["reservation"]["state"] != "placed":
            return placed
        placed += 1
    raise AssertionError("more creates placed than the pool has GPUs")


async def test_a_create_by_another_replica_between_a_groups_read_and_its_commit(api, other):
    writer = api.cp.store.writer
    await asyncio.sleep(0.5)  # the other replica's start (it applied its bootstrap) heard, and the pause over
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    await asyncio.sleep(0.3)
    speculated, retries = writer.speculated, writer.retries
    commit, theirs = writer._commit_speculated, []

    async def after_the_other_replica(*args):
        # between this group's read and its commit: the other replica books
        if not theirs:
            theirs.append(await asyncio.to_thread(other.post, "/api/compute/reservations/create",
                                                  TOKENS["bob"], body("bob-1")))
        return await commit(*args)

    writer._commit_speculated = after_the_other_replica
    rebuilds = writer.rebuilds
    status, doc = await api.call("create", "alice", body("raced"))
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    assert theirs and theirs[0][0] == 202 and theirs[0][1]["reservation"]["state"] == "placed", theirs
    assert writer.retries == retries + 1  # the compare-and-set lost, and the group ran again under the lock
    assert writer.speculated == speculated  # (not committed speculatively)
    writer._commit_speculated = commit
    # the memory was repaired, not rebuilt: the create that did not land forgotten, bob's applied, alice's run again
    assert writer.rebuilds == rebuilds and not writer.unlanded
    await check_memory(api)

    # The memory knows bob's GPU: alice gets exactly what is left, and creates speculate again.
    await asyncio.sleep(0.3)
    assert await fill(api, "rest") == GPUS - 3
    assert writer.speculated > speculated
    placed = check_database(api)
    assert len(placed) == GPUS and theirs[0][1]["reservation"]["id"] in placed


async def test_another_replicas_creates_are_read_ahead_in_one_snapshot_and_leave_the_memory_exact(api, other):
    """A replica that hears another's commit reads the reservations it changed, with their bookings, ahead on its
    reading connection, then applies them: not in a snapshot on the writer's connection, whose every read holds
    the API's loop (Writer._refresh), and not by rebuilding the memory."""
    writer = api.cp.store.writer
    await asyncio.sleep(0.5)  # the other replica's start heard
    snapshots, begin_snapshot = [], writer._begin_snapshot

    def counted(*args):
        snapshots.append(args)
        return begin_snapshot(*args)

    writer._begin_snapshot = counted
    reloads, rebuilds, retries = writer.reloads, writer.rebuilds, writer.retries
    for i in range(3):
        status, doc = await asyncio.to_thread(other.post, "/api/compute/reservations/create", TOKENS["bob"],
                                              body(f"bob-{i}"))
        assert status == 202 and doc["reservation"]["state"] == "placed", doc
    for _ in range(100):
        if api.cp.store.generation == api.rows("SELECT generation FROM replica_state")[0][0]:
            break
        await asyncio.sleep(0.05)
    assert writer.reloads > reloads
    assert (writer.rebuilds, snapshots) == (rebuilds, [])
    # the memory holds bob's three GPUs: alice gets exactly the rest, with no race lost to them
    await asyncio.sleep(0.3)  # the pause after another replica's writes
    assert await fill(api, "rest") == GPUS - 3
    assert writer.retries == retries
    assert len(check_database(api)) == GPUS
    await check_memory(api)


@pytest.mark.parametrize("fault", ["reads more", "fails"])
async def test_a_refresh_that_needs_more_than_it_read_ahead_or_fails_rebuilds_the_memory(api, other, fault):
    """Should bringing the memory up ever read what the refresh did not read ahead (its snapshot is closed by
    then), or fail, the memory is rebuilt whole in a snapshot instead: nothing is applied from outside one, and
    the writer goes on (a fault that escaped would leave every later refresh waiting on this one)."""
    writer = api.cp.store.writer
    await asyncio.sleep(0.5)
    changed = writer._on_changed

    def reads_more(tx, *changes):
        if fault == "fails":
            raise RuntimeError("a fault applying another replica's changes")
        tx.catalog_docs("pools")  # a read no refresh makes ahead
        changed(tx, *changes)

    writer._on_changed = reads_more
    rebuilds = writer.rebuilds
    status, doc = await asyncio.to_thread(other.post, "/api/compute/reservations/create", TOKENS["bob"],
                                          body("bob"))
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    for _ in range(100):
        if writer.rebuilds > rebuilds:
            break
        await asyncio.sleep(0.05)
    assert writer.rebuilds == rebuilds + 1
    writer._on_changed = changed
    await asyncio.sleep(0.3)
    assert await fill(api, "rest") == GPUS - 1
    assert len(check_database(api)) == GPUS


async def test_a_locked_group_reads_another_replicas_changes_ahead_in_its_transaction(api, other, monkeypatch):
    """A group run under the lock that finds another replica's writes (their NOTIFY not yet heard) reads what
    changed in one more statement on the database's thread (Writer._begin_ahead), not with a hop of the API's loop
    per read, and its memory is what the database holds after."""
    writer = api.cp.store.writer
    await asyncio.sleep(0.5)  # the other replica's start heard
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    monkeypatch.setattr(api.cp.replicas, "_refresh", lambda: None)  # deaf to the other replica's NOTIFYs
    for i in range(3):
        status, doc = await asyncio.to_thread(other.post, "/api/compute/reservations/create", TOKENS["bob"],
                                              body(f"bob-{i}"))
        assert status == 202 and doc["reservation"]["state"] == "placed", doc
    reads, hop = [], pg_tx.PgTx._hop

    def counted(tx, statement, writes):
        reads.append(writes)
        return hop(tx, statement, writes)

    monkeypatch.setattr(pg_tx.PgTx, "_hop", counted)
    reloads, rebuilds = writer.reloads, writer.rebuilds
    status, doc = await api.call("create", "alice", body("after"))  # its speculative read finds them: the lock
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    assert (writer.reloads, writer.rebuilds) == (reloads + 1, rebuilds)
    assert False not in reads, reads  # (no read went through a hop: each was made ahead)
    monkeypatch.undo()
    await check_memory(api)
    await asyncio.sleep(0.3)
    assert await fill(api, "rest") == GPUS - 5
    assert len(check_database(api)) == GPUS


async def caught_up(api) -> None:
    """Until the api's memory is at the database's generation (it heard the other replica's NOTIFY)."""
    for _ in range(100):
        if api.cp.store.generation == api.rows("SELECT generation FROM replica_state")[0][0]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the memory did not catch up with the database")


async def test_another_replicas_catalog_and_token_changes_are_applied_without_rebuilding_the_memory(api, other):
    """A node cordoned, then a bootstrap adding a principal (with its token) and a node, on another replica: this
    one reads the catalog rows those groups wrote and the tokens, ahead in its refresh's snapshot, and takes them
    as that replica did, without rebuilding its memory (which reads every live reservation): the new principal
    authenticates here, and placement passes the cordoned node by and books the new one."""
    writer = api.cp.store.writer
    await asyncio.sleep(0.5)  # the other replica's start heard
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    reloads, rebuilds, snapshots, begin_snapshot = writer.reloads, writer.rebuilds, [], writer._begin_snapshot

    def counted(*args):
        snapshots.append(args)
        return begin_snapshot(*args)

    writer._begin_snapshot = counted
    admin = bootstrap_doc()["adminToken"]
    status, doc = await asyncio.to_thread(other.post, "/api/admin/nodes/cordon", admin, {"nodeId": "h1"})
    assert status == 200, doc
    boot = bootstrap_doc()
    boot["principals"].append({"id": "erin", "tenant": "acme", "token": "token-acme-erin-0000001"})
    boot["nodes"].append(h100_node("h3"))
    status, doc = await asyncio.to_thread(other.post, "/api/admin/bootstrap", admin, boot)
    assert status == 200, doc
    await caught_up(api)
    assert writer.reloads > reloads and (writer.rebuilds, snapshots) == (rebuilds, [])
    writer._begin_snapshot = begin_snapshot

    # The memory's catalog and tokens are what the database holds
    def stored(tx):
        docs = {kind: tx.catalog_docs(kind) for kind in catalog_mod.KINDS}
        return catalog_mod.load(docs, b"".join(tx.catalog_docs("policies")).decode()), tx.tokens()

    catalog, tokens = await api.cp.store.call(stored)
    assert (api.cp.catalog.current, api.cp.tokens.rows) == (catalog, tokens)
    assert catalog.nodes["h1"].state == "cordoned" and "h3" in catalog.nodes
    # erin's token works here; the window's GPUs go to h2 and h3, none of the cordoned h1's (warm's stays)
    await asyncio.sleep(0.3)  # the pause after another replica's writes
    status, doc = await api.call("create", "token-acme-erin-0000001", body("erin"))
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    await fill(api, "rest")
    warm_on_h1 = api.rows("SELECT count(*) FROM bookings WHERE node_id = 'h1'")[0][0]
    assert [(16,)] == api.rows("SELECT count(*) FROM booked_units WHERE node_id IN ('h2', 'h3')")
    assert [(warm_on_h1,)] == api.rows("SELECT count(*) FROM booked_units WHERE node_id = 'h1'")
    await check_memory(api)


# Whether any session holds the writers' lock (a bigint advisory lock: its high and low halves)
WRITE_LOCK_HELD = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                   f" AND classid = {pg_sql.WRITE_LOCK >> 32} AND objid = {pg_sql.WRITE_LOCK & 0xFFFFFFFF}")


async def test_a_memory_rebuilt_whole_is_read_without_the_write_lock_and_brought_up_under_it(api, other):
    """A group that finds the memory must be rebuilt whole (a failover, as here: the memory was read from
    another server run; a speculative job that failed midway) reads every live reservation in a snapshot without
    the write lock, so no replica's writes wait for that; then it takes the lock and reads only what committed
    meanwhile."""
    writer = api.cp.store.writer
    await asyncio.sleep(0.5)  # the other replica's start heard
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    reset, held, theirs = writer._on_reset, [], []

    def rebuild(tx):
        held.append(api.rows(WRITE_LOCK_HELD)[0][0])
        if not held[0]:  # (held: the other replica's create would wait for this one)
            theirs.append(other.post("/api/compute/reservations/create", TOKENS["bob"], body("bob")))
        return reset(tx)

    writer._on_reset = rebuild
    rebuilds, retries = writer.rebuilds, writer.retries
    writer.server = "a server run before a failover"
    status, doc = await api.call("create", "alice", body("after"))
    writer._on_reset = reset
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    assert held == [0]  # one rebuild, and no session held the lock meanwhile
    assert writer.rebuilds == rebuilds + 1 and writer.retries == retries
    assert theirs[0][0] == 202 and theirs[0][1]["reservation"]["state"] == "placed", theirs
    await check_memory(api)  # bob's create, committed during the rebuild, is in the memory
    await asyncio.sleep(0.3)
    assert await fill(api, "rest") == GPUS - 3
    assert len(check_database(api)) == GPUS


async def test_a_memory_rebuilt_whole_is_read_off_the_api_loop_which_serves_meanwhile(api, monkeypatch):
    """Reading every live reservation takes seconds at 100,000 of them (after a failover, as here, or a migrate's
    copy): the memory is read and built on a thread of its own, each reservation's bindings for the nodes' watches
    too, while the API's loop goes on answering, and put in place on the loop; the create that found it to rebuild
    is placed after."""
    writer = api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    reset, seen, bindings_on = writer._on_reset, {}, set()
    wanted_of = wiring.wanted_of
    monkeypatch.setattr(wiring, "wanted_of", lambda res, catalog: (bindings_on.add(threading.get_ident()),
                                                                   wanted_of(res, catalog))[1])

    def slow(tx):
        seen["read on"] = threading.get_ident()
        time.sleep(1.0)  # a large memory to read
        put = reset(tx)

        def put_in_place():
            seen["put on"] = threading.get_ident()
            put()

        return put_in_place

    async def ticking(until: asyncio.Future) -> float:
        """The longest the loop took to come back to a 10 ms sleep until `until` was done."""
        longest, last = 0.0, time.monotonic()
        while not until.done():
            await asyncio.sleep(0.01)
            longest, last = max(longest, time.monotonic() - last), time.monotonic()
        return longest

    writer._on_reset = slow
    rebuilds = writer.rebuilds
    writer.server = "a server run before a failover"
    try:
        create = asyncio.ensure_future(api.call("create", "alice", body("after")))
        longest = asyncio.ensure_future(ticking(create))
        await asyncio.sleep(0.3)  # the rebuild under way
        resp = await api.client.get("/healthz")
        assert resp.status == 200 and "read on" in seen and "put on" not in seen, seen  # answered meanwhile
        status, doc = await create
        assert await longest < 0.4  # (the loop held through the rebuild: 1 s and more)
    finally:
        writer._on_reset = reset
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    assert seen["read on"] != threading.get_ident() and seen["put on"] == threading.get_ident()
    assert bindings_on == {seen["read on"]}
    assert writer.rebuilds == rebuilds + 1
    await check_memory(api)


async def test_a_locked_job_that_fails_after_changing_the_memory_is_answered_and_the_rest_run_again(api):
    """A job of a locked group that fails after it changed the memory (a bug's path) is answered with its failure;
    the group's transaction is rolled back, the memory rebuilt whole in a snapshot without the write lock (not in
    that transaction, with every replica's writes waiting), and the group's other jobs, before and after it, run
    again: each create committed once, and the memory is what the database holds."""
    cp, writer = api.cp, api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    reset, held = writer._on_reset, []

    def rebuild(tx):
        held.append(api.rows(WRITE_LOCK_HELD)[0][0])
        return reset(tx)

    def broken(tx):
        tx.touch()  # as a job marks the memory before it changes it
        raise RuntimeError("a bug, midway")

    async def create(key: str):
        command = schemas.create_command(schemas.CreateBody(poolId="h100", gpuModel="H100_80GB", gpuCount=1,
                                                            **WINDOW), key)
        return await cp.reservations.create(cp.catalog.current.principals["alice"], command)

    async def bug():
        return await cp.store.call(broken)

    writer._on_reset = rebuild
    writer._pause_speculation()  # one group, under the lock: first, the broken job, last
    rebuilds, groups = writer.rebuilds, writer.groups
    first, failed, last = await asyncio.gather(create("first"), bug(), create("last"), return_exceptions=True)
    writer._on_reset = reset
    assert isinstance(failed, DomainError) and failed.code == "PROVIDER_UNAVAILABLE", failed
    assert first.reservation.state == last.reservation.state == "placed"
    assert held == [0]  # one rebuild, without the lock
    assert writer.rebuilds == rebuilds + 1 and writer.groups == groups + 1  # the other two in one group, again
    ids = sorted([first.reservation.id, last.reservation.id])
    assert [(i,) for i in ids] == api.rows(
        f"SELECT id FROM reservations WHERE id IN ('{ids[0]}', '{ids[1]}') ORDER BY id")
    await check_memory(api)
    assert len(check_database(api)) == 3
    # One run outside the loop (start-up, a bootstrap applied): its caller hears the failure once the memory is
    # rebuilt, without the lock, too
    writer._on_reset = rebuild
    with pytest.raises(DomainError, match="could not complete"):
        await asyncio.to_thread(cp.store.call_sync, broken)
    writer._on_reset = reset
    assert held == [0, 0] and writer.rebuilds == rebuilds + 2
    await check_memory(api)


async def test_a_job_whose_read_fails_at_the_database_fails_alone_not_its_groups_other_jobs(api):
    """A read the database refuses (here a NUL in a text parameter, which the API now refuses before) aborts the
    group's transaction before the job opened a savepoint: it was answered alone, and every later job of the group
    then failed on the aborted transaction (503 for other tenants' requests). The group is undone as a job failing
    midway is, and its other jobs run again."""
    cp, writer = api.cp, api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202

    async def create(key: str):
        command = schemas.create_command(schemas.CreateBody(poolId="h100", gpuModel="H100_80GB", gpuCount=1,
                                                            **WINDOW), key)
        return await cp.reservations.create(cp.catalog.current.principals["alice"], command)

    async def refused_read():
        return await cp.store.call(lambda tx: tx.reservation("rsv_\x00"))

    writer._pause_speculation()  # one group, under the lock: a create, the refused read, a create
    first, failed, last = await asyncio.gather(create("first"), refused_read(), create("last"),
                                               return_exceptions=True)
    assert isinstance(failed, DomainError) and failed.code == "PROVIDER_UNAVAILABLE", failed
    assert first.reservation.state == last.reservation.state == "placed", (first, last)
    await check_memory(api)
    assert len(check_database(api)) == 3


async def test_a_create_that_needs_the_database_mid_job_is_run_again_under_the_lock(api):
    writer = api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    speculated = writer.speculated
    assert speculated >= 1
    # An agent's create beyond what it may book alone opens a confirmation: a row written mid-job, before the
    # create changes the memory, so the speculative run stops and the create runs again inside the locked
    # transaction, with nothing to rebuild.
    reloads = writer.reloads
    status, doc = await api.call("create", "agent", {**body("big"), "gpuCount": 4})
    assert (status, doc["error"]["code"]) == (403, "CONFIRMATION_REQUIRED"), doc
    assert writer.reloads == reloads
    assert [(1,)] == api.rows("SELECT count(*) FROM confirmations")
    assert [e["type"] for e in await api.events()] == ["reservation.placed", "reservation.awaiting-confirmation"]
    await asyncio.sleep(0.3)
    assert await fill(api, "rest") == GPUS - 1
    assert writer.speculated > speculated
    assert len(check_database(api)) == GPUS


async def test_concurrent_creates_pipelined_over_commits_book_each_gpu_once(api):
    writer = api.cp.store.writer
    answers = await asyncio.gather(*(api.call("create", "alice", body(f"c{i}")) for i in range(3 * GPUS)))
    assert all(status == 202 for status, _ in answers), answers
    placed = [doc["reservation"]["id"] for _, doc in answers if doc["reservation"]["state"] == "placed"]
    assert len(placed) == GPUS and sorted(placed) == sorted(check_database(api))
    assert writer.speculated >= 1
    scraped = await scrape(api)
    assert scraped["berth_store_speculative_groups_total"][()] == writer.speculated
    assert scraped["berth_store_race_retries_total"][()] == writer.retries == 0
    assert not writer.unlanded  # every speculative create landed: none is left to forget
    # retried keys replay what was answered, from the database
    again = await asyncio.gather(*(api.call("create", "alice", body(f"c{i}")) for i in range(3 * GPUS)))
    assert [doc["reservation"]["id"] for _, doc in again] == [doc["reservation"]["id"] for _, doc in answers]
    assert len(check_database(api)) == GPUS


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_creates_arriving_while_a_commit_is_on_its_way_are_run_as_they_come_and_sent_as_one_group(api):
    """While a group commits, creates that arrive are read and run batch by batch, and all sent in one commit
    when it lands. A second request with a key the open group already holds is not run in it: it waits for
    that commit and replays the reservation."""
    writer = api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    await asyncio.sleep(0.3)  # the pause after the start is over: groups of creates speculate
    commit, read, held, batches, sent = writer._commit_speculated, writer._speculation_read, asyncio.Event(), [], []

    async def held_commit(*args):
        sent.append(args)
        await held.wait()
        return await commit(*args)

    async def logged_read(reads):
        batches.append(list(reads))
        return await read(reads)

    writer._commit_speculated, writer._speculation_read = held_commit, logged_read
    try:
        first = asyncio.ensure_future(api.call("create", "alice", body("first")))
        await until(lambda: len(sent) == 1)
        groups, speculated = writer.groups, writer.speculated
        later = []
        for i in range(3):  # each arrives after the one before it was run, and the open group waits for more
            later.append(asyncio.ensure_future(api.call("create", "alice", body(f"later-{i}"))))
            await until(lambda: len(batches) == i + 2 and writer._wake is not None)
        again = asyncio.ensure_future(api.call("create", "alice", body("later-0")))
        await asyncio.sleep(0.2)
        assert len(batches) == 4 and len(sent) == 1 and not any(t.done() for t in (first, *later, again))
        held.set()
        answers = await asyncio.gather(first, *later, again)
    finally:
        writer._commit_speculated, writer._speculation_read = commit, read
    assert all(status == 202 for status, _ in answers), answers
    ids = [doc["reservation"]["id"] for _, doc in answers]
    assert ids[-1] == ids[1] and len(set(ids)) == 4
    assert writer.speculated == speculated + 2  # first's group, then the three later ones together
    assert writer.groups == groups + 3  # and the replay's, under the lock
    placed = check_database(api)
    assert set(ids) <= set(placed) and len(placed) == 5  # warm, first and the three later ones


async def explain(conn, sql: str, arguments: str) -> str:
    """The plan `conn` runs `sql` with, as a prepared statement (so with its plan_cache_mode)."""
    await conn.execute(f"PREPARE plan_check AS {sql}")
    try:
        return "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE plan_check({arguments})"))
    finally:
        await conn.execute("DEALLOCATE plan_check")


async def test_the_writers_statements_keep_index_plans_made_on_nearly_empty_and_on_large_tables(api):
    """The writer's connections plan each statement once (each group skips the planning) and never as a
    sequential scan: a plan made while the tables were nearly empty, as analyzed, still looks rows up by index,
    and what other replicas changed is read by its generations on a large table too (an open range there was
    planned as a scan of every reservation)."""
    writer = api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    await asyncio.sleep(0.3)  # past the pause after the start (a loaded machine may have sent "warm" under the lock)
    status, _ = await api.call("create", "alice", body("warm-2"))  # speculates: opens the reader and the sender
    assert status == 202 and writer.speculated >= 1
    rows = "'[]', '[]', '[]', '[]', '[]', ''"  # no appended rows of any kind (PgAppends.parameters)
    checks = [  # (statement, its connection, arguments, the index its plan must use on a large table)
        ("BEGUN", pg_sql.BEGUN, "reader", "'{}'", "reservations_id_key"),
        ("SPECULATED", pg_sql.SPECULATED, "sender", f"0, '{{}}', {rows}", "reservations_id_key"),
        ("BEGUN", pg_sql.BEGUN, "conn", "'{}'", "reservations_id_key"),
        ("COMMIT_GROUP", pg_sql.COMMIT_GROUP, "conn", f"false, '{{}}', {rows}", "reservations_id_key"),
        ("CHANGED_SINCE", pg_sql.CHANGED_SINCE, "conn", "1, 2", "reservations_by_gen"),
        ("CHANGES", pg_sql.CHANGES, "reader", "1, 0", "reservations_by_gen"),
        ("CHANGES", pg_sql.CHANGES, "reader", "1, 0", "catalog_by_gen"),
        ("CHANGES", pg_sql.CHANGES, "reader", "1, 0", "bookings_by_reservation"),
        ("CHANGES", pg_sql.CHANGES, "conn", "1, 0", "reservations_by_gen"),
        ("CATALOG_CHANGED_SINCE", pg_sql.CATALOG_CHANGED_SINCE, "conn", "1, 2", "catalog_by_gen"),
        ("LIVE_BOOKINGS_OF", pg_sql.LIVE_BOOKINGS_OF, "conn", "0, '{}'", "bookings_by_reservation"),
    ]
    for tables in ("nearly empty", "large"):
        if tables == "large":
            api.rows("INSERT INTO reservations (seq, id, tenant_id, principal_id, pool_id, state, doc, gen)"
                     " SELECT (SELECT max(seq) FROM reservations) + i, 'x' || i, 'acme', 'alice', 'h100', 'released',"
                     " '', i FROM generate_series(1, 300000) i")
            api.rows("INSERT INTO bookings (reservation_id, pool_id, node_id, start_ms, end_ms, vcpu_milli, memory_mib,"
                     " hugepages_1g) SELECT 'x' || i, 'h100', 'h1', 0, 0, 0, 0, 0 FROM generate_series(1, 100000) i")
            api.rows("ALTER TABLE catalog DISABLE TRIGGER catalog_stamped")  # (rows of many generations)
            api.rows("INSERT INTO catalog (kind, id, doc, gen) SELECT 'x', 'x' || i, '', i"
                     " FROM generate_series(1, 100000) i")
        api.rows("ANALYZE")
        for name, sql, side, arguments, index in checks:
            conn = getattr(writer, side)
            assert conn is not None and not conn.is_closed(), side
            if side == "conn":  # the locked path's connection lives on the database's thread
                plan = await asyncio.wrap_future(writer.connector.submit(explain(conn, sql, arguments)))
            else:
                plan = await explain(conn, sql, arguments)
            # (every token is read where the catalog changed, so tokens alone are scanned whole)
            assert "Seq Scan" not in plan.replace("Seq Scan on tokens", ""), \
                f"{name} on {side}, {tables} tables: a sequential scan\n{plan}"
            if tables == "large":  # (on a table of a row or two, any index will do)
                assert index in plan, f"{name} on {side}, {tables} tables: not by {index}\n{plan}"


async def test_a_create_naming_a_quote_runs_under_the_lock_without_rebuilding_the_memory(api):
    """A create with a quoteId reads its quote from the database before it changes anything: that create alone
    is run again under the lock; the memory is not rebuilt, and the creates after it speculate again at once."""
    writer = api.cp.store.writer
    status, _ = await api.call("create", "alice", body("warm"))
    assert status == 202
    await asyncio.sleep(0.3)
    status, doc = await api.call("quote", "alice", {k: v for k, v in body("q").items() if k != "idempotencyKey"})
    assert status == 200, doc
    quote = doc["quote"]
    reloads, speculated = writer.reloads, writer.speculated
    status, doc = await api.call("create", "alice", {**body("quoted"), "quoteId": quote["id"]})
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    assert writer.reloads == reloads  # nothing to undo: the memory stands
    assert await fill(api, "after") == GPUS - 2
    assert writer.speculated > speculated
    assert len(check_database(api)) == GPUS


async def test_a_create_that_preempts_spot_work_runs_under_the_lock_without_rebuilding_the_memory(api):
    """A create that fits only by preempting spot work reads its victims before it changes anything: it goes
    to the lock alone, preempts exactly what it needs there, and the memory is not rebuilt."""
    writer = api.cp.store.writer
    spots = []
    for i in range(4):  # the two nodes' 16 GPUs, as spot work
        status, doc = await api.call("create", "alice", {**body(f"spot-{i}"), "gpuCount": 4, "spot": True})
        assert status == 202 and doc["reservation"]["state"] == "placed", doc
        spots.append(doc["reservation"]["id"])
    await asyncio.sleep(0.3)
    reloads, speculated = writer.reloads, writer.speculated
    status, doc = await api.call("create", "alice", {**body("firm"), "gpuCount": 4})
    assert status == 202 and doc["reservation"]["state"] == "placed", doc
    assert writer.reloads == reloads  # nothing to undo: the memory stands
    states = [(await api.call("get", "alice", {"reservationId": rid}))[1]["reservation"] for rid in spots]
    assert sorted(s["state"] for s in states) == ["placed", "placed", "placed", "released"]
    assert [s["reason"] for s in states if s["state"] == "released"] == ["preempted"]
    later = {**body("next"), "start": START + 7_200_000, "end": START + 10_800_000}  # free: speculates again
    status, doc = await api.call("create", "alice", later)
    assert status == 202 and doc["reservation"]["state"] == "placed" and writer.speculated > speculated, doc
    assert api.cp.state.calendar.overlaps() == []
    assert len(check_database(api)) == 5  # the firm one, three spot reservations and the later one


async def test_a_token_another_replica_issued_a_moment_ago_is_known_here_at_once(api, other):
    """An agent registers on another replica and its next call reaches this one (a balancer's choice) before this
    replica heard of that commit: the token is unknown here, so the memory catches up with the database first
    (controlplane/api/auth.known_first), and the call is served, not refused 401. A token nobody issued is still
    refused, after the same catch-up."""
    from tests.controlplane.test_nodes import inventory

    await asyncio.sleep(0.5)  # the other replica's start heard
    api.cp.replicas._refresh = lambda: None  # this replica hears no NOTIFY now: only the catch-up brings the token
    reloads = api.cp.store.writer.reloads
    status, registered = await asyncio.to_thread(other.post, "/api/nodes/register", "node-token-h100-000001",
                                                 {"hostname": "h1.test", "inventory": inventory("h1.test")})
    assert status == 200, registered
    status, doc = await api.post("/api/nodes/heartbeat", registered["nodeToken"], {})
    assert status == 200, doc
    assert api.cp.store.writer.reloads == reloads + 1
    status, doc = await api.post("/api/nodes/heartbeat", "nt_nobody-issued-this-one", {})
    assert (status, doc["error"]["code"]) == (401, "UNAUTHENTICATED"), doc


async def test_a_flood_of_made_up_tokens_costs_a_few_catch_ups_and_a_token_issued_meanwhile_is_known(api, other):
    """Anyone can send made-up tokens, and each unknown one asks for a catch-up with the database (which waits for
    the speculative commit on its way). Four clients sending them back to back for a second: the requests that ask
    together share one catch-up, and one begins at most every CATCH_UP_SPACING_S, so the writer is asked for some
    20 refreshes, not one per request (each closed-loop client got several hundred a second before). A node's
    token the other replica issues in the middle of the flood is still known here at its first use."""
    from controlplane import replicas
    from tests.controlplane.test_nodes import inventory

    await asyncio.sleep(0.5)  # the other replica's start heard
    api.cp.replicas._refresh = lambda: None  # this replica hears no NOTIFY now: only catch-ups bring it on
    store, asked = api.cp.store, []
    refresh = store.refresh

    def counted():
        asked.append(time.monotonic())
        return refresh()

    store.refresh = counted
    catch_ups, refused = api.cp.replicas.catch_ups, []
    flood_s = 1.0

    async def client(n: int) -> None:
        end, i = time.monotonic() + flood_s, 0
        while time.monotonic() < end:
            status, doc = await api.call("list", f"made-up-{n}-{i}", {})
            refused.append((status, doc["error"]["code"]))
            i += 1

    async def registered_meanwhile():
        await asyncio.sleep(flood_s / 2)
        status, doc = await asyncio.to_thread(other.post, "/api/nodes/register", "node-token-h100-000001",
                                              {"hostname": "h1.test", "inventory": inventory("h1.test")})
        assert status == 200, doc
        return await api.post("/api/nodes/heartbeat", doc["nodeToken"], {})

    started = time.monotonic()
    *_, heartbeat = await asyncio.gather(*(client(n) for n in range(4)), registered_meanwhile())
    elapsed = time.monotonic() - started
    assert heartbeat[0] == 200, heartbeat
    assert refused and set(refused) == {(401, "UNAUTHENTICATED")}
    assert len(asked) == api.cp.replicas.catch_ups - catch_ups  # one refresh per catch-up
    assert 1 < len(asked) <= elapsed / replicas.CATCH_UP_SPACING_S + 2, (len(asked), len(refused), elapsed)
    assert len(refused) >= 3 * len(asked)  # shared: four clients' requests, and more, per catch-up
    assert min(b - a for a, b in zip(asked, asked[1:])) >= replicas.CATCH_UP_SPACING_S * 0.9
    store.refresh = refresh


async def test_a_watch_with_a_version_from_a_replica_further_on_waits_for_this_one_to_catch_up(api, other):
    """An agent's last watch was answered by the other replica, which had just committed a release of the node's
    binding; its next watch reaches this replica before it heard of that commit. This one catches up first and
    answers as the other would (no change since that version): not its older set, which still held the binding
    (the agent would bind a released reservation again)."""
    from tests.controlplane.test_nodes import BOOT, inventory

    await asyncio.sleep(0.5)  # the other replica's start heard
    tokens = {}
    for host in ("h1", "h2"):
        status, doc = await api.post("/api/nodes/register", BOOT, {"hostname": f"{host}.test",
                                                                    "inventory": inventory(f"{host}.test")})
        assert status == 200, doc
        tokens[host] = doc["nodeToken"]
    status, doc = await api.create(key="soon", start=T0 + 60_000, end=T0 + 3_600_000)
    assert status == 202, doc
    rid, node = doc["reservation"]["id"], doc["reservation"]["placements"][0]["nodeId"]
    await api.settle(120_000)  # its window started: binding (this replica leads)
    status, first = await api.post("/api/nodes/watch", tokens[node], {"timeoutMs": 0})
    assert [rid] == [b["reservationId"] for b in first["bindings"]], first
    await caught_up(api)

    def binding_there() -> bool:
        return other.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": rid})[1][
            "reservation"]["state"] == "binding"

    for _ in range(100):  # the other replica heard it too
        if await asyncio.to_thread(binding_there):
            break
        await asyncio.sleep(0.05)
    api.cp.replicas._refresh = lambda: None  # this replica hears no NOTIFY now: only a catch-up brings it on
    status, doc = await asyncio.to_thread(other.post, "/api/compute/reservations/release", TOKENS["alice"],
                                          {"reservationId": rid})
    assert status == 202, doc
    status, there = await asyncio.to_thread(other.post, "/api/nodes/watch", tokens[node],
                                            {"resourceVersion": first["resourceVersion"], "timeoutMs": 5000})
    assert status == 200 and there["changed"] and there["bindings"] == [], there
    status, here = await api.post("/api/nodes/watch", tokens[node],
                                  {"resourceVersion": there["resourceVersion"], "timeoutMs": 300})
    assert status == 200, here
    assert (False, [], there["resourceVersion"]) == (here["changed"], here["bindings"], here["resourceVersion"])


async def test_one_set_of_bindings_has_one_version_on_every_replica_however_its_changes_came(api, other):
    """One reconciler pass (one commit) moves two reservations of one node to binding: the node's set changes twice
    as the commit's changes are applied, here after the commit and on the other replica as it reads them (in
    whatever batches its refreshes take). A node's version is a digest of its set, so both give it one version, and
    an agent whose next watch reaches the other replica waits there. (Versions were generations: a node changed
    twice at one took a version from the clock on each replica, unequal, and a replica that read several commits at
    once stamped the last one's generation where the writer had stamped its own; every watch moving between the
    replicas was then answered at once as a change, a long poll turned into a busy one.) The same set again is the
    same version: a restarted replica, or a change undone, answers an agent that has it by waiting."""
    from controlplane.nodes import EMPTY_SET
    from tests.controlplane.test_nodes import BOOT, inventory

    await asyncio.sleep(0.5)  # the other replica's start heard
    status, doc = await api.post("/api/nodes/register", BOOT, {"hostname": "h1.test", "inventory": inventory("h1.test")})
    assert status == 200, doc
    token = doc["nodeToken"]
    status, empty = await api.post("/api/nodes/watch", token, {"timeoutMs": 0})
    assert (EMPTY_SET, []) == (empty["resourceVersion"], empty["bindings"])
    rids = []  # half of a node each: both on h1, the node booked first
    for key in ("a", "b"):
        status, doc = await api.create(key=f"half-{key}", gpuCount=4, start=T0 + 60_000, end=T0 + 3_600_000)
        assert status == 202 and doc["reservation"]["placements"][0]["nodeId"] == "h1", doc
        rids.append(doc["reservation"]["id"])
    await api.settle(120_000)  # both windows started: one pass, one commit
    status, here = await api.post("/api/nodes/watch", token, {"timeoutMs": 0})
    assert sorted(rids) == [b["reservationId"] for b in here["bindings"]], here
    await caught_up(api)

    def both_binding_there() -> bool:
        return all(other.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": rid})[1][
            "reservation"]["state"] == "binding" for rid in rids)

    for _ in range(100):  # the other replica heard the commit
        if await asyncio.to_thread(both_binding_there):
            break
        await asyncio.sleep(0.05)
    status, there = await asyncio.to_thread(other.post, "/api/nodes/watch", token,
                                            {"resourceVersion": here["resourceVersion"], "timeoutMs": 300})
    assert status == 200, there
    assert (False, here["resourceVersion"]) == (there["changed"], there["resourceVersion"]), there

    # The set changed and back (a binding gone, then back, as a memory rebuilt twice would have it): its version
    # is the one it had, and a watch at it waits.
    live = api.cp.nodes.live["h1"]
    binding = live.bindings[rids[0]]
    api.cp.nodes._want(rids[0], {})
    assert live.rv not in (here["resourceVersion"], EMPTY_SET)
    api.cp.nodes._want(rids[0], {"h1": binding})
    status, again = await api.post("/api/nodes/watch", token, {"resourceVersion": here["resourceVersion"],
                                                               "timeoutMs": 200})
    assert (False, here["resourceVersion"]) == (again["changed"], again["resourceVersion"]), again


async def test_what_a_bootstrap_on_another_replica_took_away_is_refused_here_at_once(api, other):
    """A release the other replica's policies just forbade, and a cancel with a token it just replaced, reach this
    replica before it heard of that commit: a mutation decided from memory first catches up (DECIDED_FRESH in
    controlplane/api/app.py), so both are refused as the other replica would refuse them."""
    await asyncio.sleep(0.5)  # the other replica's start heard
    api.cp.replicas._refresh = lambda: None  # this replica hears no NOTIFY now: only the catch-up brings it on
    status, alices = await api.call("create", "alice", body("alice's"))
    assert status == 202, alices
    status, bobs = await api.call("create", "bob", {**body("bob's"), "start": START + 7_200_000,
                                                    "end": START + 10_800_000})
    assert status == 202, bobs
    boot = bootstrap_doc()
    boot["policies"] += ('\nforbid (principal == User::"alice", action == Action::"compute:reservations:release",'
                         ' resource);\n')
    boot["principals"] = [{**p, "token": "token-acme-bob-replaced-0001"} if p["id"] == "bob" else p
                          for p in boot["principals"]]
    status, doc = await asyncio.to_thread(other.post, "/api/admin/bootstrap", boot["adminToken"], boot)
    assert status == 200, doc
    status, doc = await api.call("release", "alice", {"reservationId": alices["reservation"]["id"]})
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED"), doc
    status, doc = await api.call("cancel", TOKENS["bob"], {"reservationId": bobs["reservation"]["id"]})
    assert (status, doc["error"]["code"]) == (401, "UNAUTHENTICATED"), doc
    status, doc = await api.call("cancel", "token-acme-bob-replaced-0001", {"reservationId": bobs["reservation"]["id"]})
    assert status == 202 and doc["reservation"]["state"] == "cancelled", doc
