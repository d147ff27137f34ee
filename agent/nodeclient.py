"""The agent's side of the node API: register, heartbeat, watch, report over HTTP (docs/node-api.md).

One `NodeClient` per agent holds the node token once registered. Errors come
back as one of three: `Unauthorized` (401: the token is no longer valid,
register again), `NodeApiError` (any other error envelope, with its code), and
`Unreachable` (no answer: connection refused, reset, timed out), which the
runtime answers with backoff. The session may be shared (the fleet bench
runs a thousand clients on one). An https:// control plane is verified with
`ssl_context` (common/tls.py: --ca-file, and --client-cert/--client-key for
mutual TLS; None: the system trust store); a failed handshake is Unreachable
too, its message saying what to change.
"""
from __future__ import annotations

import asyncio
import ssl
from typing import TypeVar

import aiohttp
import msgspec

from agent.errors import AgentError
from common import tls
from common.inventory import Inventory
from common.nodewire import (MACHINE_ID_HEADER, ErrorEnvelope, HeartbeatAnswer, HeartbeatRequest, RegisterAnswer, RegisterRequest, Report,
                             ReportAnswer, ReportRequest, WatchAnswer, WatchRequest, encode)

T = TypeVar("T")
MAX_WATCH_MS = 30_000


class NodeApiError(AgentError):
    def __init__(self, method: str, status: int, code: str, message: str) -> None:
        super().__init__(f"node API {method}: HTTP {status} {code}: {message}")
        self.method = method
        self.status = status
        self.code = code


class Unauthorized(NodeApiError):
    """The token was refused: the node token was replaced (another register) or the bootstrap token is wrong."""


class Unreachable(AgentError):
    """The control plane did not answer; `tls` says what to change when a TLS handshake failed (or likely did)."""

    def __init__(self, message: str, tls: str | None = None) -> None:
        super().__init__(message + (f"; {tls}" if tls else ""))
        self.tls = tls


class NodeClient:
    def __init__(self, base_url: str, *, session: aiohttp.ClientSession | None = None,
                 timeout_s: float = 10.0, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True  # True: aiohttp's default
        self._session = session
        self._own_session = session is None
        self.timeout_s = timeout_s
        self.token = token
        self.machine_id = ""  # this host's /etc/machine-id, sent with every call

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8))
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, body: msgspec.Struct, answer: type[T], *, token: str | None,
                    timeout_s: float | None = None) -> T:
        url = f"{self.base_url}/api/nodes/{method}"
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if self.machine_id:  # the control plane refuses a node token used from another host (a copied state dir)
            headers[MACHINE_ID_HEADER] = self.machine_id
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self.session.post(url, data=encode(body), headers=headers, timeout=timeout,
                                         ssl=self.ssl) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            advice = tls.explain(exc, self.base_url, disconnected=isinstance(exc, aiohttp.ServerDisconnectedError))
            raise Unreachable(f"node API {method} at {url}: {type(exc).__name__}: {exc}", advice) from None
        if status >= 400:
            try:
                err = msgspec.json.decode(raw, type=ErrorEnvelope).error
            except (msgspec.DecodeError, msgspec.ValidationError):
                # not the control plane's error document: a load balancer or a proxy answered (a 404 page while
                # it reloads, a 502): nothing was decided, so nothing is dropped or registered again; try later
                raise Unreachable(f"node API {method} at {url}: HTTP {status} without the control plane's error "
                                  f"document (a proxy or load balancer answered?): "
                                  f"{raw[:200].decode(errors='replace')!r}") from None
            cls = Unauthorized if status == 401 else NodeApiError
            raise cls(method, status, err.code, err.message)
        try:
            return msgspec.json.decode(raw, type=answer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise NodeApiError(method, status, "BAD_ANSWER", f"{exc}: {raw[:200]!r}") from None

    async def register(self, bootstrap_token: str, hostname: str, inventory: Inventory, agent_version: str,
                       machine_id: str = "") -> RegisterAnswer:
        ans = await self._call("register", RegisterRequest(hostname, inventory, agent_version, machine_id),
                               RegisterAnswer, token=bootstrap_token)
        self.token = ans.nodeToken
        return ans

    async def heartbeat(self, inventory: Inventory | None = None, agent_version: str = "") -> HeartbeatAnswer:
        return await self._call("heartbeat", HeartbeatRequest(inventory, agent_version), HeartbeatAnswer,
                                token=self.token)

    async def watch(self, resource_version: int, timeout_ms: int = 25_000) -> WatchAnswer:
        timeout_ms = max(0, min(timeout_ms, MAX_WATCH_MS))
        return await self._call("watch", WatchRequest(resource_version, timeout_ms), WatchAnswer, token=self.token,
                                timeout_s=timeout_ms / 1000 + self.timeout_s)

    async def report(self, reports: list[Report]) -> ReportAnswer:
        return await self._call("report", ReportRequest(tuple(reports)), ReportAnswer, token=self.token)

