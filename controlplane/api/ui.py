"""`GET /ui/` and its files: the calendar page (controlplane/ui/static), served as the package ships it.

Only the files found there at start are served (no path from the request
reaches the file system); each answer forbids framing and every source but
this server, so the page runs no script it did not ship.
"""
from __future__ import annotations

from aiohttp import web

from controlplane.domain.errors import NOT_FOUND, DomainError
from controlplane.ui import STATIC

TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _files() -> dict[str, tuple[bytes, str]]:
    return {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in sorted(STATIC.iterdir())
            if p.is_file() and p.suffix in TYPES}


def routes() -> list[web.RouteDef]:
    files = _files()

    async def page(request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("name") or "index.html"
        found = files.get(name)
        if found is None:
            raise DomainError(NOT_FOUND, f"no file {name!r} in the calendar page", {"field": "path"})
        body, content_type = found
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=HEADERS)

    async def to_slash(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/ui/")

    return [web.get("/ui", to_slash), web.get("/ui/", page), web.get("/ui/{name}", page)]
