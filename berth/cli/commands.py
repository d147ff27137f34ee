"""The CLI's commands, each over one typed client method: `berth reservations|operations|usage|confirmations ...` and
the operator's `berth admin nodes|pools|tenants|events ...`.

Output is a readable table when stdout is a terminal (or BERTH_FORCE_TTY=1,
or --table) and the API's JSON otherwise (or --json): the typed answer
encoded with its wire names. A refusal prints what happened, why, and the
command to run next, on stderr; the exit code says whose move it is
(berth/cli/advice.py, docs/cli.md).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import shlex
import time
from typing import Any, Awaitable, Callable, Sequence, TextIO

import msgspec

from berth.cli.advice import EXIT_OK, EXIT_TIMEOUT, exit_code_of_operation, report_refusal
from berth.cli.context import Context, connection_flags, same_command, without
from berth.cli.parser import DEFAULT_WAIT_S, request_of
from berth.cli.render import (render_confirmation, render_events, render_list, render_node, render_node_action,
                              render_nodes, render_offered_pool, render_offered_pools, render_operation, render_pool,
                              render_pools, render_quote, render_reservation, render_tenant, render_tenants,
                              render_usage, render_whoami, raised_notes, table, when)
from berth.client import WAIT_STEP_MS, BerthError


def wire(answer: Any) -> Any:
    """A typed answer as the API's JSON (wire names)."""
    return msgspec.to_builtins(answer)


async def cmd_create(ctx: Context, argv: Sequence[str]) -> int:
    r = await ctx.client.create(request=request_of(ctx.args), idempotency_key=ctx.key)
    text = "\n".join([render_reservation(r), *raised_notes(ctx.args, r.resources)])
    if r.operation is not None and not r.operation.done:
        text += "\nnext: " + shlex.join(["berth", "operations", "wait", r.operation.id, "--timeout-sec",
                                         str(DEFAULT_WAIT_S), *connection_flags(ctx)])
    ctx.emit({"reservation": wire(r)}, text)
    return EXIT_OK


async def cmd_quote(ctx: Context, argv: Sequence[str]) -> int:
    q = await ctx.client.quote(request=request_of(ctx.args))
    ctx.emit({"quote": wire(q)}, "\n".join([render_quote(q, ctx), *raised_notes(ctx.args, q.resources)]))
    return EXIT_OK


