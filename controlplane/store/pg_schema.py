"""The PostgreSQL store's schema, versioned: migrations applied at start under an advisory lock, a newer one refused.

The tables mirror the SQLite engine's (controlplane/store/sqlite.py), with
what several replicas on one database need from the database itself
(docs/scale-out.md):

- **No double booking.** Each device of a booking is a row of
  `booked_units`, under an exclusion constraint (btree_gist): the device's
  key `=`, the time range `&&`. The key is an integer from `unit_keys` (one
  per node and unit): GiST compares integers at about half the cost of the
  two texts that name the device (migration 3). The writer looks the key up
  in the statement that writes the row; a trigger keys a row that comes
  without one (a device booked for the first time, a writer of an older
  release). The rows have no foreign key to their booking (migration 4):
  they are written only by their booking's statement. Two replicas racing for one device in
  overlapping windows cannot both commit: the loser gets an exclusion
  violation, or a deadlock error when losers wait on each other's check
  (both a lost race, to retry). A booking cut to an empty window (`[t, t)`,
  kept for history) overlaps nothing.
- **Idempotency.** A reservation's id is derived from (tenant, principal,
  key) and is unique: the same key sent to two replicas yields one row.
- **Commit-order events.** `events.seq` is a sequence; readers page by it.
- **One writer at a time.** `replica_state.generation` grows with every
  committed group of writes (store/postgres.py), under an advisory lock;
  each reservation row carries the generation that last changed it (`gen`),
  so a replica catches up on what others changed without reading the rest.

`migrate(conn)` takes `pg_advisory_lock(MIGRATION_LOCK)`, so two replicas
starting together apply each migration once, in order, each in its own
transaction with its version row. A database whose schema is newer than
this code knows raises SchemaTooNew, and nothing is changed.
"""
from __future__ import annotations

from typing import Any

MIGRATION_LOCK = 0x62657274_0001  # "bert" and 1: the advisory lock key of schema migrations


class SchemaTooNew(Exception):
    """The database was migrated by a newer Berth; this one must not write to it."""


MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "the tables of the SQLite engine, with an exclusion constraint on booked devices", """
CREATE EXTENSION IF NOT EXISTS btree_gist;
CREATE TABLE catalog (kind TEXT NOT NULL, id TEXT NOT NULL, doc BYTEA NOT NULL, PRIMARY KEY (kind, id));
CREATE TABLE tokens (hash TEXT PRIMARY KEY, kind TEXT NOT NULL, subject TEXT NOT NULL);
CREATE TABLE reservations (
  seq BIGSERIAL PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,
  tenant_id TEXT NOT NULL,
  principal_id TEXT NOT NULL,
  pool_id TEXT NOT NULL,
  state TEXT NOT NULL,
  doc BYTEA NOT NULL
);
CREATE INDEX reservations_by_tenant ON reservations (tenant_id, seq);
CREATE INDEX reservations_by_principal ON reservations (tenant_id, principal_id, seq);
CREATE INDEX reservations_live ON reservations (state) WHERE state NOT IN ('released', 'cancelled');
CREATE TABLE bookings (
  id BIGSERIAL PRIMARY KEY,
  reservation_id TEXT NOT NULL,
  pool_id TEXT NOT NULL,
  node_id TEXT NOT NULL,
  start_ms BIGINT NOT NULL,
  end_ms BIGINT NOT NULL CHECK (end_ms >= start_ms),
  vcpu_milli BIGINT NOT NULL,
  memory_mib BIGINT NOT NULL,
  hugepages_1g BIGINT NOT NULL
);
CREATE INDEX bookings_by_reservation ON bookings (reservation_id);
CREATE INDEX bookings_by_node ON bookings (node_id, end_ms);
CREATE TABLE booked_units (
  booking_id BIGINT NOT NULL REFERENCES bookings (id) ON DELETE CASCADE,
  node_id TEXT NOT NULL,
  unit TEXT NOT NULL,
  during INT8RANGE NOT NULL,
  EXCLUDE USING gist (node_id WITH =, unit WITH =, during WITH &&)
);
CREATE INDEX booked_units_by_booking ON booked_units (booking_id);
CREATE TABLE operation_aliases (id TEXT PRIMARY KEY, reservation_id TEXT NOT NULL);
CREATE TABLE events (
  seq BIGSERIAL PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  reservation_id TEXT,
  type TEXT NOT NULL,
  at BIGINT NOT NULL,
  data BYTEA NOT NULL
);
CREATE INDEX events_by_tenant ON events (tenant_id, seq);
CREATE TABLE confirmations (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  reservation_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  user_id TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  doc BYTEA NOT NULL
);
CREATE INDEX confirmations_by_user ON confirmations (tenant_id, user_id, created_at);
CREATE INDEX confirmations_by_agent ON confirmations (tenant_id, agent_id, created_at);
CREATE TABLE billing (
  reservation_id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  pool_id TEXT NOT NULL,
  hourly_usd NUMERIC NOT NULL,
  start_ms BIGINT NOT NULL,
  end_ms BIGINT
);
CREATE INDEX billing_by_tenant ON billing (tenant_id, start_ms);
CREATE TABLE quotes (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, expires_at BIGINT NOT NULL, doc BYTEA NOT NULL);
"""),
    (2, "what replicas share: the write generation, agents' last heartbeats, a booking's units in order", """
CREATE TABLE replica_state (
  id INT PRIMARY KEY CHECK (id = 1),
  generation BIGINT NOT NULL,  -- grows with every committed group of writes
  catalog_generation BIGINT NOT NULL  -- the last group that changed the catalog or the tokens
);
INSERT INTO replica_state (id, generation, catalog_generation) VALUES (1, 0, 0);
ALTER TABLE reservations ADD COLUMN gen BIGINT NOT NULL DEFAULT 0;  -- the group that last changed it
CREATE INDEX reservations_by_gen ON reservations (gen);
CREATE TABLE node_seen (node_id TEXT PRIMARY KEY, seen_at BIGINT NOT NULL);
ALTER TABLE bookings ADD COLUMN units TEXT[] NOT NULL DEFAULT '{}';
"""),
    (3, "booked devices keyed by an integer under the exclusion constraint (about half the cost of two texts)", """
CREATE TABLE unit_keys (
  id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  node_id TEXT NOT NULL,
  unit TEXT NOT NULL,
  UNIQUE (node_id, unit)
);
-- A booked device's key, from the registry, which learns a device the first time it is booked (a new node, a
-- new MIG layout). Two transactions learning one device together get one key (ON CONFLICT ... RETURNING).
CREATE FUNCTION booked_unit_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  SELECT id INTO NEW.unit_id FROM unit_keys WHERE node_id = NEW.node_id AND unit = NEW.unit;
  IF NEW.unit_id IS NULL THEN
    INSERT INTO unit_keys (node_id, unit) VALUES (NEW.node_id, NEW.unit)
      ON CONFLICT (node_id, unit) DO UPDATE SET unit = EXCLUDED.unit RETURNING id INTO NEW.unit_id;
  END IF;
  RETURN NEW;
END $$;
INSERT INTO unit_keys (node_id, unit) SELECT DISTINCT node_id, unit FROM booked_units ORDER BY node_id, unit;
ALTER TABLE booked_units ADD COLUMN unit_id BIGINT;
UPDATE booked_units b SET unit_id = k.id FROM unit_keys k WHERE k.node_id = b.node_id AND k.unit = b.unit;
ALTER TABLE booked_units ALTER COLUMN unit_id SET NOT NULL;
ALTER TABLE booked_units DROP CONSTRAINT booked_units_node_id_unit_during_excl;
ALTER TABLE booked_units ADD CONSTRAINT booked_units_exclusive EXCLUDE USING gist (unit_id WITH =, during WITH &&);
CREATE TRIGGER booked_units_keyed BEFORE INSERT ON booked_units FOR EACH ROW EXECUTE FUNCTION booked_unit_key();
"""),
    (4, "a booked device's row without a foreign-key check, and its key looked up by the writer", """
-- The foreign key's check (a locking read of the booking, per device) cost more than the rest of the row: a
-- booked device is only ever written in the statement that writes its booking, from that booking's RETURNING,
-- and bookings are never deleted (only emptied with TRUNCATE, together with booked_units).
ALTER TABLE booked_units DROP CONSTRAINT booked_units_booking_id_fkey;
-- The writer looks the key up in the same statement; the trigger keys only what arrives without one (a device
-- booked for the first time, a replica of the previous release).
DROP TRIGGER booked_units_keyed ON booked_units;
CREATE TRIGGER booked_units_keyed BEFORE INSERT ON booked_units FOR EACH ROW WHEN (NEW.unit_id IS NULL)
  EXECUTE FUNCTION booked_unit_key();
"""),
    (5, "the group that last wrote each catalog row, so that replicas read only the rows changed", """
-- Another replica's change of the catalog (a node registered, cleaned, drained; a bootstrap applied) is read as
-- the rows written after the generation a replica's memory has, not by rebuilding the memory whole. The trigger
-- stamps every write, a replica of the previous release's too: each one holds the write lock, under which
-- replica_state.generation is the last committed group's, and the writing group commits the next.
-- What still calls for a whole rebuild (a migrate's copy, whose rows carry no generation) says so apart.
ALTER TABLE replica_state ADD COLUMN rebuild_generation BIGINT NOT NULL DEFAULT 0;
ALTER TABLE catalog ADD COLUMN gen BIGINT NOT NULL DEFAULT 0;
CREATE INDEX catalog_by_gen ON catalog (gen);
CREATE FUNCTION catalog_gen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  SELECT generation + 1 INTO NEW.gen FROM replica_state WHERE id = 1;
  RETURN NEW;
END $$;
CREATE TRIGGER catalog_stamped BEFORE INSERT OR UPDATE ON catalog FOR EACH ROW EXECUTE FUNCTION catalog_gen();
"""),
    (6, "no index of bookings by node: no statement reads bookings by node, and every booking wrote it", """
-- Bookings are read by reservation (bookings_by_reservation) or whole; the free devices of a node are the writer's
-- memory and the exclusion constraint on booked_units, never this index.
DROP INDEX IF EXISTS bookings_by_node;
"""),
)
LATEST = MIGRATIONS[-1][0]


async def migrate(conn: Any) -> int:
    """Bring the database to LATEST (an asyncpg connection); the version it is at afterwards."""
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INT PRIMARY KEY, applied_at "
                           "TIMESTAMPTZ NOT NULL DEFAULT now(), what TEXT NOT NULL)")
        current = await conn.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_version")
        if current > LATEST:
            raise SchemaTooNew(f"the database's schema is version {current}, and this Berth knows versions up to "
                               f"{LATEST}: run the Berth that migrated it (or a newer one); nothing was changed")
        for version, what, sql in MIGRATIONS:
            if version <= current:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_version (version, what) VALUES ($1, $2)", version, what)
            current = version
        return current
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
