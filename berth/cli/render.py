"""How the CLI shows answers on a terminal: tables, key/value blocks, times and money."""
from __future__ import annotations

import json
import re
import shlex
import textwrap
import time
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Sequence

from berth.cli.context import Context, request_command, same_command, times_resolved, without
from berth.client import (AdminNode, AdminPool, AdminTenant, Condition, Confirmation, Event, NodeAction, NodeBooking,
                          NodeCondition, OfferedPool, Operation, Quote, Reservation, ReservationPage, Resources, Usage,
                          Whoami, now_ms)
from common.times import iso

# ---- money and times, as people read them -------------------------------------------------------------------------

CENT = Decimal("0.01")


def money(value: Any) -> str:
    """$2.50: two decimals for people (the exact decimals stay in the JSON and in suggested commands)."""
    if value is None:
        return "-"
    return f"${Decimal(str(value)).quantize(CENT, ROUND_HALF_UP)}"


def money_rate(value: Any) -> str:
    return f"{money(value)}/hr"


def _span(seconds: float) -> str:
    """A span as people say it: 58 s, 12 min, 3 h, 2 d."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86_400:.0f} d"


def relative(ms: int, now: int | None = None) -> str:
    """`in 58 s`, `3 h ago`, or `now` (within a second)."""
    seconds = (ms - (now_ms() if now is None else now)) / 1000
    if abs(seconds) < 1:
        return "now"
    return f"in {_span(seconds)}" if seconds > 0 else f"{_span(-seconds)} ago"


def when(ms: int | None) -> str:
    """A moment for people: ISO 8601 UTC and how far it is from now, `2027-01-31T09:00:00Z (in 3 h)`; never epoch ms."""
    if ms is None:
        return "-"
    return f"{iso(ms, 'never')} ({relative(ms)})"


def ago(seconds: float | None) -> str:
    """An age in seconds (a heartbeat's) as `12 s ago`."""
    if seconds is None:
        return "never"
    return f"{_span(seconds)} ago" if seconds >= 1 else "now"


_EPOCH_MS = re.compile(r"(?<![\w:.-])1\d{12}(?![\w.])")  # 2001..2286 in epoch ms, standing as a word of its own


def humane(text: str) -> str:
    """A server's message with its epoch-ms times as when() writes them."""
    return _EPOCH_MS.sub(lambda m: when(int(m.group())), text)


# ---- tables ---------------------------------------------------------------------------------------------------------

MIN_COLUMN = 8  # a column fitted to the terminal keeps at least its header and this many characters


def _fit(widths: list[int], cells: Sequence[Sequence[str]], width: int) -> list[int]:
    """Narrow the widest column, one character at a time, until the row fits `width` (or nothing can narrow).

    In turn: columns of words (a cell with a space: times, operations, details) down to their longest word, so
    they wrap between words; then down to MIN_COLUMN, breaking words; only then the others (ids), so an id stays
    whole to copy unless nothing else can make the room.
    """
    widths = list(widths)
    headers, rows = cells[0], cells[1:]
    columns = range(len(headers))
    least = [max(len(h), MIN_COLUMN) for h in headers]
    worded = {i for i in columns if any(" " in r[i] for r in rows)}
    longest_word = [max([least[i]] + [len(w) for r in rows for w in r[i].split()]) for i in columns]
    for allowed, floors in ((worded, longest_word), (worded, least), (set(columns), least)):
        while sum(widths) + 2 * (len(widths) - 1) > width:
            narrowable = [i for i in allowed if widths[i] > floors[i]]
            if not narrowable:
                break
            widest = max(narrowable, key=lambda i: widths[i])
            widths[widest] -= 1
    return widths


def _lines_of_row(row: Sequence[str], widths: Sequence[int]) -> list[str]:
    """One row, its cells wrapped to their columns (a cell wider than its column continues on the next line)."""
    wrapped = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] if len(c) > w else [c] for c, w in zip(row, widths)]
    height = max(len(cell) for cell in wrapped)
    return ["  ".join((cell[i] if i < len(cell) else "").ljust(w) for cell, w in zip(wrapped, widths)).rstrip()
            for i in range(height)]


def column_widths(headers: Sequence[str], rows: Sequence[Sequence[Any]], at_least: Sequence[int] = ()) -> list[int]:
    """Each column as wide as its widest cell, and at least `at_least`."""
    cells = _cells(headers, rows)
    return [max([len(r[i]) for r in cells] + list(at_least[i:i + 1])) for i in range(len(headers))]


