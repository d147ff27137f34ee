"""Connections to PostgreSQL for the PostgreSQL engine (store/postgres.py): asyncpg on a thread and event loop of
its own (`Connector`), a connection per session a replica holds (`SESSIONS`), each with the settings every session
gets and the server run it reached (`Session.server`), backoff after a failure, and what to tell the operator when
one cannot be made (`cannot_connect`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import ssl
import sys
import threading
import time
import urllib.parse
from typing import Any, Awaitable

import asyncpg


# The sessions a replica holds on the database, by the role its application_name ends with (docs/scale-out.md sizes
# max_connections by them): the writer's, its speculative groups' reads and commits, the leader lock's, the
# listener's, one each, and committed reads' pool of READ_POOL. MIGRATE is open at start only, before any other.
WRITER, WRITER_READS, WRITER_COMMITS, LEADER, LISTEN = "writer", "writer reads", "writer commits", "leader", "listen"
SESSIONS = (WRITER, WRITER_READS, WRITER_COMMITS, LEADER, LISTEN)
READS, READ_POOL = "reads", 4
MIGRATE = "migrate"
STATEMENT_TIMEOUT_S = 30.0
UNREACHABLE = (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.CannotConnectNowError,
               asyncpg.AdminShutdownError, asyncio.TimeoutError, concurrent.futures.TimeoutError,
               asyncpg.InternalClientError)  # (the last: a connection the server ended, met mid-operation)
# The database refuses to write now, whatever is asked: read-only (a standby, or a demoted primary during a
# failover), out of disk or connections, an operator's shutdown or cancel, an I/O error. Met in a job's statement,
# the group is given up as for an unreachable database, not taken for a fault of the job.
REFUSING = (asyncpg.ReadOnlySQLTransactionError, asyncpg.InsufficientResourcesError,
            asyncpg.OperatorInterventionError, asyncpg.PostgresSystemError)
AWAY = (*UNREACHABLE, *REFUSING)  # either: PROVIDER_UNAVAILABLE naming the error, never a fault of Berth's


def cannot_connect(exc: BaseException, dsn: str = "") -> str:
    """Why a connection could not be made, and what to change: the error itself, then the advice its kind
    calls for (a certificate, a password, pg_hba.conf's refusal, an address that does not answer)."""
    said = f"{type(exc).__name__}: {exc}"
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        if "mismatch" in text:
            return (f"{said}; the server's certificate does not name the host in the URL: connect by a name (or "
                    "address) the certificate holds")
        return (f"{said}; the server's certificate is not signed by a CA the URL trusts: give "
                "sslrootcert=/path/to/ca.pem, the CA that signed it (with sslmode=verify-full)")
    if isinstance(exc, ssl.SSLError):
        return f"{said}; TLS with the server failed: check sslmode, sslrootcert, sslcert and sslkey in the URL"
    if isinstance(exc, asyncpg.InvalidPasswordError):
        return (f"{said}; check the password: PGPASSWORD, the passfile (PGPASSFILE, else ~/.pgpass of the user "
                "Berth runs as: a line host:port:database:user:password, mode 0600), or the URL's")
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        if "no encryption" in text:
            return (f"{said}; this server takes only TLS connections from here: give sslmode=verify-full and "
                    "sslrootcert=/path/to/ca.pem in the URL")
        return f"{said}; the server's pg_hba.conf lets no such connection in: its administrator adds a line for it"
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):  # met by the schema's first statement
        return (f"{said}; the user the URL names must own the database and Berth's tables in it: createdb -O USER "
                "(or ALTER DATABASE ... OWNER TO USER), and restore a dump as that user's (pg_restore --no-owner "
                "--role=USER)")
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return f"{said}; create the database first (createdb), or name an existing one in the URL"
    if isinstance(exc, FileNotFoundError):  # a file the URL names (sslrootcert, sslcert, sslkey), or a unix socket
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query) if dsn else {}
        gone = [f"{key}={query[key][0]}" for key in ("sslrootcert", "sslcert", "sslkey")
                if query.get(key) and not os.path.exists(query[key][0])]
        if gone:
            return f"{said}; the URL names a file that is not there: {', '.join(gone)}"
        return (f"{said}; no PostgreSQL socket is there: check the URL's host (a unix socket's directory) and port, "
                "and that PostgreSQL is running")
    return f"{said}; check the URL, that PostgreSQL is running there, and that the user may connect"


