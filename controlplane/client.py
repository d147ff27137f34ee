"""Berth's Python client: one typed method per API method, async (`AsyncClient`, aiohttp) and sync (`Client`).

The sync client runs the async one on a private event loop, so the request,
the retries and the reading of the answer have one code path. Answers decode
into msgspec Structs (unknown extra fields are ignored, so a newer server
does not break an older client); money is `Decimal`, never float.

Retries: a transport error (no answer: refused, reset, timed out) and
`503 PROVIDER_UNAVAILABLE` are retried a bounded number of times with
exponential backoff and jitter, with the SAME idempotency key. A create
without a key gets one from the client (`new_idempotency_key()`) before the
first attempt, so its retries can never create a second reservation. Calls
that are not safe to repeat (extend with `by`) are retried only when the
request was certainly not sent (the connection could not be made).

Refusals raise `BerthError(code, message, details, status)` (a subclass per
code, e.g. `NoCapacity`) that keeps every structured detail of the error
envelope, with convenience properties (`reason`, `alternatives`,
`cheapest_eligible_usd_per_hour`, `confirmation_id`, ...).
"""
from __future__ import annotations

import asyncio
import builtins
import functools
import json
import os
import random
import uuid
from dataclasses import dataclass, field as dc_field
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Awaitable, Callable, Concatenate, Coroutine, Mapping, ParamSpec, TypeVar

import aiohttp
import msgspec
from msgspec import Struct, field

__all__ = [
    "AsyncClient", "Client", "Settings", "ConfigError", "resolve_settings", "default_config_path",
    "new_idempotency_key", "create_body", "parse_time", "decode",
    "Reservation", "Operation", "Failure", "ExtendResult", "ReservationPage", "Quote", "Alternative",
    "OperationWait", "Usage", "UsageLine", "ReservationTotal", "Event", "EventPage", "Confirmation",
    "BerthError", "TransportError", "BadAnswer", "InvalidInput", "Unauthenticated", "NotFound", "Conflict",
    "InvalidState", "AccessDenied", "ConfirmationRequired", "QuotaExceeded", "SpendLimitReached",
    "InsufficientFunds", "Unsupported", "NoCapacity", "PriceChanged", "QuoteExpired", "ProviderUnavailable",
]

DEFAULT_URL = "http://127.0.0.1:8080"
USER_AGENT = "berth-python/0.1"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
WAIT_STEP_MS = 25_000  # one /operations/wait call: well under the server's 60 s cap and most proxies' idle timeouts


# ---- answers ----------------------------------------------------------------

class Resources(Struct, kw_only=True, frozen=True):
    vcpu: float | None = None
    memory_gib: float | None = field(default=None, name="memoryGiB")
    hugepages_1gi: int | None = field(default=None, name="hugepages1Gi")


class Placement(Struct, rename="camel", kw_only=True, frozen=True):
    node_id: str
    devices: list[str] = []


class Condition(Struct, rename="camel", kw_only=True, frozen=True):
    type: str
    status: str
    reason: str | None = None
    message: str | None = None
    last_transition_time: int | None = None


class Failure(Struct, kw_only=True, frozen=True):
    """Why an operation failed or was cancelled; `actor` is customer, provider or platform."""

    code: str
    actor: str
    message: str = ""
    next: str | None = None


