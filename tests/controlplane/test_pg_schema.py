"""The PostgreSQL store's schema on a real throwaway cluster: migrations applied once under the advisory lock even
when two replicas start together, a newer schema refused untouched, and the database itself refusing two bookings
of one device in overlapping windows (the exclusion constraint), whatever the replicas' memory says; catalog rows
stamped with the generation that wrote them."""
from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from controlplane.store import pg_schema
from tests.pgcluster import pg_cluster  # noqa: F401 (fixture)


@pytest.fixture
def database(pg_cluster):  # noqa: F811
    name = f"berth_{uuid.uuid4().hex[:10]}"
    pg_cluster.createdb(name)
    yield pg_cluster, name
    pg_cluster.psql(f'DROP DATABASE "{name}" WITH (FORCE)')


async def connect(cluster, name: str) -> asyncpg.Connection:
    return await asyncpg.connect(host=str(cluster.socket_dir), user=cluster.user, database=name)


async def test_two_replicas_starting_together_apply_each_migration_once(database):
    cluster, name = database
    a, b = await connect(cluster, name), await connect(cluster, name)
    try:
        assert [pg_schema.LATEST] * 2 == await asyncio.gather(pg_schema.migrate(a), pg_schema.migrate(b))
        rows = await a.fetch("SELECT version FROM schema_version ORDER BY version")
        assert [m[0] for m in pg_schema.MIGRATIONS] == [r["version"] for r in rows]
        assert pg_schema.LATEST == await pg_schema.migrate(a)  # again: nothing to do
    finally:
        await a.close()
        await b.close()


async def test_a_schema_newer_than_this_berth_is_refused_and_left_alone(database):
    cluster, name = database
    conn = await connect(cluster, name)
    try:
        await pg_schema.migrate(conn)
        await conn.execute("INSERT INTO schema_version (version, what) VALUES ($1, 'from the future')",
                           pg_schema.LATEST + 1)
        with pytest.raises(pg_schema.SchemaTooNew, match=f"version {pg_schema.LATEST + 1}.*nothing was changed"):
            await pg_schema.migrate(conn)
        assert pg_schema.LATEST + 1 == await conn.fetchval("SELECT MAX(version) FROM schema_version")
        assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", pg_schema.MIGRATION_LOCK)  # released
    finally:
        await conn.close()


async def book(conn, rid: str, node: str, units: list[str], start: int, end: int) -> None:
    async with conn.transaction():
        bid = await conn.fetchval(
            "INSERT INTO bookings (reservation_id, pool_id, node_id, start_ms, end_ms, vcpu_milli, memory_mib, "
            "hugepages_1g) VALUES ($1, 'p', $2, $3, $4, 0, 0, 0) RETURNING id", rid, node, start, end)
        await conn.executemany("INSERT INTO booked_units (booking_id, node_id, unit, during) "
                               "VALUES ($1, $2, $3, int8range($4, $5))",
                               [(bid, node, u, start, end) for u in units])


async def test_the_database_refuses_two_bookings_of_one_device_in_overlapping_windows(database):
    cluster, name = database
    a, b = await connect(cluster, name), await connect(cluster, name)
    try:
        await pg_schema.migrate(a)
        await book(a, "r1", "n1", ["gpu0", "gpu1"], 0, 100)
        await book(a, "r2", "n1", ["gpu0"], 100, 200)  # back to back: [0, 100) and [100, 200) do not overlap
        await book(a, "r3", "n2", ["gpu0"], 0, 100)  # another node's gpu0
        with pytest.raises(asyncpg.ExclusionViolationError):
            await book(b, "r4", "n1", ["gpu2", "gpu1"], 50, 150)  # gpu1 overlaps r1: the whole booking is refused
        assert 0 == await a.fetchval("SELECT count(*) FROM bookings WHERE reservation_id = 'r4'")
        await a.execute("UPDATE booked_units SET during = int8range(lower(during), lower(during)) WHERE booking_id IN "
                        "(SELECT id FROM bookings WHERE reservation_id = 'r1')")  # cut to nothing, kept for history
        await book(b, "r4", "n1", ["gpu2", "gpu1"], 50, 150)
    finally:
        await a.close()
        await b.close()


