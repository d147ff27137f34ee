"""PostgreSQL going away under two running replicas (the primary crashing, or the gap of a failover) and coming
back on the same address: meanwhile every request answers 503 PROVIDER_UNAVAILABLE with `details.actor:
"platform"` and never a 500; afterwards the replicas reconnect by themselves, one leads again, they hear each
other's commits again, and the creates retried with their keys are booked exactly once (docs/scale-out.md)."""
from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections import Counter

import pytest

from tests import dbrows
from tests.controlplane.conftest import TOKENS, bootstrap_doc, h100_node
from tests.controlplane.test_replicas import ADMIN, create_body, leads, used_gpus
from tests.pgcluster import cluster_or_skip
from tests.serverproc import ServerProcess
from tests.waiting import wait_for

ALICE = TOKENS["alice"]
CREATE = "/api/compute/reservations/create"


@pytest.fixture
def cluster():
    """A cluster of this test's own: it is stopped and started again, which the session's shared one must not be."""
    yield from cluster_or_skip()


GET = "/api/compute/reservations/get"


def bootstrap_in(tmp_path):
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    return boot


def timed(call):
    """(call's answer, the seconds it took)."""
    started = time.monotonic()
    return call(), time.monotonic() - started


def unavailable(status: int, doc: dict) -> bool:
    return (status, doc.get("error", {}).get("code"), doc.get("error", {}).get("details", {}).get("actor")) == (
        503, "PROVIDER_UNAVAILABLE", "platform")


def test_a_database_outage_answers_provider_unavailable_and_the_replicas_recover_by_themselves(cluster, tmp_path):
    db = cluster.createdb(f"berth_{uuid.uuid4().hex[:12]}")
    doc = bootstrap_doc()
    doc["nodes"].append(h100_node("x0"))
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(doc))
    with ServerProcess(db, boot) as a, ServerProcess(db, boot) as b:
        status, before = a.post(CREATE, ALICE, create_body("before-the-outage"))
        assert status == 202, before
        wait_for(lambda: leads(a) or leads(b))

        cluster.stop()
        answers = []
        for i, replica in enumerate((a, b, a, b)):
            answers.append(replica.post(CREATE, ALICE, create_body(f"during-{i}"), timeout=40))
            answers.append(replica.post("/api/compute/reservations/get", ALICE,
                                        {"reservationId": before["reservation"]["id"]}, timeout=40))
            answers.append(replica.post("/api/compute/events/list", ALICE, {}, timeout=40))
        assert all(status != 500 for status, _ in answers), answers
        creates = answers[::3]
        assert all(unavailable(*answer) for answer in creates), creates
        # reads are served from the database too: unavailable as well, or answered (never anything else)
        assert all(unavailable(*answer) or answer[0] == 200 for answer in answers), answers

        cluster.start()  # the same address: a failover's new primary behind the same name
        acked: dict[str, str] = {before["reservation"]["id"]: "before-the-outage"}
        for i, replica in enumerate((a, b, a, b)):
            def retried():
                got = replica.post(CREATE, ALICE, create_body(f"during-{i}"), timeout=40)
                assert got[0] in (202, 503) and (got[0] == 202 or unavailable(*got)), got
                return got if got[0] == 202 else None
            status, created = wait_for(retried, timeout=30, interval=0.2)  # reconnects with backoff (at most 5 s)
            acked[created["reservation"]["id"]] = f"during-{i}"
        again = [a.post(CREATE, ALICE, create_body(f"during-{i}"))[1]["reservation"]["id"] for i in range(4)]
        assert again == [rid for rid, key in acked.items() if key.startswith("during")]  # replays, not new ones

        assert wait_for(lambda: [leads(a), leads(b)].count(True) == 1, timeout=30)  # one leader again
        # They hear each other again: a create on b reaches a's memory (its quota ledger) without a write on a.
        wait_for(lambda: used_gpus(a) == len(acked), timeout=10)
        status, after = b.post(CREATE, ALICE, create_body("after-the-outage"))
        assert status == 202, after
        acked[after["reservation"]["id"]] = "after-the-outage"
        assert wait_for(lambda: used_gpus(a) == len(acked), timeout=5)
        status, tenant = a.post("/api/admin/tenants/get", ADMIN, {"tenantId": "acme"})
        assert status == 200, tenant

    ids = Counter(r[0] for r in dbrows.rows(db, "SELECT id FROM reservations"))
    assert set(ids) == set(acked) and all(n == 1 for n in ids.values()), (ids, acked)
    tracebacks = [line for line in a.lines + b.lines if "Traceback" in line]
    assert not tracebacks, tracebacks