class Operation(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    kind: str
    status: str  # running, succeeded, failed, cancelled
    reservation_id: str
    created_at: int
    updated_at: int
    failure: Failure | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class Reservation(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    tenant_id: str
    principal_id: str
    pool_id: str
    state: str
    gpu_model: str
    region: str | None = None
    binding: str = "hold"
    sharing: str | None = None
    mig_profile: str | None = None
    gpu_count: int | None = None
    node_count: int = 1
    start: int | None = None
    end: int | None = None
    duration_hours: float | None = None
    spot: bool = False
    lease_seconds: int | None = None
    lease_deadline: int | None = None
    resources: Resources = Resources()
    placements: list[Placement] = []
    conditions: list[Condition] = []
    operation: Operation | None = None
    created_at: int | None = None
    updated_at: int | None = None
    reason: str | None = None


class ExtendResult(Struct, rename="camel", kw_only=True, frozen=True):
    reservation: Reservation
    extended: bool
    available_until: int | None = None


class ReservationPage(Struct, rename="camel", kw_only=True, frozen=True):
    reservations: list[Reservation]
    next_cursor: str | None = None


class Alternative(Struct, rename="camel", kw_only=True, frozen=True):
    """Another pool offered to the tenant that could hold the request, at its running price."""

    pool_id: str
    region: str | None = None
    total_running_usd_per_hour: Decimal | None = None
    earliest_start: int | None = None


class Quote(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    created_at: int
    expires_at: int
    pool_id: str
    gpu_model: str
    total_running_usd_per_hour: Decimal
    total_usd: Decimal
    currency: str = "USD"
    region: str | None = None
    gpu_count: int | None = None
    node_count: int = 1
    resources: Resources = Resources()
    window_hours: float | None = None
    earliest_start: int | None = None
    fits_now: bool = False
    alternatives: list[Alternative] = []
    priced: dict[str, Any] = {}


class OperationWait(Struct, kw_only=True, frozen=True):
    operation: Operation
    done: bool


class UsageLine(Struct, rename="camel", kw_only=True, frozen=True):
    """What one reservation billed on one UTC day, prorated to the second."""

    reservation_id: str
    pool_id: str
    day: str
    start: int = field(name="from")
    end: int = field(name="to")
    seconds: int
    hourly_usd: Decimal
    amount_usd: Decimal
    running: bool = False


class ReservationTotal(Struct, rename="camel", kw_only=True, frozen=True):
    reservation_id: str
    total_usd: Decimal


class Usage(Struct, rename="camel", kw_only=True, frozen=True):
    lines: list[UsageLine]
    page_total_usd: Decimal
    total_usd: Decimal
    by_reservation: list[ReservationTotal] = []
    next_cursor: str | None = None


class Event(Struct, rename="camel", kw_only=True, frozen=True):
    seq: int
    type: str
    at: int
    reservation_id: str | None = None
    data: dict[str, Any] = {}


class EventPage(Struct, rename="camel", kw_only=True, frozen=True):
    events: list[Event]
    next_cursor: int | None = None


class Confirmation(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    status: str  # pending, approved, denied, expired
    reservation_id: str | None = None
    agent_id: str | None = None
    approver: str | None = None
    created_at: int | None = None
    expires_at: int | None = None
    message: str = ""
    asked: dict[str, Any] = {}
    decided_at: int | None = None
    interval: int | None = None


T = TypeVar("T")


def decode(doc: Any, type_: type[T]) -> T:
    """An answer's JSON (already parsed) as the typed result; BadAnswer when it does not fit."""
    try:
        return msgspec.convert(doc, type_)
    except msgspec.ValidationError as exc:
        raise BadAnswer("BAD_ANSWER", f"the server's answer does not read as {type_.__name__}: {exc}",
                        {"answer": doc}, None) from None


# ---- errors -----------------------------------------------------------------

class BerthError(Exception):
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


class InvalidInput(BerthError): pass
class Unauthenticated(BerthError): pass
class NotFound(BerthError): pass
class Conflict(BerthError): pass
class InvalidState(BerthError): pass
class AccessDenied(BerthError): pass
class ConfirmationRequired(BerthError): pass
class SpendLimitReached(BerthError): pass
class InsufficientFunds(BerthError): pass
class Unsupported(BerthError): pass
class NoCapacity(BerthError): pass
class PriceChanged(BerthError): pass
class QuoteExpired(BerthError): pass
class ProviderUnavailable(BerthError): pass


class QuotaExceeded(BerthError):
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


ERRORS: dict[str, type[BerthError]] = {
    "INVALID_INPUT": InvalidInput, "UNAUTHENTICATED": Unauthenticated, "NOT_FOUND": NotFound,
    "CONFLICT": Conflict, "INVALID_STATE": InvalidState, "ACCESS_DENIED": AccessDenied,
    "CONFIRMATION_REQUIRED": ConfirmationRequired, "QUOTA_EXCEEDED": QuotaExceeded,
    "SPEND_LIMIT_REACHED": SpendLimitReached, "INSUFFICIENT_FUNDS": InsufficientFunds,
    "UNSUPPORTED": Unsupported, "NO_CAPACITY": NoCapacity, "PRICE_CHANGED": PriceChanged,
    "QUOTE_EXPIRED": QuoteExpired, "PROVIDER_UNAVAILABLE": ProviderUnavailable,
}


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


# ---- configuration ------------------------------------------------------------

class ConfigError(ValueError):
    """The client cannot be configured: the message says what to give."""


@dataclass(frozen=True)
class Settings:
    """Where to send requests and as whom, and where each came from (`flag`, `env BERTH_URL`, `file PATH`, `default`)."""

    url: str
    token: str
    sources: dict[str, str] = dc_field(default_factory=dict)


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "berth" / "config.json"


def read_config_file(path: Path, required: bool) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise ConfigError(f"--config {path}: no such file") from None
        return {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"config file {path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f'config file {path}: must be a JSON object like {{"url": ..., "token": ...}}')
    for key in ("url", "token"):
        if key in doc and not isinstance(doc[key], str):
            raise ConfigError(f"config file {path}: {key} must be a string")
    return doc


def resolve_settings(url: str | None = None, token: str | None = None, config_path: str | os.PathLike | None = None,
                     environ: Mapping[str, str] | None = None) -> Settings:
    """url and token from the arguments, then BERTH_URL/BERTH_TOKEN, then the config file, each on its own.

    The file is `config_path` (which must exist), else
    `$XDG_CONFIG_HOME/berth/config.json` or `~/.config/berth/config.json`
    (which may be absent). The URL defaults to http://127.0.0.1:8080; the
    token has no default.
    """
    env = os.environ if environ is None else environ
    path = Path(config_path) if config_path is not None else default_config_path(env)
    doc = read_config_file(path, required=config_path is not None)
    sources: dict[str, str] = {}
    values: dict[str, str | None] = {}
    for key, given, var in (("url", url, "BERTH_URL"), ("token", token, "BERTH_TOKEN")):
        if given:
            values[key], sources[key] = given, "flag"
        elif env.get(var):
            values[key], sources[key] = env[var], f"env {var}"
        elif doc.get(key):
            values[key], sources[key] = doc[key], f"file {path}"
        else:
            values[key] = None
    if values["url"] is None:
        values["url"], sources["url"] = DEFAULT_URL, "default"
    if not values["token"]:
        raise ConfigError(f'no token: give --token, set BERTH_TOKEN, or write {{"token": "..."}} to {path}')
    return Settings(str(values["url"]).rstrip("/"), str(values["token"]), sources)


# ---- request bodies ---------------------------------------------------------------

def new_idempotency_key(prefix: str = "py") -> str:
    """A fresh key for one intent: keep it across the retries of that intent, never across intents."""
    return f"{prefix}-{uuid.uuid4()}"


def parse_time(value: str | int | datetime) -> int:
    """Epoch milliseconds from epoch ms (int or digits) or ISO 8601 (an offset-less time is UTC)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a time")
    if isinstance(value, int):
        return value
    if isinstance(value, datetime):
        moment = value
    else:
        text = value.strip()
        if text.isdigit():
            return int(text)
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{value!r}: give epoch milliseconds or ISO 8601, e.g. 2027-01-31T09:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def price_text(value: Decimal | str | int) -> str:
    """A price for the wire: a decimal string (the server allows at most six decimals)."""
    if isinstance(value, float):
        raise TypeError("prices are Decimal or str, never float")
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a decimal price, e.g. 3.420000") from None
    if not amount.is_finite():
        raise ValueError(f"{value!r} is not a decimal price, e.g. 3.420000")
    return format(amount, "f")


def create_body(pool_id: str, gpu_model: str, *, gpu_count: int | None = None, node_count: int | None = None,
                sharing: str | None = None, mig_profile: str | None = None,
                start: str | int | datetime | None = None, end: str | int | datetime | None = None,
                duration_hours: float | None = None, binding: str | None = None,
                vcpu: float | None = None, memory_gib: float | None = None, hugepages_1gi: int | None = None,
                spot: bool | None = None, lease_seconds: int | None = None, quote_id: str | None = None,
                max_hourly_price: Decimal | str | None = None, wait_ms: int | None = None) -> dict[str, Any]:
    """The JSON body of a create (or a quote) from its fields; None means "not given" (the server's default)."""
    body: dict[str, Any] = {"poolId": pool_id, "gpuModel": gpu_model}
    optional = {
        "gpuCount": gpu_count, "nodeCount": node_count, "sharing": sharing, "migProfile": mig_profile,
        "start": None if start is None else parse_time(start), "end": None if end is None else parse_time(end),
        "durationHours": duration_hours, "binding": binding, "spot": spot, "leaseSeconds": lease_seconds,
        "quoteId": quote_id, "maxHourlyPrice": None if max_hourly_price is None else price_text(max_hourly_price),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    resources = {k: v for k, v in (("vcpu", vcpu), ("memoryGiB", memory_gib), ("hugepages1Gi", hugepages_1gi))
                 if v is not None}
    if resources:
        body["resources"] = resources
    if wait_ms is not None:
        body["wait"] = {"timeoutMs": wait_ms}
    return body


def _drop_none(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


# ---- the async client -----------------------------------------------------------

_SENT_MAYBE = (aiohttp.ClientError, asyncio.TimeoutError)  # the request may have reached the server
_NOT_SENT = (aiohttp.ClientConnectorError,)  # the connection was never made: safe to repeat anything


class AsyncClient:
    """The tenant API over aiohttp. Use `async with AsyncClient(url, token) as c:` or call `close()`.

    retries: extra attempts after the first for transport errors and 503
    PROVIDER_UNAVAILABLE; backoff: the first delay in seconds, doubled per
    attempt up to max_backoff, with jitter (at least a refusal's
    retryAfterSeconds); timeout: seconds per attempt (long polls add their
    own wait); on_retry(attempt, error, delay) is called before each retry.
    """

    def __init__(self, url: str, token: str, *, timeout: float = 30.0, retries: int = 4, backoff: float = 0.25,
                 max_backoff: float = 4.0, session: aiohttp.ClientSession | None = None,
                 user_agent: str = USER_AGENT,
                 on_retry: Callable[[int, BerthError, float], Any] | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.user_agent = user_agent
        self.on_retry = on_retry
        self._session = session
        self._own_session = session is None

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> "AsyncClient":
        return cls(settings.url, settings.token, **kw)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
            self._session = None

    def _delay(self, attempt: int, err: BerthError) -> float:
        after = err.retry_after_seconds
        base = min(self.max_backoff, self.backoff * (2 ** (attempt - 1)))
        delay = base * (0.5 + random.random() / 2)
        return min(self.max_backoff, max(delay, after or 0.0))

    async def _post(self, url: str, data: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(url, data=data, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()

    async def call(self, path: str, body: Mapping[str, Any] | None = None, *, idempotency_key: str | None = None,
                   idempotent: bool = True, wait_s: float = 0.0) -> dict[str, Any]:
        """POST /api/<path> and return the answer's JSON; the one path every method takes.

        Retries transport errors (for non-idempotent calls only when nothing
        was sent) and 503 PROVIDER_UNAVAILABLE, with the same body and key.
        """
        url = f"{self.url}/api/{path}"
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
                   "Accept": "application/json", "User-Agent": self.user_agent}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        data = msgspec.json.encode(dict(body or {}))
        attempt = 0
        while True:
            attempt += 1
            try:
                status, raw = await self._post(url, data, headers, self.timeout + wait_s)
            except _SENT_MAYBE as exc:
                err: BerthError = TransportError(
                    "TRANSPORT_ERROR", f"no answer from {self.url} after {attempt} attempt(s): "
                    f"{type(exc).__name__}: {exc or 'timed out'}",
                    {"url": url, "attempts": attempt, "cause": type(exc).__name__,
                     "sent": not isinstance(exc, _NOT_SENT)},
                    None, idempotency_key=idempotency_key)
                if (idempotent or isinstance(exc, _NOT_SENT)) and attempt <= self.retries:
                    await self._pause(attempt, err)
                    continue
                raise err from exc
            try:
                doc = msgspec.json.decode(raw) if raw else {}
            except msgspec.DecodeError:
                doc = None
            if 200 <= status < 300 and isinstance(doc, dict):
                return doc
            err = error_of(status, doc, raw) if status >= 300 else BadAnswer(
                "BAD_ANSWER", f"HTTP {status} with a body that is not a JSON object", {}, status)
            err.idempotency_key = idempotency_key
            transient = err.code == "PROVIDER_UNAVAILABLE" or (isinstance(err, BadAnswer) and status in (502, 503, 504))
            if transient and idempotent and attempt <= self.retries:
                await self._pause(attempt, err)
                continue
            raise err

    async def _pause(self, attempt: int, err: BerthError) -> None:
        delay = self._delay(attempt, err)
        if self.on_retry is not None:
            self.on_retry(attempt, err, delay)
        await asyncio.sleep(delay)

    # reservations
    async def create(self, pool_id: str, gpu_model: str, *, gpu_count: int | None = None,
                     node_count: int | None = None, sharing: str | None = None, mig_profile: str | None = None,
                     start: str | int | datetime | None = None, end: str | int | datetime | None = None,
                     duration_hours: float | None = None, binding: str | None = None, vcpu: float | None = None,
                     memory_gib: float | None = None, hugepages_1gi: int | None = None, spot: bool | None = None,
                     lease_seconds: int | None = None, quote_id: str | None = None,
                     max_hourly_price: Decimal | str | None = None, wait_ms: int | None = None,
                     idempotency_key: str | None = None) -> Reservation:
        """Create a reservation (202 Accepted); without idempotency_key the client makes one for its retries."""
        body = create_body(pool_id, gpu_model, gpu_count=gpu_count, node_count=node_count, sharing=sharing,
                           mig_profile=mig_profile, start=start, end=end, duration_hours=duration_hours,
                           binding=binding, vcpu=vcpu, memory_gib=memory_gib, hugepages_1gi=hugepages_1gi, spot=spot,
                           lease_seconds=lease_seconds, quote_id=quote_id, max_hourly_price=max_hourly_price,
                           wait_ms=wait_ms)
        return await self.create_from_body(body, idempotency_key=idempotency_key)

    async def create_from_body(self, body: Mapping[str, Any], *, idempotency_key: str | None = None) -> Reservation:
        key = idempotency_key or new_idempotency_key()
        wait_s = (body.get("wait") or {}).get("timeoutMs", 0) / 1000
        doc = await self.call("compute/reservations/create", body, idempotency_key=key, wait_s=wait_s)
        return decode(doc.get("reservation"), Reservation)

    async def get(self, reservation_id: str) -> Reservation:
        doc = await self.call("compute/reservations/get", {"reservationId": reservation_id})
        return decode(doc.get("reservation"), Reservation)

    async def list(self, *, scope: str | None = None, state: str | None = None, pool_id: str | None = None,
                   limit: int | None = None, cursor: str | None = None) -> ReservationPage:
        body = _drop_none(scope=scope, state=state, poolId=pool_id, limit=limit, cursor=cursor)
        return decode(await self.call("compute/reservations/list", body), ReservationPage)

    async def release(self, reservation_id: str) -> Reservation:
        doc = await self.call("compute/reservations/release", {"reservationId": reservation_id})
        return decode(doc.get("reservation"), Reservation)

    async def cancel(self, reservation_id: str) -> Reservation:
        doc = await self.call("compute/reservations/cancel", {"reservationId": reservation_id})
        return decode(doc.get("reservation"), Reservation)

    async def extend(self, reservation_id: str, *, until: str | int | datetime | None = None,
                     by_ms: int | None = None) -> ExtendResult:
        """Move the end later: `until` (safe to retry) or `by_ms` (extends again when repeated: not retried once sent)."""
        body = _drop_none(reservationId=reservation_id, until=None if until is None else parse_time(until), by=by_ms)
        doc = await self.call("compute/reservations/extend", body, idempotent=by_ms is None)
        return decode(doc, ExtendResult)

    async def renew(self, reservation_id: str) -> Reservation:
        doc = await self.call("compute/reservations/renew", {"reservationId": reservation_id})
        return decode(doc.get("reservation"), Reservation)

    async def quote(self, pool_id: str, gpu_model: str, *, gpu_count: int | None = None,
                    node_count: int | None = None, sharing: str | None = None, mig_profile: str | None = None,
                    start: str | int | datetime | None = None, end: str | int | datetime | None = None,
                    duration_hours: float | None = None, binding: str | None = None, vcpu: float | None = None,
                    memory_gib: float | None = None, hugepages_1gi: int | None = None, spot: bool | None = None,
                    lease_seconds: int | None = None) -> Quote:
        """The price of a request now; creates and charges nothing, holds no capacity, expires after 120 s."""
        body = create_body(pool_id, gpu_model, gpu_count=gpu_count, node_count=node_count, sharing=sharing,
                           mig_profile=mig_profile, start=start, end=end, duration_hours=duration_hours,
                           binding=binding, vcpu=vcpu, memory_gib=memory_gib, hugepages_1gi=hugepages_1gi, spot=spot,
                           lease_seconds=lease_seconds)
        return await self.quote_from_body(body)

    async def quote_from_body(self, body: Mapping[str, Any]) -> Quote:
        doc = await self.call("compute/reservations/quote", body)
        return decode(doc.get("quote"), Quote)

    # operations
    async def get_operation(self, operation_id: str) -> Operation:
        doc = await self.call("compute/operations/get", {"operationId": operation_id})
        return decode(doc.get("operation"), Operation)

    async def wait_operation(self, operation_id: str, timeout_ms: int = WAIT_STEP_MS) -> OperationWait:
        """One bounded wait on the server (at most 60000 ms): the operation, finished or not."""
        doc = await self.call("compute/operations/wait", {"operationId": operation_id, "timeoutMs": timeout_ms},
                              wait_s=timeout_ms / 1000)
        return decode(doc, OperationWait)

    async def wait_until_done(self, operation_id: str, timeout_s: float, *, step_ms: int = WAIT_STEP_MS,
                              on_poll: Callable[[OperationWait], Any] | None = None) -> OperationWait:
        """Wait in bounded steps until the operation is done or timeout_s passed; `done` tells which."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left_ms = max(0, int((deadline - loop.time()) * 1000))
            answer = await self.wait_operation(operation_id, min(step_ms, left_ms))
            if on_poll is not None:
                on_poll(answer)
            if answer.done or loop.time() >= deadline:
                return answer

    # usage and events
    async def list_usage(self, *, reservation_id: str | None = None, since: str | int | datetime | None = None,
                         until: str | int | datetime | None = None, limit: int | None = None,
                         cursor: str | None = None) -> Usage:
        body = _drop_none(reservationId=reservation_id, since=None if since is None else parse_time(since),
                          until=None if until is None else parse_time(until), limit=limit, cursor=cursor)
        return decode(await self.call("compute/usage/list", body), Usage)

    async def list_events(self, *, after: int | None = None, limit: int | None = None) -> EventPage:
        return decode(await self.call("compute/events/list", _drop_none(after=after, limit=limit)), EventPage)

    # confirmations
    async def list_confirmations(self, *, status: str | None = None,
                                 limit: int | None = None) -> builtins.list[Confirmation]:
        doc = await self.call("iam/confirmations/list", _drop_none(status=status, limit=limit))
        return decode(doc.get("confirmations"), list[Confirmation])

    async def get_confirmation(self, confirmation_id: str) -> Confirmation:
        doc = await self.call("iam/confirmations/get", {"confirmationId": confirmation_id})
        return decode(doc.get("confirmation"), Confirmation)

    async def approve_confirmation(self, confirmation_id: str) -> Confirmation:
        doc = await self.call("iam/confirmations/approve", {"confirmationId": confirmation_id})
        return decode(doc.get("confirmation"), Confirmation)

    async def deny_confirmation(self, confirmation_id: str) -> Confirmation:
        doc = await self.call("iam/confirmations/deny", {"confirmationId": confirmation_id})
        return decode(doc.get("confirmation"), Confirmation)


# ---- the sync client --------------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")


def _blocking(method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]) -> Callable[Concatenate["Client", P], R]:
    """The sync twin of an AsyncClient method: same signature and docstring, run on the client's private loop."""

    @functools.wraps(method)
    def run(self: "Client", *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(method(self._async, *args, **kwargs))

    run.__qualname__ = f"Client.{method.__name__}"
    return run


class Client:
    """The same methods as AsyncClient, blocking: each runs the async one on this client's private event loop.

    Not for use inside a running event loop (use AsyncClient there), and one
    thread at a time. Use `with Client(url, token) as c:` or call `close()`.
    """

    def __init__(self, url: str, token: str, **kw: Any):
        self._loop = asyncio.new_event_loop()
        self._async = AsyncClient(url, token, **kw)

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> "Client":
        return cls(settings.url, settings.token, **kw)

    @property
    def url(self) -> str:
        return self._async.url

    def _run(self, coro: Awaitable[T]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("this Client is closed")
        return self._loop.run_until_complete(coro)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._async.close())
            self._loop.close()

    call = _blocking(AsyncClient.call)
    create = _blocking(AsyncClient.create)
    create_from_body = _blocking(AsyncClient.create_from_body)
    get = _blocking(AsyncClient.get)
    list = _blocking(AsyncClient.list)
    release = _blocking(AsyncClient.release)
    cancel = _blocking(AsyncClient.cancel)
    extend = _blocking(AsyncClient.extend)
    renew = _blocking(AsyncClient.renew)
    quote = _blocking(AsyncClient.quote)
    quote_from_body = _blocking(AsyncClient.quote_from_body)
    get_operation = _blocking(AsyncClient.get_operation)
    wait_operation = _blocking(AsyncClient.wait_operation)
    wait_until_done = _blocking(AsyncClient.wait_until_done)
    list_usage = _blocking(AsyncClient.list_usage)
    list_events = _blocking(AsyncClient.list_events)
    list_confirmations = _blocking(AsyncClient.list_confirmations)
    get_confirmation = _blocking(AsyncClient.get_confirmation)
    approve_confirmation = _blocking(AsyncClient.approve_confirmation)
    deny_confirmation = _blocking(AsyncClient.deny_confirmation)
