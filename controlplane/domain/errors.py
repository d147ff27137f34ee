"""The domain's refusals: one exception type carrying a code from the seeds and structured details.

The codes, with their HTTP statuses and actors, are defined once in
common/errors.py; nothing here knows about HTTP.
"""
from __future__ import annotations

from typing import Any

from common.errors import CODES

INVALID_INPUT = "INVALID_INPUT"
UNAUTHENTICATED = "UNAUTHENTICATED"
NOT_FOUND = "NOT_FOUND"
CONFLICT = "CONFLICT"
INVALID_STATE = "INVALID_STATE"
ACCESS_DENIED = "ACCESS_DENIED"
CONFIRMATION_REQUIRED = "CONFIRMATION_REQUIRED"
QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
SPEND_LIMIT_REACHED = "SPEND_LIMIT_REACHED"
UNSUPPORTED = "UNSUPPORTED"
NO_CAPACITY = "NO_CAPACITY"
PRICE_CHANGED = "PRICE_CHANGED"
QUOTE_EXPIRED = "QUOTE_EXPIRED"
INSUFFICIENT_FUNDS = "INSUFFICIENT_FUNDS"
PROVIDER_UNAVAILABLE = "PROVIDER_UNAVAILABLE"
COMPUTE_ACCESS_REQUIRED = "COMPUTE_ACCESS_REQUIRED"
assert set(CODES) == {v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str)}, "see common/errors.py"


class DomainError(Exception):
    """A refusal with a documented code; `details` is part of the wire answer."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None):
        assert code in CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}

    def __repr__(self) -> str:
        return f"DomainError({self.code}, {self.message!r}, {self.details!r})"


def invalid(field: str, rule: str, **details: Any) -> DomainError:
    """INVALID_INPUT naming the field and the rule it breaks."""
    return DomainError(INVALID_INPUT, f"{field}: {rule}", {"field": field, "rule": rule, **details})


def not_found(what: str, ident: str, field: str | None = None) -> DomainError:
    details: dict[str, Any] = {"id": ident}
    if field:
        details["field"] = field
    return DomainError(NOT_FOUND, f"{what} {ident!r} does not exist here", details)
