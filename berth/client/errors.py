"""The client's errors: every refusal as a BerthError subclass per API code, keeping every structured detail.

`code` is the API's error code, `details` the envelope's details as sent,
`status` the HTTP status (None when no answer came). A subclass per code
(common/errors.py lists them) so callers can catch one; TransportError when
no answer came at all, BadAnswer when the answer is not the API's.
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, Mapping

import msgspec

from berth.client.answers import Alternative
from common import errors as error_table


class BerthError(Exception):
    code_name: str = ""  # the API code a subclass stands for
    """A refusal (or a failure to get an answer) with every structured detail the server sent.

    `code` is the API's error code, `details` the envelope's details as sent,
    `status` the HTTP status (None when no answer came). `idempotency_key` is
    the key a create was sent with, to retry the same intent.
    """

    def __init__(self, code: str, message: str, details: Mapping[str, Any] | None = None,
                 status: int | None = None, *, idempotency_key: str | None = None):
        super().__init__(code, message, dict(details or {}), status)
        self.code = code
        self.message = message
        self.details: dict[str, Any] = dict(details or {})
        self.status = status
        self.idempotency_key = idempotency_key

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r}, {self.details!r}, {self.status!r})"

    @property
    def reason(self) -> str | None:
        return self.details.get("reason")

    @property
    def alternatives(self) -> list[Alternative]:
        """Other pools that could hold the request, cheapest first (NO_CAPACITY)."""
        try:
            return msgspec.convert(self.details.get("alternatives") or [], list[Alternative])
        except msgspec.ValidationError:
            return []

    @property
    def cheapest_eligible_usd_per_hour(self) -> Decimal | None:
        return _decimal_or_none(self.details.get("cheapestEligibleUsdPerHour"))

    @property
    def confirmation_id(self) -> str | None:
        return self.details.get("confirmationId")

    @property
    def reservation_id(self) -> str | None:
        return self.details.get("reservationId")

    @property
    def actor(self) -> str | None:
        """Whose doing a PROVIDER_UNAVAILABLE is (`platform`)."""
        return self.details.get("actor")

    @property
    def reference(self) -> str | None:
        """What to quote to support (PROVIDER_UNAVAILABLE)."""
        return self.details.get("reference")

    @property
    def retry_after_seconds(self) -> float | None:
        value = self.details.get("retryAfterSeconds")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def field(self) -> str | None:
        """The offending field (INVALID_INPUT, and others where one is at fault)."""
        return self.details.get("field")

    @property
    def approver(self) -> str | None:
        """Who must approve (CONFIRMATION_REQUIRED)."""
        return self.details.get("approver")


class TransportError(BerthError):
    """No answer came after every attempt (refused, reset, timed out): the request may or may not have been applied."""


class BadAnswer(BerthError):
    """An answer that is not the API's JSON (a proxy's error page, a truncated body, another version's shape)."""


class InvalidInput(BerthError):
    code_name = "INVALID_INPUT"


class Unauthenticated(BerthError):
    code_name = "UNAUTHENTICATED"


class NotFound(BerthError):
    code_name = "NOT_FOUND"


class Conflict(BerthError):
    code_name = "CONFLICT"


class InvalidState(BerthError):
    code_name = "INVALID_STATE"


class AccessDenied(BerthError):
    code_name = "ACCESS_DENIED"


class ConfirmationRequired(BerthError):
    code_name = "CONFIRMATION_REQUIRED"


class SpendLimitReached(BerthError):
    code_name = "SPEND_LIMIT_REACHED"


class InsufficientFunds(BerthError):
    code_name = "INSUFFICIENT_FUNDS"


class Unsupported(BerthError):
    code_name = "UNSUPPORTED"


class NoCapacity(BerthError):
    code_name = "NO_CAPACITY"


class PriceChanged(BerthError):
    code_name = "PRICE_CHANGED"


class QuoteExpired(BerthError):
    code_name = "QUOTE_EXPIRED"


class ProviderUnavailable(BerthError):
    code_name = "PROVIDER_UNAVAILABLE"


class ComputeAccessRequired(BerthError):
    code_name = "COMPUTE_ACCESS_REQUIRED"




class QuotaExceeded(BerthError):
    code_name = "QUOTA_EXCEEDED"

    @property
    def resource(self) -> str | None:
        return self.details.get("resource")

    @property
    def limit(self) -> Any:
        return self.details.get("limit")

    @property
    def used(self) -> Any:
        return self.details.get("used")

    @property
    def requested(self) -> Any:
        return self.details.get("requested")


# One class per code of the API (common/errors.py), found by the code each declares.
ERRORS: dict[str, type[BerthError]] = {c.code_name: c for c in BerthError.__subclasses__() if c.code_name}
assert set(ERRORS) == set(error_table.CODES), "every API error code has its class"


def error_of(status: int, doc: Any, raw: bytes) -> BerthError:
    """The exception for an error answer: the envelope's code, message and details as sent."""
    envelope = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(envelope, dict) and isinstance(envelope.get("code"), str):
        code = envelope["code"]
        details = envelope.get("details") if isinstance(envelope.get("details"), dict) else {}
        return ERRORS.get(code, BerthError)(code, str(envelope.get("message", "")), details, status)
    text = raw[:200].decode("utf-8", "replace")
    return BadAnswer("BAD_ANSWER", f"HTTP {status} without the API's error envelope: {text!r}", {"body": text}, status)


def _decimal_or_none(value: Any) -> Decimal | None:
    if value is None:
        return None
    try:
        return Decimal(str(value))
    except InvalidOperation:
        return None


