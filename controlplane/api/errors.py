"""The error envelope; statuses come from the one table of error codes (common/errors.py).

Every refusal leaves as `{"error": {"code", "message", "details"}}`, encoded
from ErrorEnvelope, the one definition the API description (api/openapi.py)
also reads. An unexpected failure is logged with a reference and answered as
PROVIDER_UNAVAILABLE (the platform's fault; retry with the same key), never
as a bare 500; every other PROVIDER_UNAVAILABLE is logged with its reference
too.
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Literal

import msgspec
import structlog
from aiohttp import web
from msgspec import Struct

from common import errors as error_table
from controlplane.domain import errors as e

log = structlog.get_logger("berth.api")

STATUS = error_table.STATUS  # the one table of codes to statuses (common/errors.py)

Code = Literal[error_table.CODES]


class ErrorBody(Struct):
    """What was refused: a code of the table, a message for people, and details for programs (`details.field`)."""

    code: Code
    message: str
    details: dict[str, Any]


class ErrorEnvelope(Struct):
    """Every refusal of the API, whatever its status: `{"error": {"code", "message", "details"}}`."""

    error: ErrorBody


_encoder = msgspec.json.Encoder(decimal_format="string")


def json_response(body, status: int = 200) -> web.Response:
    """A JSON answer from a dict or a msgspec Struct (the node API's answers are Structs)."""
    return web.Response(body=_encoder.encode(body), status=status, content_type="application/json")


RETRY_AFTER_S = 5  # what a PROVIDER_UNAVAILABLE answer suggests, unless it says otherwise


def error_response(err: e.DomainError, status: int | None = None) -> web.Response:
    details = err.details
    if err.code == e.PROVIDER_UNAVAILABLE and "retryAfterSeconds" not in details:
        details = {**details, "retryAfterSeconds": RETRY_AFTER_S}
    resp = json_response(ErrorEnvelope(ErrorBody(err.code, err.message, details)), status or STATUS[err.code])
    if "retryAfterSeconds" in details:
        resp.headers["Retry-After"] = str(details["retryAfterSeconds"])
    return resp


def _logged(request: web.Request, err: e.DomainError) -> e.DomainError:
    """A platform failure as its caller hears it, logged with the reference the answer carries, so that support can
    find what a tenant quotes; the operator's diagnostics (`errors`: the IAM service's address and how it failed) go
    to the log only."""
    details = dict(err.details)
    diagnostics = details.pop("errors", None)
    reference = details.setdefault("reference", f"ref-{time.time_ns():x}")
    log.warning("answered PROVIDER_UNAVAILABLE", path=request.path, reference=reference, reason=err.message,
                **({"errors": diagnostics} if diagnostics else {}))
    return e.DomainError(err.code, err.message, details)


# aiohttp's own refusals, in the envelope with their HTTP status; BODY_FIELDS: those that name what a body got wrong.
HTTP_CODES = {404: e.NOT_FOUND, 405: e.INVALID_INPUT, 408: e.INVALID_INPUT, 413: e.INVALID_INPUT, 415: e.INVALID_INPUT}
BODY_FIELDS = {408: "body", 413: "body", 415: "Content-Type"}


async def answer_errors(request: web.Request, call: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The answer of call(), with every refusal and failure turned into the error envelope (never a bare 500)."""
    try:
        return await call()
    except e.DomainError as err:
        return error_response(_logged(request, err) if err.code == e.PROVIDER_UNAVAILABLE else err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = HTTP_CODES.get(exc.status, e.INVALID_INPUT)
        allowed = sorted(getattr(exc, "allowed_methods", None) or {"POST"})  # a 405 knows the route's methods
        message = {
            404: f"no method {request.path}",
            405: f"{request.method} is not allowed on {request.path}; use {' or '.join(allowed)}",
            413: "body: too large",
        }.get(exc.status, exc.reason)
        field = BODY_FIELDS.get(exc.status)
        if exc.status == 415 and message.startswith("Content-Encoding:"):  # (api/body.py: the header it names)
            field = "Content-Encoding"
        resp = error_response(e.DomainError(code, message, {"field": field, "rule": message} if field else {}),
                              exc.status)
        if exc.status == 405:
            resp.headers["Allow"] = ", ".join(allowed)  # RFC 9110: a 405 says what is allowed
        return resp
    except Exception:
        reference = f"ref-{time.time_ns():x}"
        log.exception("request failed", path=request.path, reference=reference)
        return error_response(e.DomainError(
            e.PROVIDER_UNAVAILABLE, "the control plane failed on this request; retry later (a create with the same "
            "idempotency key)",
            {"actor": "platform", "reference": reference},
        ))