def _one(method: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        r = await getattr(ctx.client, method)(ctx.args.reservation_id)
        ctx.emit({"reservation": wire(r)}, render_reservation(r))
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
    ctx.emit(wire(x), head + "\n" + render_reservation(x.reservation))
    return EXIT_OK


async def cmd_list(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    page = await ctx.client.list(scope=a.scope, state=a.state, pool_id=a.pool, limit=a.limit, cursor=a.cursor)
    ctx.emit(wire(page), render_list(page, ctx, argv))
    return EXIT_OK


async def cmd_operation_get(ctx: Context, argv: Sequence[str]) -> int:
    op = await ctx.client.get_operation(ctx.args.operation_id)
    ctx.emit({"operation": wire(op)}, render_operation(op))
    return EXIT_OK


class Progress:
    """A spinner with the elapsed time and the operation's status, redrawn on one stderr line."""

    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, label: str, timeout_s: float):
        self.stream = stream
        self.label = label
        self.timeout_s = timeout_s
        self.status = "waiting"
        self.started = time.monotonic()
        self._task: asyncio.Task | None = None

    async def _spin(self) -> None:
        for frame in itertools.cycle(self.FRAMES):
            elapsed = time.monotonic() - self.started
            self.stream.write(f"\r\033[K{frame} {self.label} {self.status}  {elapsed:.0f}s of {self.timeout_s:g}s")
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


async def cmd_operation_wait(ctx: Context, argv: Sequence[str]) -> int:
    """Poll /operations/wait in bounded steps until the operation ends or --timeout-sec passes."""
    op_id, timeout_s = ctx.args.operation_id, max(0.0, ctx.args.timeout_sec)
    progress = Progress(ctx.err, op_id, timeout_s) if ctx.progress else None
    deadline = time.monotonic() + timeout_s
    if progress:
        progress.start()
    first = True
    try:
        while True:  # the first step answers at once (the status for the display), then bounded long polls
            step_ms = 0 if first else max(0, min(WAIT_STEP_MS, int((deadline - time.monotonic()) * 1000)))
            first = False
            answer = await ctx.client.wait_operation(op_id, step_ms)
            if progress:
                progress.status = answer.operation.status
            if answer.done or time.monotonic() >= deadline:
                break
    finally:
        if progress:
            await progress.stop()
    op = answer.operation
    text = render_operation(op)
    code = exit_code_of_operation(op)
    if not answer.done:
        text += f"\nstill {op.status} after {timeout_s:g}s; wait again: " + shlex.join(
            ["berth", "operations", "wait", op_id, "--timeout-sec", f"{timeout_s:g}", *connection_flags(ctx)])
        code = EXIT_TIMEOUT
    ctx.emit(wire(answer), text)
    return code


async def cmd_pools_list(ctx: Context, argv: Sequence[str]) -> int:
    pools = await ctx.client.list_pools(start=ctx.args.start, until=ctx.args.until)
    ctx.emit({"pools": wire(pools)}, render_offered_pools(pools))
    return EXIT_OK


async def cmd_pools_get(ctx: Context, argv: Sequence[str]) -> int:
    pool = await ctx.client.get_pool(ctx.args.pool_id, start=ctx.args.start, until=ctx.args.until)
    ctx.emit({"pool": wire(pool)}, render_offered_pool(pool))
    return EXIT_OK


async def cmd_whoami(ctx: Context, argv: Sequence[str]) -> int:
    me = await ctx.client.whoami()
    ctx.emit({"principal": wire(me)}, render_whoami(me))
    return EXIT_OK


FOLLOW_WAIT_MS = 25_000  # each long poll of --follow (the server holds at most 30 s)


async def cmd_events_list(ctx: Context, argv: Sequence[str]) -> int:
    """A page of the tenant's events; with --follow, every page up to now and then each new event as it is
    committed (one long poll after another on the cursor), until interrupted."""
    a = ctx.args
    mine = (lambda e: e.reservation_id == a.reservation) if a.reservation else (lambda e: True)
    if not a.follow:
        page = await ctx.client.list_events(after=a.after, limit=a.limit)
        shown = [e for e in page.events if mine(e)]
        text = render_events(shown) if shown else "no events"
        if page.events:
            text += f"\nmore: {same_command(ctx, [*without(argv, '--after'), '--after', str(page.next_cursor)])}"
        ctx.emit({"events": wire(shown), "nextCursor": page.next_cursor}, text)
        return EXIT_OK
    cursor, header = a.after, not ctx.json
    if ctx.progress:
        ctx.say("following events (Ctrl-C to stop)")
    while True:
        page = await ctx.client.list_events(after=cursor, limit=a.limit, wait_ms=FOLLOW_WAIT_MS)
        for e in page.events:
            if not mine(e):
                continue
            if ctx.json:
                print(json.dumps(wire(e)), file=ctx.out, flush=True)
            else:
                print(render_events([e], header=header), file=ctx.out, flush=True)
                header = False
        if page.next_cursor is not None:
            cursor = page.next_cursor


async def cmd_usage(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    u = await ctx.client.list_usage(reservation_id=a.reservation, since=a.since, until=a.until, limit=a.limit,
                                    cursor=a.cursor)
    ctx.emit(wire(u), render_usage(u, ctx, argv))
    return EXIT_OK


async def cmd_confirmations_list(ctx: Context, argv: Sequence[str]) -> int:
    items = await ctx.client.list_confirmations(status=ctx.args.status, limit=ctx.args.limit)
    text = table(("ID", "STATUS", "AGENT", "APPROVER", "EXPIRES"),
                 [(c.id, c.status, c.agent_id, c.approver, when(c.expires_at)) for c in items]) if items else "no confirmations"
    ctx.emit({"confirmations": wire(items)}, text)
    return EXIT_OK


def _confirmation(method: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        c = await getattr(ctx.client, method)(ctx.args.confirmation_id)
        ctx.emit({"confirmation": wire(c)}, render_confirmation(c))
        return EXIT_OK

    return run


async def cmd_admin_nodes_list(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    nodes = await ctx.client.list_nodes(pool_id=a.pool, state=a.state, start=a.start, until=a.until)
    ctx.emit({"nodes": wire(nodes)}, render_nodes(nodes))
    return EXIT_OK


async def cmd_admin_nodes_get(ctx: Context, argv: Sequence[str]) -> int:
    node = await ctx.client.get_node(ctx.args.node_id, start=ctx.args.start, until=ctx.args.until)
    ctx.emit({"node": wire(node)}, render_node(node))
    return EXIT_OK


def _node_action(action: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        result = await getattr(ctx.client, f"{action}_node")(ctx.args.node_id, reason=ctx.args.reason)
        text = render_node_action(action, result)
        undo = {"cordon": "uncordon", "drain": "uncordon"}.get(action)
        if undo and result.node.admin_state in ("cordoned", "draining"):
            text += "\nundo: " + shlex.join(["berth", "admin", "nodes", undo, result.node.id, *connection_flags(ctx)])
        ctx.emit(wire(result), text)
        return EXIT_OK

    return run


async def cmd_admin_pools_list(ctx: Context, argv: Sequence[str]) -> int:
    pools = await ctx.client.list_fleet_pools()
    ctx.emit({"pools": wire(pools)}, render_pools(pools))
    return EXIT_OK


async def cmd_admin_pools_get(ctx: Context, argv: Sequence[str]) -> int:
    pool = await ctx.client.get_fleet_pool(ctx.args.pool_id)
    ctx.emit({"pool": wire(pool)}, render_pool(pool))
    return EXIT_OK


async def cmd_admin_tenants_list(ctx: Context, argv: Sequence[str]) -> int:
    tenants = await ctx.client.list_tenants()
    ctx.emit({"tenants": wire(tenants)}, render_tenants(tenants))
    return EXIT_OK


async def cmd_admin_tenants_get(ctx: Context, argv: Sequence[str]) -> int:
    tenant = await ctx.client.get_tenant(ctx.args.tenant_id)
    ctx.emit({"tenant": wire(tenant)}, render_tenant(tenant))
    return EXIT_OK


async def cmd_admin_events_list(ctx: Context, argv: Sequence[str]) -> int:
    page = await ctx.client.list_fleet_events(after=ctx.args.after, limit=ctx.args.limit)
    rows = [(e.seq, when(e.at), e.type, e.data.get("nodeId"), f"{e.data.get('from')} -> {e.data.get('state')}",
             e.data.get("by"), e.data.get("reason")) for e in page.events]
    text = table(("SEQ", "AT", "EVENT", "NODE", "STATE", "BY", "REASON"), rows) if rows else "no events"
    if page.events:
        text += f"\nmore: {same_command(ctx, [*without(argv, '--after'), '--after', str(page.next_cursor)])}"
    ctx.emit(wire(page), text)
    return EXIT_OK


async def cmd_admin_release_identity(ctx: Context, argv: Sequence[str]) -> int:
    node = await ctx.client.release_node_identity(ctx.args.node_id)
    ctx.emit({"node": wire(node)}, f"node {node.id} ({node.hostname}, pool {node.pool_id}): identity released; its "
                                   "next registration may come from any host, and records that host's machine id")
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
