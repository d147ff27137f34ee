"""The error codes of the API, once: each code with its HTTP status and whose move a refusal is.

The control plane raises these codes (controlplane/domain/errors.py) and
answers with these statuses (controlplane/api/errors.py); the client turns
each into its exception class and the CLI into its exit code by `actor`:
`customer` (the request itself; fix it), `provider` (no capacity for the
shape now; re-quote), `platform` (Berth's own standing; retry later with the
same key). Codes are UPPER_SNAKE as in the seeds.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ErrorCode:
    code: str
    status: int
    actor: str  # customer | provider | platform
    meaning: str


TABLE: tuple[ErrorCode, ...] = (
    ErrorCode("INVALID_INPUT", 400, "customer", "a field breaks a rule; details.field and details.rule name it"),
    ErrorCode("UNAUTHENTICATED", 401, "customer", "no token, or a token this control plane does not know"),
    ErrorCode("SPEND_LIMIT_REACHED", 402, "customer", "the pool or offer checks budgets and the budget is spent"),
    ErrorCode("INSUFFICIENT_FUNDS", 402, "customer", "what is left of the budget cannot cover the new exposure"),
    ErrorCode("ACCESS_DENIED", 403, "customer", "IAM refused the action"),
    ErrorCode("CONFIRMATION_REQUIRED", 403, "customer", "the delegating user must approve first"),
    ErrorCode("COMPUTE_ACCESS_REQUIRED", 403, "customer", "the token lacks Compute Manage access (a read token)"),
    ErrorCode("NOT_FOUND", 404, "customer", "no such thing in this tenant"),
    ErrorCode("CONFLICT", 409, "customer", "the idempotency key names another request, or another change is in flight"),
    ErrorCode("INVALID_STATE", 409, "customer", "the reservation's state does not allow this"),
    ErrorCode("NO_CAPACITY", 409, "provider", "the request cannot be placed; details.reason says why"),
    ErrorCode("PRICE_CHANGED", 409, "customer", "the price or a priced field differs from the quote"),
    ErrorCode("QUOTE_EXPIRED", 410, "customer", "the quote is expired, unknown or not the tenant's"),
    ErrorCode("UNSUPPORTED", 422, "customer", "a binding kind this release does not serve"),
    ErrorCode("QUOTA_EXCEEDED", 429, "customer", "the charge does not fit the tenant's limits"),
    ErrorCode("PROVIDER_UNAVAILABLE", 503, "platform", "Berth cannot serve this now; retry later with the same key"),
)

BY_CODE: dict[str, ErrorCode] = {e.code: e for e in TABLE}
CODES: tuple[str, ...] = tuple(e.code for e in TABLE)
STATUS: dict[str, int] = {e.code: e.status for e in TABLE}
