"""A real failover under two running replicas: a primary and its hot standby (streaming asynchronously, as
Patroni's replicas do by default), the replicas pointed at both with libpq's multi-host form and
`target_session_attrs=read-write` (docs/scale-out.md). The standby falls behind, the primary acknowledges two more
creates and dies, and the standby is promoted: it lacks those two, and its own next commits reuse their
generations. Meanwhile every request answers 503 PROVIDER_UNAVAILABLE (never a 500); afterwards both replicas work
on the new primary, and neither keeps the lost history in its memory (each rebuilds it whole on a connection to
another server run, rather than reading only what changed after a generation the new primary gave to other
commits). With a synchronous standby instead, nothing acknowledged is lost, even with the primary killed mid-burst."""
from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import dbrows
from tests.controlplane.conftest import TOKENS, bootstrap_doc, h100_node
from tests.controlplane.test_pg_outage import unavailable
from tests.controlplane.test_replicas import check_database, create_body, leads, used_gpus
from tests.pgcluster import cluster_or_skip, hot_standby, promote
from tests.serverproc import ServerProcess
from tests.waiting import wait_for

ALICE = TOKENS["alice"]
CREATE = "/api/compute/reservations/create"


@pytest.fixture
def primary():
    """A cluster of this test's own: it dies, which the session's shared one must not."""
    yield from cluster_or_skip()


def created(replica: ServerProcess, key: str, timeout: float = 30) -> str:
    """The reservation a create with `key` made, retried while the database is away (503 PROVIDER_UNAVAILABLE)."""
    def attempt():
        status, doc = replica.post(CREATE, ALICE, create_body(key), timeout=40)
        assert status == 202 or unavailable(status, doc), (status, doc)
        return doc["reservation"]["id"] if status == 202 else None
    return wait_for(attempt, timeout=timeout, interval=0.2)


def test_a_failover_that_loses_the_last_commits_leaves_no_replica_on_the_lost_history(primary, tmp_path):
    name = f"berth_{uuid.uuid4().hex[:12]}"
    primary.createdb(name)
    standby = hot_standby(primary)
    both = f"postgresql://{primary.user}@/{name}?host={primary.socket_dir},{standby.socket_dir}" \
           "&target_session_attrs=read-write"
    doc = bootstrap_doc()
    doc["nodes"].append(h100_node("x0"))
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(doc))
    with ServerProcess(both, boot) as a, ServerProcess(both, boot) as b:
        kept = {created(a, "kept"): "kept"}
        wait_for(lambda: standby.psql("SELECT count(*) FROM reservations", name) == "1", timeout=10)
        leader = wait_for(lambda: a if leads(a) else b if leads(b) else None)
        quiet = b if leader is a else a  # asked nothing while the database is away: no failure tells it of that

        standby.stop()  # it falls behind: what the primary acknowledges now, only the primary has
        lost = {created(a, "lost-on-a"), created(b, "lost-on-b"), created(b, "lost-on-b-too")}
        assert wait_for(lambda: used_gpus(a) == used_gpus(b) == 4, timeout=10)

        primary.stop()
        status, answer = leader.post(CREATE, ALICE, create_body("during"), timeout=40)
        assert unavailable(status, answer), (status, answer)
        standby.start()
        promote(standby)  # the new primary: without the three lost creates
        new = standby.dsn(name)
        assert {r[0] for r in dbrows.rows(new, "SELECT id FROM reservations")} == set(kept)

        # Both replicas carry on there; their new commits take the generations the lost ones had.
        kept[created(leader, "during", timeout=40)] = "during"
        kept[created(leader, "after")] = "after"
        # Their memory is the new primary's: the lost creates hold no quota, the new ones do, on both replicas.
        assert wait_for(lambda: used_gpus(a) == used_gpus(b) == len(kept), timeout=10), (used_gpus(a), used_gpus(b))
        kept[created(quiet, "on-the-quiet-one")] = "on-the-quiet-one"
        assert wait_for(lambda: used_gpus(a) == used_gpus(b) == len(kept), timeout=10), (used_gpus(a), used_gpus(b))
        for rid in lost:  # read from the database: gone, as PostgreSQL's asynchronous replication allows
            status, got = a.post("/api/compute/reservations/get", ALICE, {"reservationId": rid})
            assert (status, got["error"]["code"]) == (404, "NOT_FOUND"), got
        # The client that retries a lost create with its key gets it booked again, once.
        again = created(quiet, "lost-on-a")
        assert again not in kept and created(leader, "lost-on-a") == again  # (a replay on the other)
        kept[again] = "lost-on-a"
        assert wait_for(lambda: used_gpus(a) == used_gpus(b) == len(kept), timeout=10)
        assert wait_for(lambda: [leads(a), leads(b)].count(True) == 1, timeout=30)

    check_database(new, {rid: rid for rid in kept})
    assert {r[0] for r in dbrows.rows(new, "SELECT id FROM reservations")} == set(kept)
    tracebacks = [line for line in a.lines + b.lines if "Traceback" in line]
    assert not tracebacks, tracebacks


