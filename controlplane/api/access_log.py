"""The access log: one structured line per request (`--access-log off|all|sample:N`), never a token.

A line carries method, path, status, duration_ms, and where known the
tenant, the principal and the reservation the request names. Sampling keeps
1 in N successful requests and every error (status 400 and above), so a busy
server logs little and a failing one is still visible. The line goes through
structlog like every other line, so the redaction step applies to it too;
it never reads headers, only the principal the middleware resolved.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import structlog
from aiohttp import web

log = structlog.get_logger("berth.access")
RESERVATION_ID = re.compile(rb'"reservationId"\s*:\s*"(rsv_[A-Za-z0-9]{1,64})"')


@dataclass
class AccessLog:
    every: int  # log 1 in `every` successful requests (1: all)
    _count: itertools.count = field(default_factory=itertools.count, repr=False)

    def wants(self, status: int) -> bool:
        return status >= 400 or next(self._count) % self.every == 0

    async def line(self, request: web.Request, response: web.StreamResponse, duration_s: float) -> None:
        status = response.status
        if not self.wants(status):
            return
        fields: dict = {"method": request.method, "path": request.path, "status": status,
                        "duration_ms": round(duration_s * 1000, 3)}
        principal = request.get("principal")
        if principal is not None:
            fields["principal"] = principal.id
            if principal.tenant_id:  # an operator of the whole fleet has none
                fields["tenant"] = principal.tenant_id
        elif request.get("admin"):
            fields["principal"] = "admin"  # the bootstrap file's admin token, named as node actions name it
        # The reservation the request names, else the one a create made (a list's answer names many: none is
        # logged for it): from the bytes already
        # there, the request's body only once the handler read it (it is cached then).
        sources = [await request.read()] if request.body_exists and not request.can_read_body else []
        if request.path.endswith("/reservations/create") and isinstance(getattr(response, "body", None), bytes):
            sources.append(response.body)
        for raw in sources:
            found = RESERVATION_ID.search(raw)
            if found:
                fields["reservation_id"] = found.group(1).decode()
                break
        log.info("request", **fields)


def parse(text: str) -> AccessLog | None:
    """`off` (None), `all`, or `sample:N` with N from 1 to 1,000,000."""
    if text == "off":
        return None
    if text == "all":
        return AccessLog(1)
    if text.startswith("sample:") and text[7:].isdigit() and 1 <= int(text[7:]) <= 1_000_000:
        return AccessLog(int(text[7:]))
    raise ValueError(f"--access-log: {text!r} is not off, all or sample:N (N from 1 to 1000000)")
