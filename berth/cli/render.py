"""How the CLI shows answers on a terminal: tables, key/value blocks, times and money."""
from __future__ import annotations

import json
import time
from typing import Any, Sequence

from berth.cli.context import Context, request_command, same_command, without
from berth.client import (AdminNode, AdminPool, AdminTenant, Confirmation, Event, NodeAction, NodeBooking, OfferedPool,
                          Operation, Quote, Reservation, ReservationPage, Resources, Usage, Whoami)


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
    for b in r.bound:  # what each node made of it: the cgroup the work runs in, the device nodes it may open
        pairs.append(("bound", f"{b.node_id}: cgroup {b.cgroup or '-'}, devices {', '.join(b.devices) or '-'}"))
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
        ("fits", ("now" if q.fits_now else (f"from {when(q.earliest_start)}" if q.earliest_start else
                  "not within a year, or behind the pool's queue"))
         + (f", by preempting {q.preempts_spot} spot reservation(s)" if q.preempts_spot else "")),
    ]
    if q.confirmation is not None and q.confirmation.required:
        pairs.append(("confirmation", f"the create waits until {q.confirmation.approver} approves it"))
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




def raised_notes(args: Any, booked: Resources) -> list[str]:
    """What the request asked below the per-GPU share and got raised to it (the share is the floor)."""
    notes = []
    for flag, asked, got, unit in (("--vcpu", getattr(args, "vcpu", None), booked.vcpu, ""),
                                   ("--memory-gib", getattr(args, "memory_gib", None), booked.memory_gib, " GiB")):
        if asked is not None and got is not None and got > asked:
            notes.append(f"note: {flag} {asked:g} raised to the per-GPU share of {got:g}{unit} per node "
                         "(the GPUs bring that much of their host; it is not charged to quota)")
    return notes


def _pool_shape(p: OfferedPool) -> str:
    if p.sharing == "mig":
        return ", ".join(f"{m.units} x {m.profile}" for m in p.mig_profiles or []) or "no MIG instances"
    if p.sharing == "slots":
        return f"{p.slots_per_gpu} slots per GPU"
    share = p.per_gpu or {}
    return f"per GPU {share.get('vcpu', 0):g} vCPU, {share.get('memoryGiB', 0):g} GiB"


def _free(p: OfferedPool) -> str:
    text = f"{p.free_now}/{p.units}"
    if p.next_change is not None:
        text += f", {p.next_change.units} from {when(p.next_change.at)}"
    return text


def render_offered_pools(pools: Sequence[OfferedPool]) -> str:
    if not pools:
        return "no pools: your tenant owns none and is offered none; ask the operator"
    return table(("POOL", "REGION", "MODEL", "SHARING", "SHAPE", "BINDINGS", "PRICE/GPU-H", "NODES", "FREE NOW/TOTAL"),
                 [(p.id, p.region, p.gpu_model, p.sharing, _pool_shape(p), ",".join(p.bindings),
                   money_rate(p.price_per_gpu_hour_usd), " ".join(f"{s.nodes}x{s.gpus}" for s in p.node_sizes) or "0",
                   _free(p)) for p in pools])


def render_offered_pool(p: OfferedPool) -> str:
    steps = "; ".join(f"{s.units} from {when(s.at)}" for s in p.free)
    return fields([("pool", p.id), ("region", p.region), ("model", p.gpu_model), ("sharing", p.sharing),
                   ("yours", "owned" if p.owned else "offered to your tenant"), ("shape", _pool_shape(p)),
                   ("bindings", ", ".join(p.bindings)), ("price", money_rate(p.price_per_gpu_hour_usd) + " per GPU"),
                   ("nodes", ", ".join(f"{s.nodes} of {s.gpus} GPUs" for s in p.node_sizes) or "none"),
                   ("free now", _free(p)), ("free over the window", steps)])


