"""The commands the tenant methods take: the domain's request plus what the wire adds to it.

Handlers build these from the wire (controlplane/schemas.py, one conversion)
and the services take nothing else, so no service knows the wire's shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable
from decimal import Decimal

from controlplane.domain.admission import CreateRequest


@dataclass(frozen=True, slots=True)
class Create:
    request: CreateRequest
    fingerprint: str  # of the canonical request, for idempotency (the wire's; see schemas.fingerprint_of)
    key: str | None = None  # the idempotency key; None: a fresh one (no retry can replay it)
    wait_ms: int = 0  # hold the answer this long while the reservation is pending
    quote_id: str | None = None
    max_hourly_price: Decimal | None = None
    # the fingerprints earlier releases stored for this request (schemas.earlier_fingerprints), computed only
    # where a key's stored one is not `fingerprint`
    earlier: Callable[[], tuple[str, ...]] = tuple


@dataclass(frozen=True, slots=True)
class Extend:
    reservation_id: str
    until: int | None = None
    by_ms: int | None = None


@dataclass(frozen=True, slots=True)
class ListQuery:
    scope: str = "mine"  # mine | all
    state: str | None = None
    pool_id: str | None = None
    limit: int = 50
    cursor: str | None = None
