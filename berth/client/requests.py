"""What the client sends: the fields of a create (or a quote), defined once, and the values they take.

`ReservationRequest` is the one definition of a create's fields: the Python
client's keyword arguments, the JSON body (`to_body()`, each field's wire path
in its metadata) and the CLI's flags (berth/cli/parser.py reads the same
metadata) all come from it. Times are epoch ms, ISO 8601, `now`, `+1h` or datetimes; prices
Decimal or str, never float.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

from common import money
from common.money import parse_money
from common.times import iso


def new_idempotency_key(prefix: str = "py") -> str:
    """A fresh key for one intent: keep it across the retries of that intent, never across intents."""
    return f"{prefix}-{uuid.uuid4()}"


UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MS = timedelta(milliseconds=1)


def parse_duration_ms(text: str) -> int:
    """90m, 2h, 1d, 3600s or 500ms as milliseconds (a positive number with a unit)."""
    for unit in sorted(UNITS_MS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                value = Decimal(text[: -len(unit)])
            except InvalidOperation:
                break
            if value.is_finite() and value > 0:
                return int(value * UNITS_MS[unit])
            break
    raise ValueError(f"{text!r}: give a duration with a unit, e.g. 30m, 2h, 1d")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def parse_time(value: str | int | datetime, now: int | None = None) -> int:
    """Epoch milliseconds from epoch ms (int or digits), ISO 8601 (an offset-less time is UTC), `now`, or a time
    relative to now: `+30m`, `+1h`, `-2d` (any unit of parse_duration_ms).

    now: the moment `now` and relative times count from (default: the clock); one invocation passes one value, so
    every time it resolves, and every retry of the body they make, agrees.
    """
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
        if text == "now":
            return now_ms() if now is None else now
        if text[:1] in "+-" and text[1:2].isdigit():
            try:
                offset = parse_duration_ms(text[1:])
            except ValueError:
                raise ValueError(f"{value!r}: give a relative time with a unit, e.g. +30m, +1h, +2d") from None
            return (now_ms() if now is None else now) + (offset if text[0] == "+" else -offset)
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{value!r}: give now, a relative time (+30m, +1h, +2d), ISO 8601 "
                             "(2027-01-31T09:00:00Z) or epoch milliseconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (moment - _EPOCH) // _MS  # exact: no float rounding of the milliseconds


def iso_ms(ms: int) -> str:
    """Epoch ms as ISO 8601 UTC, with milliseconds only when there are any (parse_time reads it back exactly)."""
    return iso(ms, "when-any")


def price_text(value: Decimal | str | int) -> str:
    """A price for the wire: a string is sent as written, so it must already be the wire's money (common.money);
    a Decimal or int is written out in plain digits."""
    if isinstance(value, float):
        raise TypeError("prices are Decimal or str, never float")
    text = value if isinstance(value, str) else format(Decimal(value), "f") if isinstance(value, (Decimal, int)) else None
    if text is None or parse_money(text) is None:
        raise ValueError(f"{value!r} is not a price: give {money.RULE}")
    return text


def _f(wire: str, help: str, *, flag: str | None = None, metavar: str | None = None, kind: str = "plain",
       create_only: bool = False, default: Any = None):
    """A request field: its wire path (dotted for nested objects), CLI flag and help, and how its value is written."""
    return field(default=default, metadata={"wire": wire, "help": help, "flag": flag, "metavar": metavar, "kind": kind,
                                          "create_only": create_only})


@dataclass(frozen=True)
class ReservationRequest:
    """A create's (or a quote's) fields; None means "not given" (the server's default)."""

    pool_id: str = _f("poolId", "the pool (poolId)", flag="--pool", metavar="POOL", default="")
    gpu_model: str = _f("gpuModel", "the device class, e.g. H100_80GB", metavar="MODEL", default="")
    gpu_count: int | None = _f("gpuCount", "devices per node (GPUs, MIG instances or slots)", metavar="N")
    node_count: int | None = _f("nodeCount", "nodes in the gang (default 1)", metavar="N")
    sharing: str | None = _f("sharing", "must equal the pool's: exclusive, mig or slots")
    mig_profile: str | None = _f("migProfile", "MIG pools: the instance profile, e.g. 1g.10gb", metavar="PROFILE")
    start: str | int | datetime | None = _f("start", "now, +30m, +1h, ISO 8601 (UTC unless an offset is "
                                            "given) or epoch ms; absent: as soon as possible", metavar="TIME",
                                            kind="time")
    end: str | int | datetime | None = _f("end", "the window's end: +2h (from now), ISO 8601 or epoch ms",
                                          metavar="TIME", kind="time")
    duration_hours: float | None = _f("durationHours", "the window's length (durationHours)", flag="--hours",
                                      metavar="H")
    binding: str | None = _f("binding", "hold (default), node or kubernetes", metavar="KIND")
    vcpu: float | None = _f("resources.vcpu", "vcpu per node", metavar="N")
    memory_gib: float | None = _f("resources.memoryGiB", "memory per node, GiB", metavar="GIB")
    hugepages_1gi: int | None = _f("resources.hugepages1Gi", "1 GiB hugepages per node", flag="--hugepages",
                                   metavar="N")
    spot: bool | None = _f("spot", "spot: may be preempted")
    lease_seconds: int | None = _f("leaseSeconds", "renew within this many seconds (30 to 604800)", metavar="S")
    ssh_keys: tuple[str, ...] | None = _f("access.sshKeys", "binding node: an OpenSSH public key to log in with, as "
                                          "its line or a .pub file (repeat for up to 16)", flag="--ssh-key",
                                          metavar="KEY|FILE", kind="keys")
    quote_id: str | None = _f("quoteId", "the quote to hold the price to (quoteId)", flag="--quote",
                              metavar="QUOTE_ID", create_only=True)
    max_hourly_price: Decimal | str | None = _f("maxHourlyPrice", "refuse (NO_CAPACITY price_ceiling) above this "
                                                "running price per hour", metavar="USD", kind="price", create_only=True)
    wait_ms: int | None = _f("wait.timeoutMs", "hold the answer while pending, at most 30000", metavar="MS",
                             create_only=True)

    def to_body(self) -> dict[str, Any]:
        """The JSON body: given fields only, nested objects (resources, wait) built from the dotted wire paths."""
        body: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            kind = f.metadata["kind"]
            if kind == "time":
                value = parse_time(value)
            elif kind == "price":
                value = price_text(value)
            elif kind == "keys":
                value = list(value)
            *parents, leaf = f.metadata["wire"].split(".")
            target = body
            for p in parents:
                target = target.setdefault(p, {})
            target[leaf] = value
        return body

    def without_create_only(self) -> "ReservationRequest":
        """The same request as a quote takes it (no quote, price ceiling or wait)."""
        return ReservationRequest(**{f.name: getattr(self, f.name) for f in fields(self)
                                     if not f.metadata["create_only"]})


FIELDS = {f.name: f for f in fields(ReservationRequest)}
WIRE_TO_FIELD = {f.metadata["wire"]: f.name for f in fields(ReservationRequest)}


def create_body(pool_id: str, gpu_model: str, **given: Any) -> dict[str, Any]:
    """The JSON body of a create (or a quote) from its fields; TypeError names a field that is not one."""
    return ReservationRequest(pool_id, gpu_model, **given).to_body()