SERVER_SETTINGS = {"jit": "off", "idle_in_transaction_session_timeout": "60000",
                   # a replica killed with -9 on another host: its session (and its leader lock) ends within ~20 s
                   "tcp_keepalives_idle": "10", "tcp_keepalives_interval": "3", "tcp_keepalives_count": "3"}


class Session(asyncpg.Connection):
    """A connection that knows which run of which server it reached (its postmaster's start time). The writer's
    memory is valid only on the run it was read from: a standby promoted after an asynchronous failover may lack
    the last commits the old primary acknowledged, and its own commits then reuse their generations."""

    __slots__ = ("server",)


class Connector:
    """asyncpg's own thread and event loop; the store's synchronous calls wait on it, its async ones do not."""

    def __init__(self, dsn: str, application: str):
        self.dsn = dsn
        self.application = application
        # Each reply from the database wakes this thread, which must then take the GIL from the API's thread:
        # at CPython's default switch interval (5 ms) every round trip of a busy replica would wait that long.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="berth-store-pg", daemon=True)
        self._thread.start()
        self._backoff = 0.0
        self._next_try = 0.0
        self.closed = False

    def submit(self, coro: Awaitable[Any]) -> "concurrent.futures.Future[Any]":
        if self.closed:
            coro.close()  # type: ignore[attr-defined]
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(ConnectionError("the store is closed"))
            return failed
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def run(self, coro: Awaitable[Any], timeout: float = STATEMENT_TIMEOUT_S) -> Any:
        """Wait for coro on the database's thread: at most timeout, and not at all once the store is closed."""
        fut = self.submit(coro)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(min(0.5, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    fut.cancel()
                    raise ConnectionError("the store is closed") from None
                if time.monotonic() >= deadline:
                    fut.cancel()
                    raise

    async def connect(self, role: str, **settings: str) -> Session:
        """A new connection, or UNREACHABLE at once while the backoff after a failure lasts (0.1 s doubling to 5 s)."""
        if role not in SESSIONS and role != MIGRATE:  # a session the sizing of max_connections does not count
            raise ValueError(f"session {role!r} is not one of SESSIONS: list it there and in docs/scale-out.md")
        now = time.monotonic()
        if now < self._next_try:
            raise ConnectionError(f"the database is unreachable; next attempt in {self._next_try - now:.1f} s")
        conn = None
        try:
            conn = await asyncpg.connect(self.dsn, timeout=5, statement_cache_size=256, connection_class=Session,
                                         server_settings={**SERVER_SETTINGS, **settings,
                                                          "application_name": f"{self.application} {role}"})
            conn.server = await conn.fetchval("SELECT pg_postmaster_start_time()", timeout=5)
        except UNREACHABLE:
            if conn is not None:
                conn.terminate()
            self._backoff = min(5.0, max(0.1, self._backoff * 2))
            self._next_try = time.monotonic() + self._backoff
            raise
        self._backoff = 0.0
        return conn

    def close(self) -> None:
        self.closed = True

        async def shut() -> None:  # whatever still waits on the database answers now (cancelled), then stop
            for _ in range(3):  # a cancelled query starts asyncpg's own cancel request: let that finish too
                tasks = asyncio.all_tasks(self.loop) - {asyncio.current_task()}
                if not tasks:
                    break
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks, timeout=2)
            self.loop.stop()

        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(shut()))
        self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()
