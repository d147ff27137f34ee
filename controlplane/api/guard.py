"""The connection guard: what the control plane's listeners do about slow, idle and too many clients.

aiohttp parses HTTP but has no header timeout and no connection cap of its
own. This module owns both, in front of aiohttp's RequestHandler:

- `Limits`: the three settings and their defaults (the one place they live;
  `berth controlplane serve` exposes them as flags). The request timeout
  bounds a request's headers from its first byte, and then its body
  (api/body.py reads `LIMITS` from the app).
- `GuardedSite`: a site whose listening socket hands each connection to a
  `GuardedConnection`, a thin protocol around the runner's RequestHandler
  that sees the connection open, bytes arrive and the connection close; with
  an SSL context it puts TLS in itself after the accept (loop.start_tls), so
  a handshake is counted and timed like a request's headers.
- `begin(request)` / `end(conn)`: called by the app's middleware when a
  request's headers are complete and when its handler is done; in between
  the connection is *busy* and is never closed by the guard (an agent's long
  poll of 30 s is a busy connection).
- `Guard`: the table of open connections. A connection that is not busy
  waits: idle (no byte of a request yet; closed after the idle timeout) or
  trickling (a request begun, headers incomplete; closed at the request
  timeout). At the cap, the connection that has waited longest is closed to
  admit a new one; if every connection is busy, the new one is refused
  (closed at once). Accept failures for want of file descriptors become one
  rate-limited log line instead of asyncio's traceback per attempt.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import resource
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = structlog.get_logger("berth.controlplane")

BACKLOG = 128  # the listen backlog; asyncio also accepts up to this many sockets per turn of its loop
# Descriptors kept free below the open-file limit: the database and its WAL, logs, the bootstrap file (64), and the
# sockets a burst holds beyond the cap before the guard sees them (one accept batch accepted but not yet handed over,
# one batch of closed connections not yet released by the loop). With 64 only, a flood of connections still ran into
# EMFILE (tests/controlplane/test_slow_clients.py).
FD_RESERVE = 64 + 2 * BACKLOG
LOG_EVERY_S = 10.0  # a repeated warning is written at most this often, with the count of those suppressed
_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class Limits:
    request_timeout_s: float = 10.0  # headers within this of a request's first byte; then the body within this
    idle_timeout_s: float = 30.0  # a connection with no request in progress is closed after this
    max_connections: int | None = None  # None: the soft RLIMIT_NOFILE less FD_RESERVE


LIMITS = web.AppKey("limits", Limits)


def open_file_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(limits: Limits) -> int:
    """The most connections to hold open; ValueError (saying what to change) when the open-file limit cannot hold
    them."""
    room = open_file_limit() - FD_RESERVE
    if limits.max_connections is None:
        if room < 16:
            raise ValueError(f"the open-file limit ({open_file_limit()}) leaves no room for connections after "
                             f"the {FD_RESERVE} kept free (the database, logs, bursts of accepts); raise it "
                             "(LimitNOFILE= in the unit, or ulimit -n)")
        return room
    if limits.max_connections < 1:
        raise ValueError("--max-connections: give at least 1")
    if limits.max_connections > room:
        raise ValueError(f"--max-connections {limits.max_connections}: the open-file limit is {open_file_limit()}, "
                         f"of which {FD_RESERVE} stay free (the database, logs, bursts of accepts), so at most {room} "
                         "connections fit; raise the limit (LimitNOFILE= in the unit, or ulimit -n) or give a "
                         "smaller value")
    return limits.max_connections


class RateLimitedLog:
    """A repeated event as one line at most every LOG_EVERY_S seconds; those held back are counted in a line
    written when the interval ends (`suppressed`: how many since the previous line)."""

    def __init__(self, event: str, level: str = "warning"):
        self.event = event
        self.level = level
        self.last = float("-inf")
        self.suppressed = 0
        self.fields: dict = {}
        self.summary: asyncio.TimerHandle | None = None

    def hit(self, **fields) -> None:
        now = time.monotonic()
        self.fields = fields
        if now - self.last >= LOG_EVERY_S:
            self._write(now)
            return
        self.suppressed += 1
        if self.summary is None:
            self.summary = asyncio.get_running_loop().call_later(self.last + LOG_EVERY_S - now, self._summarize)

    def _summarize(self) -> None:
        self.summary = None
        if self.suppressed:
            self._write(time.monotonic())

    def _write(self, now: float) -> None:
        getattr(log, self.level)(self.event, suppressed=self.suppressed, **self.fields)
        self.last, self.suppressed = now, 0


class GuardedConnection(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's handler and tells the guard what it sees. On a TLS site
    it is counted from its TCP accept, its handshake as a request begun (bounded by the request timeout, and the
    first to go at the cap): a listener that handed over connections only once their handshakes were done let
    any client hold descriptors beyond the cap with handshakes never finished, until the server had none left."""

    __slots__ = ("guard", "factory", "tls", "inner", "transport", "busy", "admitted", "started", "deadline", "timer",
                 "handshake", "early")

    def __init__(self, guard: "Guard", factory, tls: ssl.SSLContext | None = None):
        self.guard = guard
        self.factory = factory
        self.tls = tls
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request's headers are complete and its handler runs
        self.admitted = False
        self.started: float | None = None  # when the first byte of the pending request (or the handshake) came
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.handshake: asyncio.Task | None = None
        self.early: list[bytes] = []  # what the TLS layer decrypted before the handshake's waiter woke this up

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.guard.admit(self):
            transport.abort()
            return
        if self.tls is None:
            self._serve(transport)
            return
        transport.pause_reading()  # the ClientHello waits for the TLS layer start_tls puts in between
        self.guard.request_started(self)
        self.handshake = asyncio.ensure_future(self._handshake(transport))

    async def _handshake(self, transport) -> None:
        loop = self.guard.loop
        try:
            secured = await loop.start_tls(transport, self, self.tls, server_side=True,
                                           ssl_handshake_timeout=self.guard.limits.request_timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, RuntimeError):
            self.guard.drop(self)  # a failed handshake, or one closed by the guard: no connection_lost comes
            transport.abort()
            return
        if not self.admitted or secured is None:  # closed meanwhile
            if secured is not None:
                secured.abort()
            return
        self.transport = secured
        self.started = None
        self.guard.waiting.move_to_end(self)  # its wait for a request starts now
        self.arm(loop.time() + self.guard.limits.idle_timeout_s)
        self._serve(secured)

    def _serve(self, transport) -> None:
        self.inner = self.factory()
        self.inner.connection_made(transport)
        early, self.early = self.early, []
        for data in early:  # a request sent right behind the handshake
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            if self.handshake is not None and self.admitted:
                self.early.append(data)
            return
        if self.started is None and not self.busy:
            self.guard.request_started(self)
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        self.guard.drop(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # the one timer of a connection: moved later lazily, fired only at the earliest deadline
    def arm(self, deadline: float | None) -> None:
        self.deadline = deadline
        if deadline is not None and (self.timer is None or self.timer.when() > deadline):
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.guard.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if self.deadline is None or not self.admitted:
            return
        if self.guard.loop.time() < self.deadline:
            self.timer = self.guard.loop.call_at(self.deadline, self._expire)
            return
        self.guard.expired(self)


class Guard:
    """The open connections of every guarded site of one process, under one cap."""

    def __init__(self, limits: Limits, cap: int, loop: asyncio.AbstractEventLoop | None = None):
        self.limits = limits
        self.cap = cap
        self.loop = loop or asyncio.get_running_loop()
        self.open = 0
        self.waiting: OrderedDict[GuardedConnection, None] = OrderedDict()  # not busy, longest-waiting first
        self._evicted = RateLimitedLog("connection cap reached: closed the longest-waiting idle or slow connection "
                                       "to admit a new one; if this persists, raise the open-file limit and "
                                       "--max-connections")
        self._refused = RateLimitedLog("connection cap reached and every connection is handling a request: refused "
                                       "a new connection; raise the open-file limit and --max-connections")
        self._slow = RateLimitedLog("closed a connection whose request headers did not arrive within the request "
                                    "timeout", "info")
        self._accept = RateLimitedLog("cannot accept connections: out of file descriptors; asyncio retries every "
                                      "second. Raise the open-file limit (LimitNOFILE= in the unit, or ulimit -n) "
                                      "or lower --max-connections", "error")
        self._malformed = RateLimitedLog("refused a malformed HTTP request (answered 400)", "info")

    def filter(self, record: logging.LogRecord) -> bool:
        """A logging filter for aiohttp's server logger: a request its parser refused (a header too long, a control
        byte, a header twice that must be once) is the client's fault, answered 400 by aiohttp, and anyone can
        send one: one rate-limited line, not an error-level traceback each, which would let anybody fill the log.
        Everything else passes."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            self._malformed.hit(error=str(exc.message)[:200])
            return False
        return True

    def admit(self, conn: GuardedConnection) -> bool:
        if self.open >= self.cap:
            if not self.waiting:
                self._refused.hit(cap=self.cap)
                return False
            victim = next(iter(self.waiting))
            self.drop(victim)
            victim.transport.abort()
            self._evicted.hit(cap=self.cap)
        self.open += 1
        conn.admitted = True
        self.waiting[conn] = None
        conn.arm(self.loop.time() + self.limits.idle_timeout_s)
        return True

    def request_started(self, conn: GuardedConnection) -> None:
        conn.started = now = self.loop.time()
        conn.arm(now + self.limits.request_timeout_s)

    def begin(self, conn: GuardedConnection) -> None:
        conn.busy = True
        conn.started = None
        self.waiting.pop(conn, None)
        conn.arm(None)

    def end(self, conn: GuardedConnection) -> None:
        conn.busy = False
        if conn.admitted:
            self.waiting[conn] = None
            conn.arm(self.loop.time() + self.limits.idle_timeout_s)

    def expired(self, conn: GuardedConnection) -> None:
        if conn.started is not None:
            self._slow.hit(timeout_s=self.limits.request_timeout_s)
        self.drop(conn)
        conn.transport.abort()

    def drop(self, conn: GuardedConnection) -> None:
        """Forget a connection (closed, or about to be); safe to call twice."""
        if conn.admitted:
            conn.admitted = False
            self.open -= 1
            self.waiting.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The loop's exception handler: accept failures for want of descriptors are one rate-limited line."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FILES:
            self._accept.hit(error=exc.strerror, open_connections=self.open, open_file_limit=open_file_limit())
            return
        if isinstance(exc, ValueError) and "._start_serving(" in context.get("message", ""):
            return  # asyncio's retry after an accept failure, run after the listener closed (at shutdown): nothing lost
        loop.default_exception_handler(context)


def begin(request: web.Request) -> GuardedConnection | None:
    """Mark the request's connection busy (its headers are complete); None when it came through no guarded site."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if isinstance(conn, GuardedConnection):
        conn.guard.begin(conn)
        return conn
    return None


def end(conn: GuardedConnection | None) -> None:
    """The request's handler is done: its connection waits again (for the next request, under the idle timeout)."""
    if conn is not None:
        conn.guard.end(conn)


@web.middleware
async def track(request: web.Request, handler):
    """begin/end as a middleware, for apps other than the API (whose one middleware calls them itself)."""
    conn = begin(request)
    try:
        return await handler(request)
    finally:
        end(conn)


def host_in_url(host: str) -> str:
    """An IPv6 address in brackets, as a URL writes it (http://[::1]:8080)."""
    return f"[{host}]" if ":" in host else host


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through the guard (web.TCPSite would hand them to aiohttp directly).

    With an SSL context it serves TLS, put in per connection after the accept
    (GuardedConnection): the guard counts a connection from its accept, and a
    handshake must finish within the request timeout (a client that opens a
    connection and says nothing is closed like one whose headers trickle).
    """

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: Guard, backlog: int = BACKLOG,
                 ssl_context: ssl.SSLContext | None = None):
        super().__init__(runner, backlog=backlog, ssl_context=ssl_context)
        self._host, self._port, self._guard = host, port, guard

    @property
    def scheme(self) -> str:
        return "https" if self._ssl_context is not None else "http"

    @property
    def name(self) -> str:
        return f"{self.scheme}://{host_in_url(self._host)}:{self._port}"

    @property
    def url(self) -> str:
        """The bound address as a URL (scheme, host, port), once started."""
        host, port = self.address
        return f"{self.scheme}://{host_in_url(host)}:{port}"

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port), once started (port 0 picks a free one)."""
        return self._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]

    async def start(self) -> None:
        await super().start()
        factory = self._runner.server
        tls = self._ssl_context  # TLS is put in per connection (GuardedConnection), so the guard counts handshakes
        self._server = await asyncio.get_running_loop().create_server(
            lambda: GuardedConnection(self._guard, factory, tls), self._host, self._port, backlog=self._backlog,
            reuse_address=True)