async def test_racing_replicas_cannot_both_book_the_last_device(database):
    cluster, name = database
    conns = [await connect(cluster, name) for _ in range(8)]
    try:
        await pg_schema.migrate(conns[0])
        results = await asyncio.gather(*(book(c, f"race{i}", "n1", ["gpu7"], 1000, 2000)
                                         for i, c in enumerate(conns)), return_exceptions=True)
        won = [r for r in results if r is None]
        # A loser is refused by the constraint, or (waiting on each other's check) picked as a deadlock's victim:
        # both are a lost race, which the store retries by placing the request again.
        lost = [r for r in results if isinstance(r, (asyncpg.ExclusionViolationError, asyncpg.DeadlockDetectedError))]
        assert (1, 7) == (len(won), len(lost)), results
        assert 1 == await conns[0].fetchval("SELECT count(*) FROM booked_units WHERE unit = 'gpu7'")
    finally:
        for c in conns:
            await c.close()


async def test_schema_3_keys_the_devices_already_booked_and_still_refuses_their_overlaps(database):
    """(Schema 4 keeps that: the trigger keys a device inserted without a key, as a replica of schema 2 does.)"""
    cluster, name = database
    conn = await connect(cluster, name)
    try:
        await conn.execute("CREATE TABLE schema_version (version INT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL "
                           "DEFAULT now(), what TEXT NOT NULL)")
        for version, what, sql in pg_schema.MIGRATIONS[:2]:  # a database a schema-2 Berth left, with bookings
            await conn.execute(sql)
            await conn.execute("INSERT INTO schema_version (version, what) VALUES ($1, $2)", version, what)
        await book(conn, "old1", "n1", ["gpu0", "gpu1"], 0, 100)
        await book(conn, "old2", "n2", ["gpu0"], 0, 100)
        assert pg_schema.LATEST == await pg_schema.migrate(conn)
        keys = await conn.fetch("SELECT node_id, unit, id FROM unit_keys ORDER BY id")
        assert [("n1", "gpu0"), ("n1", "gpu1"), ("n2", "gpu0")] == [(r[0], r[1]) for r in keys]
        assert 0 == await conn.fetchval("SELECT count(*) FROM booked_units b JOIN unit_keys k ON k.id = b.unit_id"
                                        " WHERE (k.node_id, k.unit) <> (b.node_id, b.unit)")
        with pytest.raises(asyncpg.ExclusionViolationError):
            await book(conn, "new1", "n1", ["gpu1"], 50, 150)  # overlaps old1's gpu1, booked before the migration
        await book(conn, "new2", "n1", ["gpu2", "gpu0"], 100, 200)  # gpu2 is learnt, gpu0 keeps its key
        assert [("n1", "gpu0"), ("n1", "gpu2")] == [tuple(r) for r in await conn.fetch(
            "SELECT k.node_id, k.unit FROM booked_units b JOIN bookings g ON g.id = b.booking_id JOIN unit_keys k"
            " ON k.id = b.unit_id WHERE g.reservation_id = 'new2' ORDER BY k.id")]
        assert 4 == await conn.fetchval("SELECT count(*) FROM unit_keys")
    finally:
        await conn.close()