def _cells(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[list[str]]:
    return [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]


def layout(headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None,
           at_least: Sequence[int] = ()) -> list[int]:
    """The column widths `table` gives these rows: to print later rows under them (table(..., fixed=True))."""
    widths = column_widths(headers, rows, at_least)
    return _fit(widths, _cells(headers, rows), width) if width else widths


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, width: int | None = None, header: bool = True,
          at_least: Sequence[int] = (), fixed: bool = False) -> str:
    """Rows under their headers in columns as wide as their widest cell (at least `at_least`, so rows printed
    apart line up), then narrowed to the terminal's `width` by wrapping the widest column of words. `fixed` (rows
    printed one at a time, --follow, --watch): on a terminal every column is exactly its `at_least` and the last
    takes the rest of the width, whatever the row holds, so each row lines up under the header."""
    cells = _cells(headers, rows)
    if width and fixed:
        widths = [*at_least[:len(headers) - 1]]
        widths.append(max(MIN_COLUMN, width - sum(widths) - 2 * (len(headers) - 1)))
    else:
        widths = layout(headers, rows, width, at_least)
    return "\n".join(line for r in (cells if header else cells[1:]) for line in _lines_of_row(r, widths))


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


ENDED = frozenset({"released", "cancelled"})


def ended_at(r: Reservation) -> int | None:
    """When a released or cancelled reservation actually ended: its state changed then (endedAt; updatedAt from a
    control plane that does not send it), or its window ended first (a release by the reconciler at the end comes a
    moment after it)."""
    if r.state not in ENDED:
        return None
    changed = r.ended_at if r.ended_at is not None else r.updated_at
    return min((t for t in (r.end, changed) if t is not None), default=None)


def _end(r: Reservation) -> str:
    ended = ended_at(r)
    if ended is not None:
        return when(ended)
    return when(r.end) if r.end is not None else f"{r.duration_hours:g} h after start"


def condition_text(c: Condition | NodeCondition) -> str:
    """`DevicesBound=False BindFailed: node n1: ...`, as the API's conditions (a reservation's, a node's) read."""
    return f"{c.type}={c.status}" + (f" {c.reason}" if c.reason else "") + (f": {c.message}" if c.message else "")


def render_reservation(r: Reservation, wide: bool = False) -> str:
    ended = ended_at(r)
    pairs: list[tuple[str, Any]] = [
        ("reservation", r.id), ("state", r.state + (f" ({r.reason})" if r.reason else "")),
        ("pool", f"{r.pool_id} ({r.region})"), ("gpus", _shape(r)), ("binding", r.binding + (", spot" if r.spot else "")),
        ("start", when(r.start) if r.start is not None else "as soon as placed"),
        ("end", _end(r) + (f" (its window was to run until {when(r.end)})"
                           if ended is not None and r.end not in (None, ended) else "")),
        ("price", money_rate(r.hourly_usd) if r.hourly_usd is not None else None),
        ("resources", f"{r.resources.vcpu:g} vcpu, {r.resources.memory_gib:g} GiB, {r.resources.hugepages_1gi} x 1 GiB hugepages"
         if r.resources.vcpu is not None else None),
    ]
    if wide:
        pairs += [("principal", r.principal_id), ("tenant", r.tenant_id), ("created", when(r.created_at)),
                  ("updated", when(r.updated_at)), ("idempotency key", r.idempotency_key)]
    if r.lease_seconds is not None:  # an ended reservation has nothing left to renew
        pairs.append(("lease", f"{r.lease_seconds} s" + ("" if r.state in ENDED else
                                                         f", renew by {when(r.lease_deadline)}")))
    if r.placements:
        pairs.append(("placed on", ", ".join(f"{p.node_id}[{','.join(p.devices)}]" for p in r.placements)))
    for b in r.bound:  # what each node made of it: the cgroup the work runs in, the device nodes it may open
        if b.ssh is not None:  # a node binding: the whole host, reached over ssh
            login = shlex.join(["ssh", "-p", str(b.ssh.port), f"{b.ssh.user}@{b.ssh.host}"])
            keys = ", ".join(b.ssh.host_keys) or "none reported"
            pairs.append(("bound", f"{b.node_id}: log in with {login} (check its host key is one of: {keys})"))
            continue
        pairs.append(("bound", f"{b.node_id}: cgroup {b.cgroup or '-'}, devices {', '.join(b.devices) or '-'}"))
    for c in r.conditions:
        pairs.append(("condition", condition_text(c)))
    pairs.append(("operation", _op(r.operation)))
    if r.operation is not None and r.operation.failure is not None:
        pairs.append(("failure", r.operation.failure.message))
        if r.operation.failure.next:
            pairs.append(("what to do", r.operation.failure.next))
    return fields(pairs)


LIST_COLUMNS = ("ID", "STATE", "POOL", "GPUS", "START", "END", "OPERATION")
WIDE_COLUMNS = ("BINDING", "SPOT", "PRINCIPAL")


