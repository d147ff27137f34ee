"""Identifiers: a reservation's id derives from tenant, principal and idempotency key; operations from their reservation."""
from __future__ import annotations

import functools
import hashlib


def _digest(*parts: str) -> str:
    """26 hex digits (104 bits) of a keyed BLAKE2b over the parts: collision-free in practice."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=13, person=b"berth-ids").hexdigest()


@functools.lru_cache(maxsize=4096)  # a create asks for its id three times (its read, the replay check, the draft)
def reservation_id(tenant_id: str, principal_id: str, idempotency_key: str) -> str:
    return "rsv_" + _digest("reservation", tenant_id, principal_id, idempotency_key)


def operation_id(reservation_id: str, serial: int) -> str:
    """The id of a reservation's serial-th operation (0 is its create): readable back into both."""
    return f"op_{reservation_id.removeprefix('rsv_')}_{serial}"


def operation_parts(op_id: str) -> tuple[str, int] | None:
    """(reservation id, serial) of an operation id; None when it is not one."""
    body = op_id.removeprefix("op_")
    digest, sep, serial = body.rpartition("_")
    if body == op_id or not sep or not digest or not serial.isdigit() or len(serial) > 6:
        return None
    return "rsv_" + digest, int(serial)


def fingerprint(canonical: bytes) -> str:
    return hashlib.sha256(canonical).hexdigest()


def token_hash(token: str) -> str:
    """Tokens are stored only as this hash."""
    return hashlib.sha256(b"berth-token\0" + token.encode()).hexdigest()
