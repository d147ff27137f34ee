"""Rows of one SQL statement on a control plane's database, whichever its engine, for tests that check what is
stored (`?` placeholders; the statement must read the same on SQLite and PostgreSQL)."""
from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import asyncpg

from controlplane.store.reads import numbered


def rows(db: str | Path, sql: str, *args) -> list[tuple]:
    """db: a `postgresql://` URL, a `sqlite:///PATH` URL, or a SQLite file's path."""
    url = str(db)
    if url.startswith("postgresql://"):
        async def fetch() -> list[tuple]:
            conn = await asyncpg.connect(url)
            try:
                return [tuple(r) for r in await conn.fetch(numbered(sql), *args)]
            finally:
                await conn.close()
        return asyncio.run(fetch())
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        return [tuple(r) for r in conn.execute(sql, args).fetchall()]
    finally:
        conn.close()


def store_rows(store, sql: str, *args) -> list[tuple]:
    """The same through an open store (inside a running event loop too): its own connection or pool."""
    if hasattr(store, "read"):  # PostgreSQL
        return [tuple(r) for r in store.read(lambda c: c.fetch(numbered(sql), *args))]
    return [tuple(r) for r in store.conn.execute(sql, args).fetchall()]


def units_of(value) -> list[str]:
    """A booking's units as either engine stores them (a comma-joined text, an array)."""
    return list(value) if isinstance(value, list) else value.split(",") if value else []
