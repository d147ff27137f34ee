"""The CLI's commands, each over one typed client method: `berth reservations|operations|usage|confirmations ...` and
the operator's `berth admin nodes|pools|tenants|events ...`.

Output is a readable table when stdout is a terminal (or BERTH_FORCE_TTY=1,
or -o table|wide) and the API's JSON otherwise (or -o json|yaml): the answer
document as the API sent it (the client's last_answer; a watch or a follow prints
each record it reads). A refusal prints what happened, why, and the
command to run next, on stderr; the exit code says whose move it is
(berth/cli/advice.py, docs/cli.md).
"""
from __future__ import annotations

import asyncio
import itertools
import shlex
import time
from typing import Any, Awaitable, Callable, Sequence, TextIO

import msgspec

from berth.cli.advice import (EXIT_OF_ACTOR, EXIT_OK, EXIT_TIMEOUT, events_end, exit_code_of_operation,
                              report_refusal)
from berth.cli.context import Context, connection_flags, same_command, without
from berth.cli.parser import DEFAULT_WAIT_S, request_of
from berth.cli.render import (LISTED_STATES, condition_text, layout, list_headers, list_row, raised_notes, render_confirmation,
                              render_events, render_list, render_node, render_node_action, render_nodes,
                              render_offered_pool, render_offered_pools, render_operation, render_pool, render_pools,
                              render_quote, render_reservation, render_tenant, render_tenants, render_usage,
                              render_whoami, table, when)
from berth.client import (WAIT_STEP_MS, AccessDenied, BerthError, Condition, EventPage, NotFound, Operation,
                          ProviderUnavailable, Reservation, ReservationPage, TransportError, now_ms)


def wire(answer: Any) -> Any:
    """A typed answer as the API's JSON (wire names)."""
    return msgspec.to_builtins(answer)


async def cmd_create(ctx: Context, argv: Sequence[str]) -> int:
    r = await ctx.client.create(request=request_of(ctx.args), idempotency_key=ctx.key)
    text = "\n".join([render_reservation(r, ctx.wide), *raised_notes(ctx.args, r.resources)])
    if r.operation is not None and not r.operation.done:
        text += "\nnext: " + shlex.join(["berth", "operations", "wait", r.operation.id, "--timeout-sec",
                                         str(DEFAULT_WAIT_S), *connection_flags(ctx)])
    ctx.emit(ctx.client.last_answer, text)
    return EXIT_OK


async def cmd_quote(ctx: Context, argv: Sequence[str]) -> int:
    q = await ctx.client.quote(request=request_of(ctx.args))
    ctx.emit(ctx.client.last_answer, "\n".join([render_quote(q, ctx), *raised_notes(ctx.args, q.resources)]))
    return EXIT_OK


