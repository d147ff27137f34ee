"""The token table: each bearer token names a tenant's principal, the admin, a pool's node bootstrap or a node.

Tokens are stored only as hashes (domain/ids.token_hash); the table is kept in
memory beside the store's rows, replaced whole when a bootstrap or a register
changes it.
"""
from __future__ import annotations

from controlplane.domain.ids import token_hash


class Tokens:
    """token hash -> (kind, subject), kept in memory; the store holds the same rows."""

    def __init__(self, rows: dict[str, tuple[str, str]] | None = None):
        self.rows = dict(rows or {})

    def resolve(self, token: str) -> tuple[str, str] | None:
        return self.rows.get(token_hash(token))
