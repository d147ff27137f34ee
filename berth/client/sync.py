"""The sync client: the same methods as AsyncClient, each run on the client's private event loop.

One code path for the request, the retries and the reading of the answer:
every method is the async one, blocking.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Awaitable, Callable, Concatenate, Coroutine, ParamSpec, TypeVar

from berth.client.aio import AsyncClient
from berth.client.config import Settings

T = TypeVar("T")
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
        self._async = AsyncClient(url, token, **kw)  # first: a bad url raises ConfigError before a loop exists
        self._loop = asyncio.new_event_loop()

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> "Client":
        """A client for these settings; tls.TlsError (a ValueError) when their TLS files cannot be used."""
        if "ssl_context" not in kw:
            kw["ssl_context"] = settings.tls_context()
        return cls(settings.url, settings.token, **kw)

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def last_answer(self) -> dict:
        """The document of the last call answered, as the API sent it (fields this client does not read too)."""
        return self._async.last_answer

    def __repr__(self) -> str:  # never the token
        return f"Client(url={self.url!r}, retries={self._async.retries}, timeout={self._async.timeout:g})"

    def _run(self, coro: Awaitable[T]) -> T:
        if self._loop.is_closed():
            getattr(coro, "close", lambda: None)()  # never run: no "coroutine was never awaited" warning
            raise RuntimeError("this Client is closed: make a new one (or use `with Client(...) as c:`)")
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
    get = _blocking(AsyncClient.get)
    list = _blocking(AsyncClient.list)
    release = _blocking(AsyncClient.release)
    cancel = _blocking(AsyncClient.cancel)
    extend = _blocking(AsyncClient.extend)
    renew = _blocking(AsyncClient.renew)
    quote = _blocking(AsyncClient.quote)
    get_operation = _blocking(AsyncClient.get_operation)
    wait_operation = _blocking(AsyncClient.wait_operation)
    wait_until_done = _blocking(AsyncClient.wait_until_done)
    list_usage = _blocking(AsyncClient.list_usage)
    list_events = _blocking(AsyncClient.list_events)
    last_event_cursor = _blocking(AsyncClient.last_event_cursor)
    list_confirmations = _blocking(AsyncClient.list_confirmations)
    get_confirmation = _blocking(AsyncClient.get_confirmation)
    approve_confirmation = _blocking(AsyncClient.approve_confirmation)
    deny_confirmation = _blocking(AsyncClient.deny_confirmation)
    list_pools = _blocking(AsyncClient.list_pools)
    get_pool = _blocking(AsyncClient.get_pool)
    whoami = _blocking(AsyncClient.whoami)
    release_node_identity = _blocking(AsyncClient.release_node_identity)
    list_nodes = _blocking(AsyncClient.list_nodes)
    get_node = _blocking(AsyncClient.get_node)
    cordon_node = _blocking(AsyncClient.cordon_node)
    uncordon_node = _blocking(AsyncClient.uncordon_node)
    drain_node = _blocking(AsyncClient.drain_node)
    clear_node = _blocking(AsyncClient.clear_node)
    list_fleet_pools = _blocking(AsyncClient.list_fleet_pools)
    get_fleet_pool = _blocking(AsyncClient.get_fleet_pool)
    list_tenants = _blocking(AsyncClient.list_tenants)
    get_tenant = _blocking(AsyncClient.get_tenant)
    list_fleet_events = _blocking(AsyncClient.list_fleet_events)