def test_a_commit_the_database_holds_is_answered_provider_unavailable_and_replayed_once_it_lands(cluster, tmp_path):
    """A lone synchronous standby away: PostgreSQL holds every commit until it is back (or no longer asked for).
    A create waits at most --commit-wait for its commit, then hears PROVIDER_UNAVAILABLE (actor platform); reads
    are served meanwhile; once the commits are let go, each create retried with its key replays the one
    reservation its held commit made."""
    db = cluster.createdb(f"berth_{uuid.uuid4().hex[:12]}")
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(db, boot, extra=["--commit-wait", "1"]) as server:
        status, before = server.post(CREATE, ALICE, create_body("before"))
        assert status == 202, before
        cluster.psql("ALTER SYSTEM SET synchronous_standby_names = 'berth_absent_standby'")
        cluster.psql("SELECT pg_reload_conf()")
        try:
            held = []
            for key in ("held-1", "held-2"):
                started = time.monotonic()
                answer = server.post(CREATE, ALICE, create_body(key), timeout=40)
                held.append((answer, time.monotonic() - started))
            assert all(unavailable(*answer) for answer, _ in held), held
            assert all(0.9 < took < 10 for _, took in held), held  # --commit-wait 1: not the statement timeout
            assert "same idempotency key" in held[0][0][1]["error"]["message"]
            assert int(cluster.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'", db)) >= 1
            status, got = server.post("/api/compute/reservations/get", ALICE,
                                      {"reservationId": before["reservation"]["id"]})
            assert status == 200 and got["reservation"]["id"] == before["reservation"]["id"], got
        finally:
            cluster.psql("ALTER SYSTEM RESET synchronous_standby_names")
            cluster.psql("SELECT pg_reload_conf()")
        acked = {before["reservation"]["id"]: "before"}
        for key in ("held-1", "held-2"):  # retried: the held commit has landed, or lands now; one reservation each
            status, created = wait_for(lambda: (lambda got: got if got[0] == 202 else None)(
                server.post(CREATE, ALICE, create_body(key), timeout=40)), timeout=30, interval=0.2)
            acked[created["reservation"]["id"]] = key
        assert server.post(CREATE, ALICE, create_body("held-1"))[1]["reservation"]["id"] in acked
        metrics = urllib.request.urlopen(urllib.request.Request(
            server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}), timeout=10).read().decode()
        # the two creates; not the reconciler's passes meanwhile (the platform's own work waits for its commits)
        assert re.search(r"^berth_store_commit_waits_expired_total 2\.0$", metrics, re.M), metrics
        lines = server.lines

    ids = Counter(r[0] for r in dbrows.rows(db, "SELECT id FROM reservations"))
    assert set(ids) == set(acked) and all(n == 1 for n in ids.values()), (ids, acked)
    assert len(acked) == 3
    tracebacks = [line for line in lines if "Traceback" in line]
    assert not tracebacks, tracebacks


