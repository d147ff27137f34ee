"""The async client: one typed method per API method over one retrying transport (aiohttp).

Retries: a transport error (no answer: refused, reset, timed out) and
`503 PROVIDER_UNAVAILABLE` are retried a bounded number of times with
exponential backoff and jitter, with the SAME idempotency key. A create
without a key gets one from the client before the first attempt, so its
retries can never create a second reservation. Calls that are not safe to
repeat (extend with `by`) are retried only when the request was certainly
not sent (the connection could not be made).

TLS: https:// URLs verify the server against the system trust store, or
against `ssl_context` (`Settings.tls_context()`, from --ca-file and, for a
control plane that requires client certificates, --client-cert and
--client-key). A failed handshake is never retried: it raises TransportError
at once, `details["tls"]` saying what to change; a connection closed without
an answer, as a TLS listener closes plain http:// and a mutual TLS one a
client without a certificate, carries `details["hint"]`.
"""
from __future__ import annotations

import asyncio
import builtins
import random
import ssl
from datetime import datetime
from typing import Any, Callable, Mapping

import aiohttp
import msgspec

from berth.client.answers import (AdminNode, AdminPool, AdminTenant, Confirmation, EventPage, ExtendResult, NodeAction,
                                  OfferedPool, Operation, OperationWait, Quote, Reservation, ReservationPage, Usage,
                                  Whoami, decode)
from berth.client.config import Settings, check_url
from berth.client.errors import BadAnswer, BerthError, TransportError, error_of
from berth.client.requests import ReservationRequest, new_idempotency_key, parse_time
from berth.version import VERSION
from common import tls

USER_AGENT = f"berth-python/{VERSION}"
WAIT_STEP_MS = 25_000  # one /operations/wait call: well under the server's 60 s cap and most proxies' idle timeouts


