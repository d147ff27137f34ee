"""Bearer tokens: each names a tenant's principal (or the admin, or a pool's node bootstrap); stored hashed."""
from __future__ import annotations

from aiohttp import web

from controlplane.domain.errors import UNAUTHENTICATED, DomainError
from controlplane.domain.ids import token_hash
from controlplane.domain.model import Principal


class Tokens:
    """token hash -> (kind, subject), kept in memory; the store holds the same rows."""

    def __init__(self, rows: dict[str, tuple[str, str]] | None = None):
        self.rows = dict(rows or {})

    def resolve(self, token: str) -> tuple[str, str] | None:
        return self.rows.get(token_hash(token))


def bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise DomainError(UNAUTHENTICATED, "Authorization: send 'Bearer <token>'", {"field": "Authorization"})
    return token.strip()


def principal_of(request: web.Request, tokens: Tokens, principals) -> Principal:
    found = tokens.resolve(bearer(request))
    if found is None or found[0] != "principal":
        raise DomainError(UNAUTHENTICATED, "Authorization: unknown token", {"field": "Authorization"})
    principal = principals.get(found[1])
    if principal is None:
        raise DomainError(UNAUTHENTICATED, "Authorization: the token's principal no longer exists", {"field": "Authorization"})
    return principal
