"""Identifiers: a reservation's id derives from tenant, principal and idempotency key; operations from their reservation."""
from __future__ import annotations

import hashlib


def _digest(*parts: str) -> str:
    """26 hex digits (104 bits) of a keyed BLAKE2b over the parts: collision-free in practice."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=13, person=b"berth-ids").hexdigest()


def reservation_id(tenant_id: str, principal_id: str, idempotency_key: str) -> str:
    return "rsv_" + _digest("reservation", tenant_id, principal_id, idempotency_key)


def operation_id(reservation_id: str, kind: str, serial: int = 0) -> str:
    return "op_" + _digest("operation", reservation_id, kind, str(serial))


def fingerprint(canonical: bytes) -> str:
    return hashlib.sha256(canonical).hexdigest()


def token_hash(token: str) -> str:
    """Tokens are stored only as this hash."""
    return hashlib.sha256(b"berth-token\0" + token.encode()).hexdigest()
