"""A rolling upgrade of the replicas on one PostgreSQL database, with the previous schema's release run for real
(its source tree checked out from this repository's history): a replica of this release starts beside it and
migrates the schema while it serves; both serve creates for the last free GPUs together, and the database holds
each once and none overlapping; each replica sees the other's; the previous release, once stopped, refuses to
start against the newer schema and says what to run. docs/scale-out.md, "Upgrading the replicas".
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from controlplane.store import pg_schema
from tests import dbrows, worktree
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.pgcluster import pg_cluster  # noqa: F401 (fixture)
from tests.serverproc import ServerProcess

GPUS = 16  # pool h100: nodes h1 and h2, 8 GPUs each
HOUR = 3_600_000


def previous_schema_release() -> str | None:
    """The last commit whose schema was the one before LATEST (the parent of the commit that added LATEST's
    migration), or None where this tree has no git history to take it from."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(worktree.ROOT), *args], capture_output=True, text=True,
                              check=True).stdout

    try:
        added = git("log", "--format=%H", "-S", f'    ({pg_schema.LATEST}, "', "--",
                    "controlplane/store/pg_schema.py").split()
        return git("rev-parse", "--verify", "--quiet", f"{added[-1]}^").strip() if added else None
    except (OSError, subprocess.CalledProcessError):
        return None


@pytest.fixture
def previous_tree():
    rev = previous_schema_release()
    if rev is None:
        pytest.skip("needs this repository's git history (the previous schema's release is checked out from it)")
    with contextlib.ExitStack() as stack:
        yield worktree.checkout(rev, stack)


@pytest.fixture
def database(pg_cluster):  # noqa: F811
    name = f"berth_{uuid.uuid4().hex[:12]}"
    url = pg_cluster.createdb(name)
    yield url
    pg_cluster.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def previous(db: str, boot: Path, tree: Path) -> ServerProcess:
    """`berth controlplane serve` from the previous release's tree (its packages first on the path)."""
    return ServerProcess(db, boot, env={"PYTHONPATH": str(tree)}, cwd=tree)


def create(server: ServerProcess, key: str, start: int) -> tuple[int, dict]:
    return server.post("/api/compute/reservations/create", TOKENS["alice"],
                       {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "start": start,
                        "end": start + HOUR, "idempotencyKey": key})


def test_a_replica_of_this_release_migrates_beside_the_previous_one_and_both_book_exactly(
        database, previous_tree, tmp_path):
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    start = (int(time.time() * 1000) // HOUR + 2) * HOUR
    versions = "SELECT MAX(version) FROM schema_version"
    with contextlib.ExitStack() as stack:
        old = stack.enter_context(previous(database, boot, previous_tree))
        assert [(pg_schema.LATEST - 1,)] == dbrows.rows(database, versions)
        status, first = create(old, "before-the-upgrade", start)
        assert status == 202 and first["reservation"]["state"] == "placed", first

        new = stack.enter_context(ServerProcess(database, boot))  # migrates while the old one serves
        assert [(pg_schema.LATEST,)] == dbrows.rows(database, versions)
        status, again = create(new, "before-the-upgrade", start)  # a retry after the upgrade replays
        assert (202, first["reservation"]["id"]) == (status, again.get("reservation", {}).get("id")), again

        # Both at once, for the GPUs left in the window: each create on either replica, by turns.
        servers = [old, new]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: create(servers[i % 2], f"during-{i}", start), range(GPUS + 8)))
        assert {status for status, _ in answers} == {202}, answers
        placed = [doc["reservation"]["id"] for _, doc in answers if doc["reservation"]["state"] == "placed"]
        assert len(placed) == GPUS - 1  # the window's GPUs, less the one booked before the upgrade
        assert [(0,)] == dbrows.rows(database, "SELECT count(*) FROM booked_units a JOIN booked_units b ON"
                                               " a.unit_id = b.unit_id AND a.ctid < b.ctid AND a.during && b.during")
        assert [] == dbrows.rows(database, "SELECT id FROM reservations GROUP BY id HAVING count(*) > 1")
        assert sorted(placed + [first["reservation"]["id"]]) == sorted(
            r[0] for r in dbrows.rows(database, "SELECT id FROM reservations WHERE state = 'placed'"))
        # Each replica answers the other's reservations (the first from before the upgrade, on the new one).
        for i, (_, doc) in enumerate(answers[:4]):
            rid = doc["reservation"]["id"]
            status, got = servers[(i + 1) % 2].post("/api/compute/reservations/get", TOKENS["alice"],
                                                    {"reservationId": rid})
            assert (status, got["reservation"]["state"]) == (200, doc["reservation"]["state"]), got
        status, got = new.post("/api/compute/reservations/get", TOKENS["alice"],
                               {"reservationId": first["reservation"]["id"]})
        assert (status, got["reservation"]["state"]) == (200, "placed"), got

        old.stop()
    refused = subprocess.run(
        [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0", "--db", database,
         "--bootstrap", str(boot)], cwd=previous_tree, env={**os.environ, "PYTHONPATH": str(previous_tree)},
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"schema is version {pg_schema.LATEST}, and this Berth knows versions up to {pg_schema.LATEST - 1}" \
        in refused.stderr, refused.stderr[-2000:]
    assert [(pg_schema.LATEST,)] == dbrows.rows(database, versions)  # and changed nothing