async def test_a_catalog_row_carries_the_generation_its_group_commits_whoever_writes_it(database):
    """Schema 5: a write of the catalog (as a replica of schema 4 makes it, naming no generation) is stamped with
    the generation the group writing it commits, so other replicas read it among the rows changed since theirs;
    the rows already there keep 0 (a replica's memory holds them)."""
    cluster, name = database
    conn = await connect(cluster, name)
    try:
        await conn.execute("CREATE TABLE schema_version (version INT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL "
                           "DEFAULT now(), what TEXT NOT NULL)")
        for version, what, sql in pg_schema.MIGRATIONS[:4]:  # a database a schema-4 Berth left, with a catalog
            await conn.execute(sql)
            await conn.execute("INSERT INTO schema_version (version, what) VALUES ($1, $2)", version, what)
        await conn.execute("INSERT INTO catalog (kind, id, doc) VALUES ('node', 'old', ''), ('node', 'kept', '')")
        await conn.execute("UPDATE replica_state SET generation = 41")
        assert pg_schema.LATEST == await pg_schema.migrate(conn)
        async with conn.transaction():  # a group: its writes, then the generation moved (COMMIT_GROUP)
            await conn.execute("INSERT INTO catalog (kind, id, doc) VALUES ('node', 'new', ''), ('tenant', 't', '')")
            await conn.execute("UPDATE catalog SET doc = 'x' WHERE kind = 'node' AND id = 'old'")
            await conn.execute("UPDATE replica_state SET generation = generation + 1")
        async with conn.transaction():
            await conn.execute("INSERT INTO catalog (kind, id, doc) VALUES ('node', 'newer', '')"
                               " ON CONFLICT (kind, id) DO UPDATE SET doc = excluded.doc")
            await conn.execute("UPDATE replica_state SET generation = generation + 1")
        assert [("node", "kept", 0), ("node", "new", 42), ("node", "newer", 43), ("node", "old", 42),
                ("tenant", "t", 42)] == [
            tuple(r) for r in await conn.fetch("SELECT kind, id, gen FROM catalog ORDER BY kind, id")]
        assert 0 == await conn.fetchval("SELECT rebuild_generation FROM replica_state")
    finally:
        await conn.close()


async def test_schema_6_drops_the_index_of_bookings_by_node_and_keeps_the_bookings(database):
    """No statement reads bookings by node, so schema 6 drops the index every booking wrote; the bookings a
    schema-5 Berth left stay, with their devices' exclusion."""
    cluster, name = database
    conn = await connect(cluster, name)
    try:
        await conn.execute("CREATE TABLE schema_version (version INT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL "
                           "DEFAULT now(), what TEXT NOT NULL)")
        for version, what, sql in pg_schema.MIGRATIONS[:5]:
            await conn.execute(sql)
            await conn.execute("INSERT INTO schema_version (version, what) VALUES ($1, $2)", version, what)
        await book(conn, "old1", "n1", ["gpu0"], 0, 100)
        indexes = "SELECT indexname FROM pg_indexes WHERE tablename = 'bookings' ORDER BY indexname"
        assert "bookings_by_node" in [r[0] for r in await conn.fetch(indexes)]
        assert pg_schema.LATEST == await pg_schema.migrate(conn)
        assert ["bookings_by_reservation", "bookings_pkey"] == [r[0] for r in await conn.fetch(indexes)]
        assert ["old1"] == [r[0] for r in await conn.fetch("SELECT reservation_id FROM bookings")]
        with pytest.raises(asyncpg.ExclusionViolationError):
            await book(conn, "new1", "n1", ["gpu0"], 50, 150)
    finally:
        await conn.close()


async def test_a_replica_starting_while_migrate_creates_the_schema_waits_for_its_commit(database):
    """`berth controlplane migrate` creates the schema inside its copy's transaction; the migrations' lock went at
    the end of the schema's step, so a replica starting during the copy took it, met the uncommitted tables and
    exited 2 (UniqueViolationError on pg_type) once the copy committed."""
    from controlplane.store import move

    cluster, name = database
    copy, replica = await connect(cluster, name), await connect(cluster, name)
    try:
        async with copy.transaction():
            await move.migrate_target(copy, name)
            starting = asyncio.ensure_future(pg_schema.migrate(replica))
            await asyncio.sleep(0.5)  # the rest of the copy
            assert not starting.done()  # it waits for the copy
        assert pg_schema.LATEST == await asyncio.wait_for(starting, 10)
    finally:
        await copy.close()
        await replica.close()