def test_a_failover_to_a_synchronous_standby_loses_no_acknowledged_create(primary, tmp_path):
    """With a synchronous standby (synchronous_standby_names, Patroni's synchronous_mode), a commit is answered only
    once the standby has it. Here the standby also stops applying what it receives, so the creates sent next hang
    in their commits: written on both servers, answered to nobody. The primary dies, the standby is promoted: every
    create either replica acknowledged is there, and so are the unanswered ones that had reached the standby;
    retried with their keys, each answers its one reservation, and nothing is booked twice."""
    name = f"berth_{uuid.uuid4().hex[:12]}"
    primary.createdb(name)
    standby = hot_standby(primary)
    # remote_apply: a commit waits until the standby has applied it (so a paused replay holds it, received)
    primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'")
    primary.psql("ALTER SYSTEM SET synchronous_commit = 'remote_apply'")
    primary.psql("SELECT pg_reload_conf()")
    wait_for(lambda: primary.psql("SELECT sync_state FROM pg_stat_replication") == "sync", timeout=10)
    both = f"postgresql://{primary.user}@/{name}?host={primary.socket_dir},{standby.socket_dir}" \
           "&target_session_attrs=read-write"
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    keys = [f"k{i}" for i in range(12)]
    acked: dict[str, str] = {}
    with ServerProcess(both, boot) as a, ServerProcess(both, boot) as b:
        for i, key in enumerate(keys[:4]):
            acked[key] = created((a, b)[i % 2], key)

        standby.psql("SELECT pg_wal_replay_pause()")

        def send(i: int, key: str) -> None:
            status, doc = (a, b)[i % 2].post(CREATE, ALICE, create_body(key), timeout=40)
            if status == 202:
                acked[key] = doc["reservation"]["id"]
            else:
                assert unavailable(status, doc), (status, doc)

        with ThreadPoolExecutor(8) as pool:
            sent = [pool.submit(send, i, key) for i, key in enumerate(keys[4:], 4)]
            # the creates' commits wait for the standby: written there, not yet answered
            wait_for(lambda: int(primary.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
                                              name)) >= 1, timeout=20)
            flushed = primary.psql("SELECT pg_current_wal_flush_lsn()")
            wait_for(lambda: standby.psql(f"SELECT pg_last_wal_receive_lsn() >= '{flushed}'::pg_lsn") == "t")
            primary.stop()
            standby.psql("SELECT pg_wal_replay_resume()")
            promote(standby)
            for future in sent:
                future.result()
        new = standby.dsn(name)
        stored = {r[0] for r in dbrows.rows(new, "SELECT id FROM reservations")}
        assert set(acked.values()) <= stored  # nothing acknowledged was lost
        assert len(stored) > len(acked)  # and some creates committed whose answers were lost

        for i, key in enumerate(keys):  # each key again, on the other replica: its one reservation
            rid = created((b, a)[i % 2], key, timeout=40)
            assert acked.setdefault(key, rid) == rid, key
        assert set(acked.values()) >= stored and len(set(acked.values())) == len(keys)
        assert wait_for(lambda: used_gpus(a) == used_gpus(b) == len(keys), timeout=10), (used_gpus(a), used_gpus(b))
        assert wait_for(lambda: [leads(a), leads(b)].count(True) == 1, timeout=30)

    check_database(new, acked)
    assert {r[0] for r in dbrows.rows(new, "SELECT id FROM reservations")} == set(acked.values())
    tracebacks = [line for line in a.lines + b.lines if "Traceback" in line]
    assert not tracebacks, tracebacks
