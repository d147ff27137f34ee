"""A real failover under two running replicas: a primary and its hot standby (streaming asynchronously, as
Patroni's replicas do by default), the replicas pointed at both with libpq's multi-host form and
`target_session_attrs=read-write` (docs/scale-out.md). The standby falls behind, the primary acknowledges two more
creates and dies, and the standby is promoted: it lacks those two, and its own next commits reuse their
generations. Meanwhile every request answers 503 PROVIDER_UNAVAILABLE (never a 500); afterwards both replicas work
on the new primary, and neither keeps the lost history in its memory (each rebuilds it whole on a connection to
another server run, rather than reading only what changed after a generation the new primary gave to other
commits)."""
from __future__ import annotations

import json
import uuid

import pytest

from tests import dbrows
from tests.controlplane.conftest import TOKENS, bootstrap_doc, h100_node
from tests.controlplane.test_pg_outage import unavailable
from tests.controlplane.test_replicas import check_database, create_body, leads, used_gpus, wait_for
from tests.pgcluster import cluster_or_skip, hot_standby, promote
from tests.serverproc import ServerProcess

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
    return wait_for(attempt, timeout=timeout, every=0.2)


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
