"""How the CLI shows answers on a terminal: tables, key/value blocks, times and money."""
from __future__ import annotations

import time
from typing import Any, Sequence

from berth.cli.context import Context, request_command, same_command, without
from berth.client import Confirmation, Operation, Quote, Reservation, ReservationPage, Usage


def money_rate(value: Any) -> str:
    return f"${value}/hr"


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ms / 1000))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {'-' if v is None else v}" for k, v in pairs)


def _shape(r: Reservation) -> str:
    device = f"{r.gpu_model} {r.mig_profile}" if r.mig_profile else r.gpu_model
    count = f"{r.node_count} x {r.gpu_count}" if r.node_count > 1 else f"{r.gpu_count}"
    return f"{count} {device}"


def _op(op: Operation | None) -> str | None:
    if op is None:
        return None
    text = f"{op.id} {op.kind} {op.status}"
    if op.failure is not None:
        text += f" ({op.failure.actor}: {op.failure.code})"
    return text


def render_reservation(r: Reservation) -> str:
    pairs: list[tuple[str, Any]] = [
        ("reservation", r.id), ("state", r.state + (f" ({r.reason})" if r.reason else "")),
        ("pool", f"{r.pool_id} ({r.region})"), ("gpus", _shape(r)), ("binding", r.binding + (", spot" if r.spot else "")),
        ("start", when(r.start) if r.start is not None else "as soon as placed"),
        ("end", when(r.end) if r.end is not None else f"{r.duration_hours:g} h after start"),
        ("resources", f"{r.resources.vcpu:g} vcpu, {r.resources.memory_gib:g} GiB, {r.resources.hugepages_1gi} x 1 GiB hugepages"
         if r.resources.vcpu is not None else None),
    ]
    if r.lease_seconds is not None:
        pairs.append(("lease", f"{r.lease_seconds} s, renew by {when(r.lease_deadline)}"))
    if r.placements:
        pairs.append(("placed on", ", ".join(f"{p.node_id}[{','.join(p.devices)}]" for p in r.placements)))
    for c in r.conditions:
        pairs.append(("condition", f"{c.type}={c.status} {c.reason}: {c.message}"))
    pairs.append(("operation", _op(r.operation)))
    if r.operation is not None and r.operation.failure is not None:
        pairs.append(("failure", r.operation.failure.message))
        if r.operation.failure.next:
            pairs.append(("what to do", r.operation.failure.next))
    return fields(pairs)


def render_list(page: ReservationPage, ctx: Context, argv: Sequence[str]) -> str:
    if not page.reservations:
        return "no reservations"
    rows = [(r.id, r.state, r.pool_id, _shape(r), when(r.start), when(r.end), _op(r.operation))
            for r in page.reservations]
    text = table(("ID", "STATE", "POOL", "GPUS", "START", "END", "OPERATION"), rows)
    if page.next_cursor:
        text += f"\nmore: {same_command(ctx, [*without(argv, '--cursor'), '--cursor', page.next_cursor])}"
    return text


def render_quote(q: Quote, ctx: Context) -> str:
    pairs: list[tuple[str, Any]] = [
        ("quote", q.id), ("expires", when(q.expires_at)), ("pool", f"{q.pool_id} ({q.region})"),
        ("gpus", f"{q.node_count} x {q.gpu_count} {q.gpu_model}" if q.node_count > 1 else f"{q.gpu_count} {q.gpu_model}"),
        ("price", f"{money_rate(q.total_running_usd_per_hour)} {q.currency}"),
        ("window", f"{q.window_hours:g} h, at most {q.total_usd} {q.currency}" if q.window_hours is not None else None),
        ("fits", "now" if q.fits_now else (f"from {when(q.earliest_start)}" if q.earliest_start else "not within a year")),
    ]
    for alt in q.alternatives:
        pairs.append(("alternative", f"pool {alt.pool_id} ({alt.region}) at {money_rate(alt.total_running_usd_per_hour)}"))
    text = fields(pairs)
    return text + "\nnext: " + request_command(ctx, "create", {"quote_id": q.id})


def render_operation(op: Operation) -> str:
    pairs: list[tuple[str, Any]] = [("operation", op.id), ("kind", op.kind), ("status", op.status),
                                    ("reservation", op.reservation_id), ("created", when(op.created_at)),
                                    ("updated", when(op.updated_at))]
    if op.failure is not None:
        pairs += [("failure", f"{op.failure.code} (actor {op.failure.actor})"), ("message", op.failure.message),
                  ("what to do", op.failure.next)]
    return fields(pairs)


def render_usage(u: Usage, ctx: Context, argv: Sequence[str]) -> str:
    rows = [(line.day, line.reservation_id, line.pool_id, line.seconds, money_rate(line.hourly_usd), f"${line.amount_usd}",
             "yes" if line.running else "") for line in u.lines]
    parts = [table(("DAY", "RESERVATION", "POOL", "SECONDS", "RATE", "AMOUNT", "RUNNING"), rows) if rows
             else "no usage lines"]
    parts.append(fields([("page total", f"${u.page_total_usd}"), ("total", f"${u.total_usd}")]))
    if u.by_reservation:
        parts.append(table(("RESERVATION", "TOTAL"), [(t.reservation_id, f"${t.total_usd}") for t in u.by_reservation]))
    if u.next_cursor:
        parts.append(f"more: {same_command(ctx, [*without(argv, '--cursor'), '--cursor', u.next_cursor])}")
    return "\n\n".join(parts)


def render_confirmation(c: Confirmation) -> str:
    return fields([("confirmation", c.id), ("status", c.status), ("agent", c.agent_id), ("approver", c.approver),
                   ("expires", when(c.expires_at)), ("decided", when(c.decided_at)), ("asked", c.message)])