def _drop_none(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


_SENT_MAYBE = (aiohttp.ClientError, asyncio.TimeoutError)  # the request may have reached the server
_NOT_SENT = (aiohttp.ClientConnectorError,)  # the connection was never made: safe to repeat anything
_TLS_REFUSED = (aiohttp.ClientSSLError,)  # the handshake failed: the same attempt fails the same way


class AsyncClient:
    """The tenant API over aiohttp. Use `async with AsyncClient(url, token) as c:` or call `close()`.

    retries: extra attempts after the first for transport errors and 503
    PROVIDER_UNAVAILABLE; backoff: the first delay in seconds, doubled per
    attempt up to max_backoff, with jitter (at least a refusal's
    retryAfterSeconds); timeout: seconds per attempt (long polls add their
    own wait); on_retry(attempt, error, delay) is called before each retry;
    ssl_context: what https:// verifies the server with (and shows it, for
    mutual TLS); None: the system trust store.
    """

    def __init__(self, url: str, token: str, *, timeout: float = 30.0, retries: int = 4, backoff: float = 0.25,
                 max_backoff: float = 4.0, session: aiohttp.ClientSession | None = None,
                 user_agent: str = USER_AGENT, ssl_context: ssl.SSLContext | None = None,
                 on_retry: Callable[[int, BerthError, float], Any] | None = None):
        self.url = check_url(url)
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.user_agent = user_agent
        self.on_retry = on_retry
        self.ssl_context = ssl_context
        self._session = session
        self._own_session = session is None
        self.last_answer: dict[str, Any] = {}  # the document of the last call answered, as the API sent it

    def __repr__(self) -> str:  # never the token
        return f"AsyncClient(url={self.url!r}, retries={self.retries}, timeout={self.timeout:g})"

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> "AsyncClient":
        """A client for these settings; tls.TlsError (a ValueError) when their TLS files cannot be used."""
        if "ssl_context" not in kw:
            kw["ssl_context"] = settings.tls_context()
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

    async def _post(self, url: str, data: bytes, headers: dict[str, str],
                    timeout: float) -> tuple[int, bytes, str | None]:
        """(status, body, where a redirect points). A redirect is not followed: the API never redirects, so one is a
        proxy's (a login page, http to https), where a POST would turn into a GET and the token go along."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                                      ssl=self.ssl_context if self.ssl_context is not None else True,
                                      allow_redirects=False) as resp:
            return resp.status, await resp.read(), resp.headers.get("Location")

    async def call(self, path: str, body: Mapping[str, Any] | None = None, *, idempotency_key: str | None = None,
                   idempotent: bool = True, wait_s: float = 0.0) -> dict[str, Any]:
        """POST /api/<path> and return the answer's JSON; the one path every method takes.

        Retries transport errors (for non-idempotent calls only when nothing
        was sent) and 503 PROVIDER_UNAVAILABLE, with the same body and key.
        """
        url = f"{self.url}/api/{path}"
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
                   "Accept": "application/json", "User-Agent": self.user_agent}
        if idempotency_key is not None and idempotency_key.isascii() and idempotency_key.isprintable():
            headers["Idempotency-Key"] = idempotency_key
        elif idempotency_key is not None:  # a header carries printable ASCII only; the body takes any text
            body = {**(body or {}), "idempotencyKey": idempotency_key}
        data = msgspec.json.encode(dict(body or {}))
        attempt = 0
        while True:
            attempt += 1
            try:
                status, raw, location = await self._post(url, data, headers, self.timeout + wait_s)
            except _SENT_MAYBE as exc:
                err: BerthError = self._no_answer(exc, url, attempt, idempotency_key)
                if isinstance(exc, _TLS_REFUSED):
                    raise err from exc
                if (idempotent or isinstance(exc, _NOT_SENT)) and attempt <= self.retries:
                    await self._pause(attempt, err)
                    continue
                raise err from exc
            try:
                doc = msgspec.json.decode(raw) if raw else {}
            except msgspec.DecodeError:
                doc = None
            if 200 <= status < 300 and isinstance(doc, dict):
                self.last_answer = doc
                return doc
            if 300 <= status < 400:
                err = BadAnswer("BAD_ANSWER", f"HTTP {status}: {url} redirects to {location or '(nowhere said)'}; the "
                                "API never redirects, so the URL is not the control plane's (a proxy's login page? "
                                "http for https?)", {"redirect": location}, status)
            else:
                err = error_of(status, doc, raw) if status >= 300 else BadAnswer(
                    "BAD_ANSWER", f"HTTP {status} with a body that is not a JSON object", {}, status)
            err.idempotency_key = idempotency_key
            transient = err.code == "PROVIDER_UNAVAILABLE" or (isinstance(err, BadAnswer) and status in (502, 503, 504))
            if transient and idempotent and attempt <= self.retries:
                await self._pause(attempt, err)
                continue
            raise err

    def _no_answer(self, exc: BaseException, url: str, attempt: int, idempotency_key: str | None) -> TransportError:
        """The TransportError for an attempt that got no answer; a TLS failure says what to change."""
        details: dict[str, Any] = {"url": url, "attempts": attempt, "cause": type(exc).__name__,
                                   "sent": not isinstance(exc, _NOT_SENT)}
        message = f"no answer from {self.url} after {attempt} attempt(s): {type(exc).__name__}: {exc or 'timed out'}"
        advice = tls.explain(exc, self.url, disconnected=isinstance(exc, aiohttp.ServerDisconnectedError))
        if advice is not None and isinstance(exc, _TLS_REFUSED):  # certain: the handshake failed for this reason
            details["tls"] = advice
            message = f"no TLS connection to {self.url}: {advice}"
        elif advice is not None:  # a closed connection: TLS is one likely reason among others
            details["hint"] = advice
        return TransportError("TRANSPORT_ERROR", message, details, None, idempotency_key=idempotency_key)

    async def _pause(self, attempt: int, err: BerthError) -> None:
        delay = self._delay(attempt, err)
        if self.on_retry is not None:
            self.on_retry(attempt, err, delay)
        await asyncio.sleep(delay)

    # reservations
    async def create(self, pool_id: str = "", gpu_model: str = "", *, request: ReservationRequest | None = None,
                     idempotency_key: str | None = None, **fields: Any) -> Reservation:
        """Create a reservation (202 Accepted) from a ReservationRequest or its fields as keywords (pool_id,
        gpu_model, gpu_count, ...: see berth.client.ReservationRequest); without idempotency_key the client makes
        one, kept across its retries, so they can never create a second reservation."""
        request = request or ReservationRequest(pool_id, gpu_model, **fields)
        key = new_idempotency_key() if idempotency_key is None else idempotency_key  # "" goes, and is refused
        wait_s = (request.wait_ms or 0) / 1000
        doc = await self.call("compute/reservations/create", request.to_body(), idempotency_key=key, wait_s=wait_s)
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

    async def quote(self, pool_id: str = "", gpu_model: str = "", *, request: ReservationRequest | None = None,
                    **fields: Any) -> Quote:
        """The price of a request now; creates and charges nothing, holds no capacity, expires after 120 s."""
        request = (request or ReservationRequest(pool_id, gpu_model, **fields)).without_create_only()
        doc = await self.call("compute/reservations/quote", request.to_body())
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

    async def list_events(self, *, after: int | None = None, limit: int | None = None,
                          wait_ms: int = 0) -> EventPage:
        """The tenant's events after the cursor, oldest first; wait_ms (at most 30000) holds the answer until there
        is one (a long poll: an empty page means none came)."""
        body = _drop_none(after=after, limit=limit, waitMs=wait_ms or None)
        return decode(await self.call("compute/events/list", body, wait_s=wait_ms / 1000), EventPage)

    async def last_event_cursor(self) -> int | None:
        """The cursor after the tenant's newest event (None: none yet): where a watch of what comes next starts."""
        return decode(await self.call("compute/events/list", {"fromEnd": True}), EventPage).next_cursor

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

    # pools, as the tenant sees them
    async def list_pools(self, *, start: str | int | datetime | None = None,
                         until: str | int | datetime | None = None) -> builtins.list[OfferedPool]:
        """The pools the tenant owns or is offered, with their free devices from `start` (default now) to `until`
        (default a week later)."""
        doc = await self.call("compute/pools/list", _window(start, until))
        return decode(doc.get("pools"), list[OfferedPool])

    async def get_pool(self, pool_id: str, *, start: str | int | datetime | None = None,
                       until: str | int | datetime | None = None) -> OfferedPool:
        doc = await self.call("compute/pools/get", {"poolId": pool_id, **_window(start, until)})
        return decode(doc.get("pool"), OfferedPool)

    async def whoami(self) -> Whoami:
        """Who this client's token speaks for: tenant, principal, kind (user or agent), scope (manage or read)."""
        return decode((await self.call("iam/whoami", {})).get("principal"), Whoami)

    # the operator's (the bootstrap file's admin token, or an operator principal's token)
    async def release_node_identity(self, node_id: str) -> AdminNode:
        """Let the node's next registration come from any host (a replaced or reinstalled machine)."""
        doc = await self.call("admin/nodes/release-identity", {"nodeId": node_id})
        return decode(doc.get("node"), AdminNode)

    async def list_nodes(self, *, pool_id: str | None = None, state: str | None = None,
                         start: str | int | datetime | None = None,
                         until: str | int | datetime | None = None) -> builtins.list[AdminNode]:
        """Every node the caller may read, with the bookings that overlap [start, until) (default: the next week)."""
        body = {**_drop_none(poolId=pool_id, state=state), **_window(start, until)}
        doc = await self.call("admin/nodes/list", body)
        return decode(doc.get("nodes"), list[AdminNode])

    async def get_node(self, node_id: str, *, start: str | int | datetime | None = None,
                       until: str | int | datetime | None = None) -> AdminNode:
        doc = await self.call("admin/nodes/get", {"nodeId": node_id, **_window(start, until)})
        return decode(doc.get("node"), AdminNode)

    async def cordon_node(self, node_id: str, *, reason: str | None = None) -> NodeAction:
        """No new placements on the node; its bookings stay. Idempotent (`changed` says whether it was needed)."""
        return decode(await self.call("admin/nodes/cordon", _drop_none(nodeId=node_id, reason=reason)), NodeAction)

    async def uncordon_node(self, node_id: str, *, reason: str | None = None) -> NodeAction:
        """A cordoned or draining node takes placements again."""
        return decode(await self.call("admin/nodes/uncordon", _drop_none(nodeId=node_id, reason=reason)), NodeAction)

    async def drain_node(self, node_id: str, *, reason: str | None = None) -> NodeAction:
        """Cordon, and move the node's placed reservations that have not started to other nodes (or back to
        pending where nothing fits); active ones run to their end."""
        return decode(await self.call("admin/nodes/drain", _drop_none(nodeId=node_id, reason=reason)), NodeAction)

    async def clear_node(self, node_id: str, *, reason: str | None = None) -> NodeAction:
        """A node in maintenance becomes ready."""
        return decode(await self.call("admin/nodes/clear", _drop_none(nodeId=node_id, reason=reason)), NodeAction)

    async def list_fleet_pools(self) -> builtins.list[AdminPool]:
        return decode((await self.call("admin/pools/list", {})).get("pools"), list[AdminPool])

    async def get_fleet_pool(self, pool_id: str) -> AdminPool:
        return decode((await self.call("admin/pools/get", {"poolId": pool_id})).get("pool"), AdminPool)

    async def list_tenants(self) -> builtins.list[AdminTenant]:
        return decode((await self.call("admin/tenants/list", {})).get("tenants"), list[AdminTenant])

    async def get_tenant(self, tenant_id: str) -> AdminTenant:
        return decode((await self.call("admin/tenants/get", {"tenantId": tenant_id})).get("tenant"), AdminTenant)

    async def list_fleet_events(self, *, after: int | None = None, limit: int | None = None) -> EventPage:
        """The operators' actions on nodes (node.cordoned, node.drained, ...), oldest first."""
        return decode(await self.call("admin/events/list", _drop_none(after=after, limit=limit)), EventPage)


def _window(start: str | int | datetime | None, until: str | int | datetime | None) -> dict[str, int]:
    return _drop_none(**{"from": None if start is None else parse_time(start),
                         "until": None if until is None else parse_time(until)})