def render_whoami(w: Whoami) -> str:
    return fields([("principal", w.id), ("tenant", w.tenant_id), ("kind", w.kind),
                   ("acting for", w.delegated_by), ("scope", w.scope)])


EVENT_COLUMNS = (6, 24, 30, 28, 10)  # SEQ, AT, RESERVATION, EVENT, STATE: fixed, so --follow's rows line up


def render_events(events: Sequence[Event], header: bool = True) -> str:
    """Events as rows of fixed columns (SEQ AT RESERVATION EVENT STATE DETAILS): the same with one row at a time."""
    def row(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, EVENT_COLUMNS)) + "  " + cells[-1]

    lines = [row(("SEQ", "AT", "RESERVATION", "EVENT", "STATE", "DETAILS"))] if header else []
    for e in events:
        details = " ".join(f"{k}={_detail(k, v)}" for k, v in e.data.items() if k not in ("state", "poolId"))
        lines.append(row((e.seq, when(e.at), e.reservation_id or "-", e.type, e.data.get("state", ""), details)))
    return "\n".join(line.rstrip() for line in lines)


def _detail(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and key in ("end", "start", "until", "at", "expiresAt"):
        return when(value)
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


# ---- the operator's (berth admin ...) ----------------------------------------------------------------------------

def ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _booking(b: NodeBooking) -> str:
    marks = "".join(m for m, on in ((" spot", b.spot), (" carried-on", b.carried_on)) if on)
    return f"{b.reservation_id} ({b.tenant_id} {b.state}{marks})"


def now_and_next(node: AdminNode) -> tuple[str, str]:
    """The bookings that run now, and the next one to start."""
    current = [b for b in node.bookings if b.current]
    started = max((b.start for b in current), default=time.time() * 1000)
    upcoming = [b for b in node.bookings if not b.current and b.start >= started]
    now = ", ".join(_booking(b) for b in current) if current else "-"
    nxt = f"{when(upcoming[0].start)} {_booking(upcoming[0])}" if upcoming else "-"
    return now, nxt


def render_nodes(nodes: Sequence[AdminNode]) -> str:
    if not nodes:
        return "no nodes"
    rows = []
    for n in nodes:
        now, nxt = now_and_next(n)
        rows.append((n.id, n.pool_id, n.state, n.agent_version or ("declared" if n.declared else "-"),
                     ago(n.heartbeat_age_seconds), n.inventory.gpus, now, nxt))
    return table(("NODE", "POOL", "STATE", "AGENT", "HEARTBEAT", "GPUS", "NOW", "NEXT"), rows)


def render_node(n: AdminNode) -> str:
    inv = n.inventory
    state = n.state or "-"
    if n.admin_state and n.admin_state != n.state:
        state += f" (set: {n.admin_state})"
    pairs: list[tuple[str, Any]] = [
        ("node", n.id), ("pool", n.pool_id), ("hostname", n.hostname), ("state", state),
        ("placements", "taken" if n.placeable else "none (not ready)"),
        ("agent", n.agent_version or ("none yet: declared in the bootstrap file" if n.declared else "-")),
        ("heartbeat", f"{n.last_heartbeat} ({ago(n.heartbeat_age_seconds)})" if n.last_heartbeat else "never"),
        ("inventory", f"{inv.gpus} GPU ({inv.units} devices), {inv.vcpu:g} vcpu, {inv.memory_gib:g} GiB, "
                      f"{inv.hugepages_1gi} x 1 GiB hugepages"),
        ("machine id", n.machine_id or "-"), ("identity released", "yes" if n.identity_released else "no"),
        ("drained", "yes" if n.drained else "no"),
    ]
    if inv.mig_profiles:
        pairs.insert(8, ("MIG", ", ".join(f"{count} x {p}" for p, count in sorted(inv.mig_profiles.items()))))
    text = fields(pairs)
    if n.bookings:
        text += "\n\n" + table(("RESERVATION", "TENANT", "STATE", "BINDING", "START", "END", "DEVICES", ""),
                               [(b.reservation_id, b.tenant_id, b.state, b.binding + (", spot" if b.spot else ""),
                                 when(b.start), when(b.end), ",".join(b.devices),
                                 ("now" if b.current else "") + (" carried on" if b.carried_on else ""))
                                for b in n.bookings])
    else:
        text += "\n\nno bookings in the window"
    return text


def render_node_action(action: str, r: NodeAction) -> str:
    n = r.node
    if r.changed:
        head = f"node {n.id}: {action} done, now {n.admin_state}"
    else:
        head = f"node {n.id}: already {n.admin_state}, nothing changed"
    lines = [head]
    for m in r.moved:
        lines.append(f"moved {m.reservation_id} ({m.tenant_id}) from {', '.join(m.from_nodes)} to {', '.join(m.nodes)}")
    for rid in r.pending:
        lines.append(f"back to pending (no other node fits it): {rid}")
    now, nxt = now_and_next(n)
    lines.append(f"bookings now: {now}")
    lines.append(f"next booking: {nxt}")
    return "\n".join(lines)


def _nodes_by_state(counts: dict[str, int]) -> str:
    return ", ".join(f"{c} {s}" for s, c in counts.items() if c) or "none"


def render_pools(pools: Sequence[AdminPool]) -> str:
    if not pools:
        return "no pools"
    return table(("POOL", "OWNER", "REGION", "MODEL", "SHARING", "PRICE", "NODES", "GPUS FREE/TOTAL", "IN USE", "PENDING"),
                 [(p.id + (" (archived)" if p.archived else ""), p.owner, p.region, p.gpu_model, p.sharing,
                   money_rate(p.price_per_gpu_hour_usd), _nodes_by_state(p.nodes), f"{p.gpus.free}/{p.gpus.total}",
                   p.gpus.booked, p.pending) for p in pools])


def render_pool(p: AdminPool) -> str:
    pairs: list[tuple[str, Any]] = [
        ("pool", p.id), ("owner", p.owner), ("region", p.region), ("model", p.gpu_model), ("sharing", p.sharing),
        ("price", money_rate(p.price_per_gpu_hour_usd)), ("placer", p.placer), ("archived", "yes" if p.archived else "no"),
        ("nodes", _nodes_by_state(p.nodes)),
        ("GPUs", f"{p.gpus.total} total, {p.gpus.booked} in use now, {p.gpus.free} free on ready nodes"),
        ("devices", f"{p.units.total} total, {p.units.booked} in use now, {p.units.free} free on ready nodes"),
        ("pending", p.pending),
    ]
    return fields(pairs)


def _usage(t: AdminTenant) -> list[tuple[str, str, str]]:
    keys = sorted(set(t.quota) | set(t.used))
    return [(k, f"{t.used.get(k, 0):g}", f"{t.quota[k]:g}" if k in t.quota else "none") for k in keys]


def render_tenants(tenants: Sequence[AdminTenant]) -> str:
    if not tenants:
        return "no tenants"
    rows = []
    for t in tenants:
        used = ", ".join(f"{k} {u}/{q}" for k, u, q in _usage(t) if u != "0") or "-"
        rows.append((t.id, f"${t.budget_usd}" if t.budget_usd is not None else "none", f"${t.spent_usd}",
                     f"${t.committed_usd}", sum(t.reservations.values()), used))
    return table(("TENANT", "BUDGET", "SPENT", "COMMITTED", "LIVE", "QUOTA USED/LIMIT"), rows)


def render_tenant(t: AdminTenant) -> str:
    text = fields([("tenant", t.id), ("budget", f"${t.budget_usd}" if t.budget_usd is not None else "none"),
                   ("spent", f"${t.spent_usd}"), ("committed", f"${t.committed_usd} (live reservations, to their end)"),
                   ("live", ", ".join(f"{c} {s}" for s, c in t.reservations.items()) or "none")])
    return text + "\n\n" + table(("QUOTA", "USED", "LIMIT"), _usage(t))