def test_a_database_that_turned_read_only_is_unavailable_not_a_fault(cluster, tmp_path):
    """A demoted primary (or a standby) takes no writes: a release, whose job writes as it runs, is answered as the
    database's state (PROVIDER_UNAVAILABLE naming it), not as a fault of the job (an error-level traceback and a
    whole rebuild of the memory), and goes through once the database takes writes again."""
    name = f"berth_{uuid.uuid4().hex[:12]}"
    db = cluster.createdb(name)
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    release = "/api/compute/reservations/release"

    def sessions_again() -> None:
        cluster.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' "
                     "AND pid <> pg_backend_pid()")

    with ServerProcess(db, boot) as a:
        status, created = a.post(CREATE, ALICE, create_body("ro"))
        assert status == 202, created
        rid = created["reservation"]["id"]
        cluster.psql(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        sessions_again()
        said = []

        def refused_read_only():  # (the first try may meet the pooled connection that was ended: unavailable too)
            status, doc = a.post(release, ALICE, {"reservationId": rid}, timeout=40)
            said.append((status, doc))
            return "(ReadOnlySQLTransactionError)" in doc.get("error", {}).get("message", "")

        wait_for(refused_read_only, timeout=30, interval=0.2, what="a release refused as the database's state")
        assert all(unavailable(*answer) for answer in said), said
        assert said[-1][1]["error"]["message"].startswith("the database is unavailable (ReadOnlySQLTransactionError)")
        cluster.psql(f"ALTER DATABASE {name} RESET default_transaction_read_only")
        sessions_again()
        def released():
            got = a.post(release, ALICE, {"reservationId": rid}, timeout=40)
            return got[0] == 202 and got

        status, done = wait_for(released, timeout=30, interval=0.2)
        assert "released" == done["reservation"]["state"]
    faults = [line for line in a.lines if "store job failed" in line or "Traceback" in line]
    assert not faults, faults


def test_a_database_that_stops_answering_holds_no_request_longer_than_the_read_bound(cluster, tmp_path):
    """Every process of the cluster stopped (SIGSTOP: a frozen primary, a link dropping packets), so nothing is
    refused, nothing answers: the leader's loop used to wait on the database for 30 s at a time, its health check
    and every request with it. Now a read waits at most READ_ON_LOOP_S, later ones are answered at once until a
    probe hears the database again, a create at most --commit-wait, and /healthz at once throughout."""
    import os
    import signal

    from controlplane.store.postgres import READ_ON_LOOP_S

    db = cluster.createdb(f"berth_{uuid.uuid4().hex[:12]}")
    with ServerProcess(db, bootstrap_in(tmp_path), ["--commit-wait", "2"]) as a:
        status, created = a.post(CREATE, ALICE, create_body("before"))
        assert status == 202, created
        rid = created["reservation"]["id"]
        wait_for(lambda: leads(a))
        frozen = cluster.processes()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            (status, doc), took = timed(lambda: a.post(GET, ALICE, {"reservationId": rid}, timeout=40))
            assert (True, True) == (unavailable(status, doc), took < READ_ON_LOOP_S + 2), (took, doc)
            with urllib.request.urlopen(a.url + "/healthz", timeout=2) as answer:
                assert 200 == answer.status
            (status, doc), took = timed(lambda: a.post(GET, ALICE, {"reservationId": rid}, timeout=40))
            assert (True, "the database is not answering; retry shortly", True) == (
                unavailable(status, doc), doc["error"]["message"], took < 1), (took, doc)
            (status, doc), took = timed(lambda: a.post(CREATE, ALICE, create_body("frozen"), timeout=40))
            assert (True, True) == (unavailable(status, doc), took < 2 + 2), (took, doc)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        status, doc = wait_for(lambda: (got := a.post(GET, ALICE, {"reservationId": rid}, timeout=40))[0] == 200
                               and got, timeout=20, interval=0.2)
        assert "before" == doc["reservation"]["idempotencyKey"]
    tracebacks = [line for line in a.lines if "Traceback" in line]
    assert not tracebacks, tracebacks


def test_a_table_locked_whole_holds_no_request_and_reads_come_back_after_it(pg_cluster, tmp_path):
    """A read blocked by a table locked whole (a migration's ALTER, VACUUM FULL, `migrate --replace`'s TRUNCATE, an
    operator's LOCK TABLE) held the API's loop for the read bound (5 s) each time, /healthz and heartbeats with it,
    for as long as the lock lasted. Now such a read gives up after READ_LOCK_TIMEOUT_MS, and later ones answer at
    once until the same read gets through again."""
    import subprocess
    import threading

    name = f"berth_{uuid.uuid4().hex[:12]}"
    db = pg_cluster.createdb(name)
    with ServerProcess(db, bootstrap_in(tmp_path)) as a:
        status, created = a.post(CREATE, ALICE, create_body("before"))
        assert status == 202, created
        rid = created["reservation"]["id"]
        locker = threading.Thread(target=lambda: subprocess.run(
            [str(pg_cluster.bin / "psql"), "-h", str(pg_cluster.socket_dir), "-p", str(pg_cluster.port), "-U",
             pg_cluster.user, "-d", name, "-Atc",
             "BEGIN; LOCK TABLE reservations IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(4); COMMIT;"],
            capture_output=True, timeout=30, user=pg_cluster.user))
        locker.start()
        try:
            wait_for(lambda: pg_cluster.psql("SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND "
                                             "mode = 'AccessExclusiveLock' AND granted", name) != "0", timeout=10)
            took = []
            for _ in range(4):
                (status, doc), t = timed(lambda: a.post(GET, ALICE, {"reservationId": rid}, timeout=40))
                assert unavailable(status, doc) and "locked whole" in doc["error"]["message"], doc
                took.append(t)
                (_, t) = timed(lambda: urllib.request.urlopen(a.url + "/healthz", timeout=5).read())
                took.append(t)
            assert max(took) < 1.0, took  # (the lock wait is 0.1 s; the read bound 5 s)
        finally:
            locker.join()
        status, doc = wait_for(lambda: (got := a.post(GET, ALICE, {"reservationId": rid}, timeout=40))[0] == 200
                               and got, timeout=20, interval=0.2)
        assert "before" == doc["reservation"]["idempotencyKey"]
    tracebacks = [line for line in a.lines if "Traceback" in line]
    assert not tracebacks, tracebacks