# The states a tenant's list shows: a watch's STATE column is made as wide as the longest, so that a row printed
# later (a reservation that became cancelled) lines up under the first table.
LISTED_STATES = ("pending", "placed", "binding", "active", "released", "cancelled")


def list_headers(wide: bool) -> tuple[str, ...]:
    return LIST_COLUMNS + (WIDE_COLUMNS if wide else ())


def list_row(r: Reservation, wide: bool) -> tuple[Any, ...]:
    """A reservation as a row of `reservations list` (END: when it ended, for a released or cancelled one)."""
    row: tuple[Any, ...] = (r.id, r.state, r.pool_id, _shape(r), when(r.start), _end(r), _op(r.operation))
    return row + ((r.binding, "yes" if r.spot else "no", r.principal_id) if wide else ())


def render_list(page: ReservationPage, ctx: Context, argv: Sequence[str]) -> str:
    if not page.reservations:
        return "no reservations"
    wide = ctx.wide
    text = table(list_headers(wide), [list_row(r, wide) for r in page.reservations], width=ctx.width)
    if page.next_cursor:
        text += f"\nmore: {same_command(ctx, [*without(argv, '--cursor'), '--cursor', page.next_cursor])}"
    return text


def render_quote(q: Quote, ctx: Context) -> str:
    pairs: list[tuple[str, Any]] = [
        ("quote", q.id), ("expires", when(q.expires_at)), ("pool", f"{q.pool_id} ({q.region})"),
        ("gpus", f"{q.node_count} x {q.gpu_count} {q.gpu_model}" if q.node_count > 1 else f"{q.gpu_count} {q.gpu_model}"),
        ("price", f"{money_rate(q.total_running_usd_per_hour)} {q.currency}"),
        ("window", f"{q.window_hours:g} h, at most {money(q.total_usd)} {q.currency}" if q.window_hours is not None else None),
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
    held = any(line.held for line in u.lines)  # a column of its own only where a kubernetes release was held
    rows = [(line.day, line.reservation_id, line.pool_id, line.seconds, money_rate(line.hourly_usd), money(line.amount_usd),
             "yes" if line.running else "", *(("yes" if line.held else "",) if held else ())) for line in u.lines]
    head = ("DAY", "RESERVATION", "POOL", "SECONDS", "RATE", "AMOUNT", "RUNNING", *(("HELD",) if held else ()))
    parts = [table(head, rows, width=ctx.width) if rows else "no usage lines"]
    parts.append(fields([("page total", money(u.page_total_usd)), ("total", money(u.total_usd))]))
    if u.by_reservation:
        parts.append(table(("RESERVATION", "TOTAL"), [(t.reservation_id, money(t.total_usd)) for t in u.by_reservation],
                           width=ctx.width))
    if u.next_cursor:
        again = times_resolved(ctx, without(argv, "--cursor"), {"--since": "since", "--until": "until"})
        parts.append(f"more: {same_command(ctx, [*again, '--cursor', u.next_cursor])}")
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


def render_offered_pools(pools: Sequence[OfferedPool], width: int | None = None, at_from: bool = False) -> str:
    """at_from: the window starts at --from, not now (the first step's free count is then free at its start)."""
    if not pools:
        return "no pools: your tenant owns none and is offered none; ask the operator"
    free = "FREE AT FROM/TOTAL" if at_from else "FREE NOW/TOTAL"
    return table(("POOL", "REGION", "MODEL", "SHARING", "SHAPE", "BINDINGS", "PRICE/GPU-H", "NODES", free),
                 [(p.id, p.region, p.gpu_model, p.sharing, _pool_shape(p), ",".join(p.bindings),
                   money_rate(p.price_per_gpu_hour_usd), " ".join(f"{s.nodes}x{s.gpus}" for s in p.node_sizes) or "0",
                   _free(p)) for p in pools], width=width)


def render_offered_pool(p: OfferedPool, at_from: bool = False) -> str:
    steps = "; ".join(f"{s.units} from {when(s.at)}" for s in p.free)
    return fields([("pool", p.id), ("region", p.region), ("model", p.gpu_model), ("sharing", p.sharing),
                   ("yours", "owned" if p.owned else "offered to your tenant"), ("shape", _pool_shape(p)),
                   ("bindings", ", ".join(p.bindings)), ("price", money_rate(p.price_per_gpu_hour_usd) + " per GPU"),
                   ("nodes", ", ".join(f"{s.nodes} of {s.gpus} GPUs" for s in p.node_sizes) or "none"),
                   ("free at --from" if at_from else "free now", _free(p)), ("free over the window", steps),
                   ("tenant root", f"log in as {p.tenant_root.user}; cleaned {p.tenant_root.cleaning} within "
                                   f"{p.tenant_root.turnaround_minutes} min after each booking"
                    if p.tenant_root else None)])


def render_whoami(w: Whoami) -> str:
    return fields([("principal", w.id), ("tenant", w.tenant_id), ("kind", w.kind),
                   ("acting for", w.delegated_by), ("scope", w.scope)])


EVENT_COLUMNS = (6, 32, 30, 28, 10)  # SEQ, AT, RESERVATION, EVENT, STATE: at least, so --follow's rows line up


def render_events(events: Sequence[Event], header: bool = True, width: int | None = None, fixed: bool = False) -> str:
    """Events as rows (SEQ AT RESERVATION EVENT STATE DETAILS) of columns at least EVENT_COLUMNS wide: the same
    with one row at a time (`fixed`: exactly so, on a terminal)."""
    rows = []
    for e in events:
        details = " ".join(f"{k}={_detail(k, v)}" for k, v in e.data.items() if k not in ("state", "poolId"))
        rows.append((e.seq, when(e.at), e.reservation_id or "-", e.type, e.data.get("state", ""), details))
    return table(("SEQ", "AT", "RESERVATION", "EVENT", "STATE", "DETAILS"), rows, width=width, header=header,
                 at_least=EVENT_COLUMNS, fixed=fixed)


def _detail(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and key in ("end", "start", "until", "at", "expiresAt"):
        return iso(value, "never")  # no relative form here: a word of its own, key=value
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


# ---- the operator's (berth admin ...) ----------------------------------------------------------------------------

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


def render_nodes(nodes: Sequence[AdminNode], width: int | None = None) -> str:
    if not nodes:
        return "no nodes"
    rows = []
    for n in nodes:
        now, nxt = now_and_next(n)
        rows.append((n.id, n.pool_id, n.state, n.agent_version or ("declared" if n.declared else "-"),
                     ago(n.heartbeat_age_seconds), n.inventory.gpus, now, nxt))
    return table(("NODE", "POOL", "STATE", "AGENT", "HEARTBEAT", "GPUS", "NOW", "NEXT"), rows, width=width)


def render_node(n: AdminNode, width: int | None = None) -> str:
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
    if n.state_reason:
        pairs.insert(4, ("state reason", n.state_reason))
    for c in n.conditions:  # KubernetesReleaseStuck=True: pods still hold the devices of released ...
        pairs.append(("condition", condition_text(c)))
    text = fields(pairs)
    if n.bookings:
        text += "\n\n" + table(("RESERVATION", "TENANT", "STATE", "BINDING", "START", "END", "DEVICES", ""),
                               [(b.reservation_id, b.tenant_id, b.state, b.binding + (", spot" if b.spot else ""),
                                 when(b.start), when(b.end), ",".join(b.devices),
                                 ("now" if b.current else "") + (" carried on" if b.carried_on else ""))
                                for b in n.bookings], width=width)
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


def render_pools(pools: Sequence[AdminPool], width: int | None = None) -> str:
    if not pools:
        return "no pools"
    return table(("POOL", "OWNER", "REGION", "MODEL", "SHARING", "PRICE", "NODES", "GPUS FREE/TOTAL", "IN USE", "PENDING"),
                 [(p.id + (" (archived)" if p.archived else ""), p.owner, p.region, p.gpu_model, p.sharing,
                   money_rate(p.price_per_gpu_hour_usd), _nodes_by_state(p.nodes), f"{p.gpus.free}/{p.gpus.total}",
                   p.gpus.booked, p.pending) for p in pools], width=width)


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
    return [(k, f"{t.used.get(k, 0):g}", f"{t.quota.get(k, 0):g}") for k in keys]  # no limit: 0 (domain/quota.py)


def render_tenants(tenants: Sequence[AdminTenant], width: int | None = None) -> str:
    if not tenants:
        return "no tenants"
    rows = []
    for t in tenants:
        used = ", ".join(f"{k} {u}/{q}" for k, u, q in _usage(t) if u != "0") or "-"
        rows.append((t.id, money(t.budget_usd) if t.budget_usd is not None else "none", money(t.spent_usd),
                     money(t.committed_usd), sum(t.reservations.values()), used))
    return table(("TENANT", "BUDGET", "SPENT", "COMMITTED", "LIVE", "QUOTA USED/LIMIT"), rows, width=width)


def render_tenant(t: AdminTenant, width: int | None = None) -> str:
    text = fields([("tenant", t.id), ("budget", money(t.budget_usd) if t.budget_usd is not None else "none"),
                   ("spent", money(t.spent_usd)), ("committed", f"{money(t.committed_usd)} (live reservations, to their end)"),
                   ("live", ", ".join(f"{c} {s}" for s, c in t.reservations.items()) or "none")])
    return text + "\n\n" + table(("QUOTA", "USED", "LIMIT"), _usage(t), width=width)
