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
        self._last: tuple[str, str] = ("", token_hash(""))  # (token, its hash): the last one resolved

    def holders(self, kind: str) -> set[str]:
        """The subjects some token of this kind speaks for (the nodes an agent registered, for "node")."""
        return {subject for k, subject in self.rows.values() if k == kind}

    def resolve(self, token: str) -> tuple[str, str] | None:
        # A request's token is resolved twice (known first, then judged): hashed once
        if token != self._last[0]:
            self._last = (token, token_hash(token))
        return self.rows.get(self._last[1])