def _one(method: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        r = await getattr(ctx.client, method)(ctx.args.reservation_id)
        ctx.emit(ctx.client.last_answer, render_reservation(r, ctx.wide))
        return EXIT_OK

    return run


async def cmd_extend(ctx: Context, argv: Sequence[str]) -> int:
    args = ctx.args
    x = await ctx.client.extend(args.reservation_id, until=args.until, by_ms=args.by)
    if x.extended:
        head = f"extended to {when(x.reservation.end)}"
    elif x.reason == "already-reached":
        head = (f"not extended: it already ends at {when(x.reservation.end)}, not before the end asked; nothing "
                "changed (extend moves the end later only; release ends it early)")
    else:
        head = f"not extended: the bookings can reach {when(x.available_until)} at most (another booking follows)"
    ctx.emit(ctx.client.last_answer, head + "\n" + render_reservation(x.reservation, ctx.wide))
    return EXIT_OK


async def cmd_list(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    cursor = await _end_of_events(ctx) if a.watch else None  # before the list: no change after it is missed
    page = await ctx.client.list(scope=a.scope, state=a.state, pool_id=a.pool, limit=a.limit, cursor=a.cursor)
    if not a.watch:
        ctx.emit(ctx.client.last_answer, render_list(page, ctx, argv))
        return EXIT_OK
    return await _watch(ctx, page, cursor)


FOLLOW_RETRY_MAX_S = 10.0  # a follow or a watch outlives a control plane that is away: tries again this often


async def _next_events(ctx: Context, cursor: int | None, limit: int) -> EventPage:
    """One long poll of a follow or a watch. A control plane that does not answer (restarting, upgraded, its
    database away) is tried again until it does, however long, as a follow runs until Ctrl-C. A cursor past the
    control plane's events goes on from where they now end: the events up to there are the copy's, seen already;
    those after it are new."""
    delay = 0.5
    while True:
        try:
            return await ctx.client.list_events(after=cursor, limit=limit, wait_ms=FOLLOW_WAIT_MS)
        except (TransportError, ProviderUnavailable) as err:
            ctx.say(f"berth: {err.code}: {err.message}; trying again in {delay:g} s, from after "
                    f"{cursor if cursor is not None else 'the start'} (Ctrl-C to stop)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, FOLLOW_RETRY_MAX_S)
        except BerthError as err:
            newest = events_end(err)
            if newest is None:
                raise
            ctx.say(f"the control plane's events now end at {newest} (its database was restored or failed over): "
                    "going on from there")
            cursor = newest


async def _end_of_events(ctx: Context) -> int | None:
    """The cursor after the tenant's last event so far (one call, however long the history)."""
    return await ctx.client.last_event_cursor()


class _View:
    """Which reservations `list --watch` shows: those the list's filters select, and any it has shown (so a row
    that leaves the filter, say released under --state active, is seen leaving)."""

    def __init__(self, ctx: Context, page: ReservationPage):
        self.ctx = ctx
        self.shown = {r.id for r in page.reservations}
        self.principal: str | None = None  # scope mine: whose they are (whoami, asked once when first needed)

    async def _mine(self, r: Reservation) -> bool:
        if self.principal is None:
            self.principal = (await self.ctx.client.whoami()).id
        return r.principal_id == self.principal

    async def shows(self, r: Reservation) -> bool:
        a = self.ctx.args
        if r.id in self.shown:
            return True
        if (a.state and r.state != a.state) or (a.pool and r.pool_id != a.pool):
            return False
        if a.scope != "all" and not await self._mine(r):
            return False
        self.shown.add(r.id)
        return True


async def _watch(ctx: Context, page: ReservationPage, cursor: int | None) -> int:
    """The list, then each reservation again as events touch it (one long poll after another), until Ctrl-C."""
    headers = list_headers(ctx.wide)
    rows = [list_row(r, ctx.wide) for r in page.reservations]
    # later rows line up under these columns (on a terminal, exactly: the first table's fit, the last column the rest)
    widths = layout(headers, rows, ctx.width, at_least=(0, max(map(len, LISTED_STATES))))
    if ctx.structured:
        for r in page.reservations:
            ctx.emit_record({"reservation": wire(r)}, "")
    else:
        print(table(headers, rows, width=ctx.width, at_least=widths, fixed=True), file=ctx.out, flush=True)
    if ctx.progress:
        ctx.say("watching for changes (Ctrl-C to stop)")
    view = _View(ctx, page)
    while True:
        events = await _next_events(ctx, cursor, 500)
        if events.next_cursor is not None:
            cursor = events.next_cursor
        last = {e.reservation_id: e for e in events.events if e.reservation_id}  # each touched once, its last event
        for rid, event in last.items():
            try:
                r = await ctx.client.get(rid)
            except (NotFound, AccessDenied):  # gone, or another principal's that this token may not read
                continue
            if await view.shows(r):
                ctx.emit_record({"event": wire(event), "reservation": wire(r)},
                                table(headers, [list_row(r, ctx.wide)], width=ctx.width, header=False, at_least=widths,
                                      fixed=True))


async def cmd_operation_get(ctx: Context, argv: Sequence[str]) -> int:
    op = await ctx.client.get_operation(ctx.args.operation_id)
    ctx.emit(ctx.client.last_answer, render_operation(op))
    return EXIT_OK


class Progress:
    """A spinner with the elapsed time and the operation's status (and its reservation's conditions), redrawn on one
    stderr line cut to the terminal's width."""

    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, label: str, timeout_s: float, width: int | None = None):
        self.stream = stream
        self.label = label
        self.timeout_s = timeout_s
        self.width = width or 120  # the line is cut to it: a wrapped line could not be redrawn in place
        self.status = "waiting"
        self.started = time.monotonic()
        self._task: asyncio.Task | None = None

    def _line(self, text: str) -> str:
        return text if len(text) < self.width else text[: self.width - 2] + "…"

    async def _spin(self) -> None:
        for frame in itertools.cycle(self.FRAMES):
            elapsed = time.monotonic() - self.started
            self.stream.write("\r\033[K" + self._line(f"{frame} {self.label} {elapsed:.0f}s of {self.timeout_s:g}s: "
                                                      f"{self.status}"))
            self.stream.flush()
            await asyncio.sleep(0.1)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._spin())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            elapsed = time.monotonic() - self.started
            self.stream.write(f"\r\033[K{self.label} {self.status} after {elapsed:.1f}s\n")
            self.stream.flush()


CONDITION_STEP_MS = 2000  # while the reservation binds: how soon a changed condition (BindFailed) is seen

# Conditions that do not resolve by themselves, and whose move it is: `operations wait` stops on them.
STUCK = {("DevicesBound", "False", "BindFailed"): "platform"}  # a node's agent could not bind the devices


def stuck_condition(r: Reservation) -> Condition | None:
    return next((c for c in r.conditions if (c.type, c.status, c.reason) in STUCK), None)


def _step_ms(r: Reservation | None) -> int:
    """The next long poll's length: short while conditions may change (binding, or a window about to start)."""
    if r is None:
        return WAIT_STEP_MS
    if r.state == "binding":
        return CONDITION_STEP_MS
    if r.state == "placed" and r.start is not None:
        return max(CONDITION_STEP_MS, min(WAIT_STEP_MS, r.start - now_ms() + 500))
    return WAIT_STEP_MS


def wait_status(op: Operation, r: Reservation | None) -> str:
    """`running, reservation binding; DevicesBound=False Binding: waiting for ...`"""
    if r is None:
        return op.status
    return f"{op.status}, reservation {r.state}" + "".join(f"; {condition_text(c)}" for c in r.conditions)


async def _reservation_of(ctx: Context, op: Operation) -> Reservation | None:
    try:
        return await ctx.client.get(op.reservation_id)
    except BerthError:  # the wait goes on without the conditions
        return None


async def cmd_operation_wait(ctx: Context, argv: Sequence[str]) -> int:
    """Poll /operations/wait in bounded steps until the operation ends, the reservation is stuck on a condition
    that will not resolve by itself, or --timeout-sec passes; the progress line shows its conditions."""
    op_id, timeout_s = ctx.args.operation_id, max(0.0, ctx.args.timeout_sec)
    progress = Progress(ctx.err, op_id, timeout_s, ctx.width) if ctx.progress else None
    deadline = time.monotonic() + timeout_s
    if progress:
        progress.start()
    first, reservation, stuck = True, None, None
    try:
        while True:  # the first step answers at once (the status for the display), then bounded long polls
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            step_ms = 0 if first else min(_step_ms(reservation), left_ms)
            first = False
            answer = await ctx.client.wait_operation(op_id, step_ms)
            if not answer.done:
                reservation = await _reservation_of(ctx, answer.operation)
                stuck = stuck_condition(reservation) if reservation is not None else None
            if progress:
                progress.status = wait_status(answer.operation, None if answer.done else reservation)
            if answer.done or stuck is not None or time.monotonic() >= deadline:
                break
    finally:
        if progress:
            await progress.stop()
    op = answer.operation
    text = render_operation(op)
    code = exit_code_of_operation(op)
    if stuck is not None and reservation is not None:
        ctx.emit(wire(answer), text)
        ctx.say(f"berth: stuck: reservation {reservation.id} is {reservation.state} with {condition_text(stuck)}; "
                "it will not resolve by itself")
        ctx.say("next: end it and book again: " + shlex.join(["berth", "reservations", "release", reservation.id,
                                                              *connection_flags(ctx)]))
        return EXIT_OF_ACTOR[STUCK[(stuck.type, stuck.status, stuck.reason)]]
    if not answer.done:
        text += f"\nstill {op.status} after {timeout_s:g}s; wait again: " + shlex.join(
            ["berth", "operations", "wait", op_id, "--timeout-sec", f"{timeout_s:g}", *connection_flags(ctx)])
        code = EXIT_TIMEOUT
    ctx.emit(wire(answer), text)
    return code


async def cmd_pools_list(ctx: Context, argv: Sequence[str]) -> int:
    pools = await ctx.client.list_pools(start=ctx.args.start, until=ctx.args.until)
    ctx.emit(ctx.client.last_answer, render_offered_pools(pools, ctx.width, at_from=ctx.args.start is not None))
    return EXIT_OK


async def cmd_pools_get(ctx: Context, argv: Sequence[str]) -> int:
    pool = await ctx.client.get_pool(ctx.args.pool_id, start=ctx.args.start, until=ctx.args.until)
    ctx.emit(ctx.client.last_answer, render_offered_pool(pool, at_from=ctx.args.start is not None))
    return EXIT_OK


async def cmd_whoami(ctx: Context, argv: Sequence[str]) -> int:
    me = await ctx.client.whoami()
    ctx.emit(ctx.client.last_answer, render_whoami(me))
    return EXIT_OK


FOLLOW_WAIT_MS = 25_000  # each long poll of --follow (the server holds at most 30 s)


def _events_after(ctx: Context, argv: Sequence[str], page: EventPage, after: int | None) -> str:
    """The command that lists on from a page of events (the tenant's or the fleet's): its next page, or the events
    committed later; also after an empty page whose cursor moved past events this caller may not read."""
    if not page.events and page.next_cursor in (None, after):
        return ""
    return "\nthe next page, or events committed later: " + same_command(
        ctx, [*without(argv, "--after"), "--after", str(page.next_cursor)])


async def cmd_events_list(ctx: Context, argv: Sequence[str]) -> int:
    """A page of the tenant's events; with --follow, every page up to now and then each new event as it is
    committed (one long poll after another on the cursor), until interrupted."""
    a = ctx.args
    if a.reservation:  # the API lists the tenant's events; one of another tenant's, or a typo, is NOT_FOUND, as usage says
        await ctx.client.get(a.reservation)
    mine = (lambda e: e.reservation_id == a.reservation) if a.reservation else (lambda e: True)
    if not a.follow:
        page = await ctx.client.list_events(after=a.after, limit=a.limit)
        shown = [e for e in page.events if mine(e)]
        text = render_events(shown, width=ctx.width) if shown else (
            f"none of this page's {len(page.events)} events is {a.reservation}'s" if page.events else "no events")
        text += _events_after(ctx, argv, page, a.after)
        ctx.emit({"events": wire(shown), "nextCursor": page.next_cursor}, text)
        return EXIT_OK
    cursor, header = a.after, True
    if ctx.progress:
        ctx.say("following events (Ctrl-C to stop)")
    while True:
        page = await _next_events(ctx, cursor, a.limit)
        for e in page.events:
            if not mine(e):
                continue
            ctx.emit_record(wire(e), render_events([e], header=header, width=ctx.width, fixed=True))
            header = False
        if page.next_cursor is not None:
            cursor = page.next_cursor


async def cmd_usage(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    u = await ctx.client.list_usage(reservation_id=a.reservation, since=a.since, until=a.until, limit=a.limit,
                                    cursor=a.cursor)
    ctx.emit(ctx.client.last_answer, render_usage(u, ctx, argv))
    return EXIT_OK


async def cmd_confirmations_list(ctx: Context, argv: Sequence[str]) -> int:
    items = await ctx.client.list_confirmations(status=ctx.args.status, limit=ctx.args.limit)
    text = table(("ID", "STATUS", "AGENT", "APPROVER", "EXPIRES"),
                 [(c.id, c.status, c.agent_id, c.approver, when(c.expires_at)) for c in items],
                 width=ctx.width) if items else "no confirmations"
    ctx.emit(ctx.client.last_answer, text)
    return EXIT_OK


def _confirmation(method: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        c = await getattr(ctx.client, method)(ctx.args.confirmation_id)
        ctx.emit(ctx.client.last_answer, render_confirmation(c))
        return EXIT_OK

    return run


async def cmd_admin_nodes_list(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    nodes = await ctx.client.list_nodes(pool_id=a.pool, state=a.state, start=a.start, until=a.until)
    ctx.emit(ctx.client.last_answer, render_nodes(nodes, ctx.width))
    return EXIT_OK


async def cmd_admin_nodes_get(ctx: Context, argv: Sequence[str]) -> int:
    node = await ctx.client.get_node(ctx.args.node_id, start=ctx.args.start, until=ctx.args.until)
    ctx.emit(ctx.client.last_answer, render_node(node, ctx.width))
    return EXIT_OK


def _node_action(action: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        result = await getattr(ctx.client, f"{action}_node")(ctx.args.node_id, reason=ctx.args.reason)
        text = render_node_action(action, result)
        undo = {"cordon": "uncordon", "drain": "uncordon"}.get(action)
        if undo and result.node.admin_state in ("cordoned", "draining"):
            text += "\nundo: " + shlex.join(["berth", "admin", "nodes", undo, result.node.id, *connection_flags(ctx)])
        ctx.emit(ctx.client.last_answer, text)
        return EXIT_OK

    return run


async def cmd_admin_pools_list(ctx: Context, argv: Sequence[str]) -> int:
    pools = await ctx.client.list_fleet_pools()
    ctx.emit(ctx.client.last_answer, render_pools(pools, ctx.width))
    return EXIT_OK


async def cmd_admin_pools_get(ctx: Context, argv: Sequence[str]) -> int:
    pool = await ctx.client.get_fleet_pool(ctx.args.pool_id)
    ctx.emit(ctx.client.last_answer, render_pool(pool))
    return EXIT_OK


async def cmd_admin_tenants_list(ctx: Context, argv: Sequence[str]) -> int:
    tenants = await ctx.client.list_tenants()
    ctx.emit(ctx.client.last_answer, render_tenants(tenants, ctx.width))
    return EXIT_OK


async def cmd_admin_tenants_get(ctx: Context, argv: Sequence[str]) -> int:
    tenant = await ctx.client.get_tenant(ctx.args.tenant_id)
    ctx.emit(ctx.client.last_answer, render_tenant(tenant, ctx.width))
    return EXIT_OK


async def cmd_admin_events_list(ctx: Context, argv: Sequence[str]) -> int:
    page = await ctx.client.list_fleet_events(after=ctx.args.after, limit=ctx.args.limit)
    rows = [(e.seq, when(e.at), e.type, e.data.get("nodeId"), f"{e.data.get('from')} -> {e.data.get('state')}",
             e.data.get("by"), e.data.get("reason")) for e in page.events]
    text = table(("SEQ", "AT", "EVENT", "NODE", "STATE", "BY", "REASON"), rows, width=ctx.width) if rows else (
        "no events" if page.next_cursor in (None, ctx.args.after) else
        f"no events of the nodes you may read up to {page.next_cursor}")
    text += _events_after(ctx, argv, page, ctx.args.after)
    ctx.emit(ctx.client.last_answer, text)
    return EXIT_OK


async def cmd_admin_release_identity(ctx: Context, argv: Sequence[str]) -> int:
    node = await ctx.client.release_node_identity(ctx.args.node_id)
    ctx.emit(ctx.client.last_answer, f"node {node.id} ({node.hostname}, pool {node.pool_id}): identity released; "
                                     "its next registration may come from any host, and records that host's machine id")
    return EXIT_OK


COMMANDS: dict[tuple[str, str | None], Callable[[Context, Sequence[str]], Awaitable[int]]] = {
    ("reservations", "create"): cmd_create,
    ("reservations", "quote"): cmd_quote,
    ("reservations", "get"): _one("get"),
    ("reservations", "release"): _one("release"),
    ("reservations", "cancel"): _one("cancel"),
    ("reservations", "renew"): _one("renew"),
    ("reservations", "extend"): cmd_extend,
    ("reservations", "list"): cmd_list,
    ("events", "list"): cmd_events_list,
    ("pools", "list"): cmd_pools_list,
    ("pools", "get"): cmd_pools_get,
    ("whoami", None): cmd_whoami,
    ("operations", "get"): cmd_operation_get,
    ("operations", "wait"): cmd_operation_wait,
    ("usage", None): cmd_usage,
    ("confirmations", "list"): cmd_confirmations_list,
    ("confirmations", "get"): _confirmation("get_confirmation"),
    ("confirmations", "approve"): _confirmation("approve_confirmation"),
    ("confirmations", "deny"): _confirmation("deny_confirmation"),
    ("admin nodes", "list"): cmd_admin_nodes_list,
    ("admin nodes", "get"): cmd_admin_nodes_get,
    **{("admin nodes", action): _node_action(action) for action in ("cordon", "uncordon", "drain", "clear")},
    ("admin nodes", "release-identity"): cmd_admin_release_identity,
    ("admin pools", "list"): cmd_admin_pools_list,
    ("admin pools", "get"): cmd_admin_pools_get,
    ("admin tenants", "list"): cmd_admin_tenants_list,
    ("admin tenants", "get"): cmd_admin_tenants_get,
    ("admin events", "list"): cmd_admin_events_list,
}


def group_of(args) -> str:
    """The command's group: `reservations`, ..., or `admin nodes`, `admin pools`, ..."""
    return f"admin {args.admin_group}" if args.group == "admin" else args.group


async def run(ctx: Context, argv: Sequence[str]) -> int:
    handler = COMMANDS[(group_of(ctx.args), getattr(ctx.args, "command", None))]
    try:
        return await handler(ctx, argv)
    except BerthError as err:
        return report_refusal(ctx, err, argv)
    finally:
        await ctx.client.close()
