"""The tenant commands: `berth reservations|operations|usage|confirmations ...` over controlplane.client.

Output is a readable table when stdout is a terminal (or BERTH_FORCE_TTY=1,
or --table) and the API's JSON otherwise (or --json). A refusal prints what
happened, why, and the command to run next, on stderr; the exit code says
whose move it is (docs/cli.md):

    0  done
    1  the CLI itself failed (a bug, an answer it cannot read)
    2  bad arguments or configuration (nothing was sent)
    3  refused for the customer: the request itself (INVALID_INPUT, UNAUTHENTICATED, ACCESS_DENIED,
       QUOTA_EXCEEDED, SPEND_LIMIT_REACHED, INSUFFICIENT_FUNDS, CONFLICT, INVALID_STATE, NOT_FOUND,
       UNSUPPORTED, CONFIRMATION_REQUIRED, PRICE_CHANGED, QUOTE_EXPIRED); an operation that ended with
       failure.actor customer
    4  the provider: NO_CAPACITY; an operation that failed with failure.actor provider
    5  the platform: PROVIDER_UNAVAILABLE, the server cannot be reached, a 5xx without the API's envelope;
       an operation that failed with failure.actor platform
    6  operations wait timed out before the operation ended
    130 interrupted (Ctrl-C)
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Awaitable, Callable, Sequence, TextIO

from controlplane import client as api
from controlplane.client import BerthError

EXIT_OK, EXIT_CLI, EXIT_USAGE, EXIT_CUSTOMER, EXIT_PROVIDER, EXIT_PLATFORM, EXIT_TIMEOUT = 0, 1, 2, 3, 4, 5, 6
EXIT_INTERRUPTED = 130

CUSTOMER_CODES = frozenset({
    "INVALID_INPUT", "UNAUTHENTICATED", "ACCESS_DENIED", "QUOTA_EXCEEDED", "SPEND_LIMIT_REACHED",
    "INSUFFICIENT_FUNDS", "CONFLICT", "INVALID_STATE", "NOT_FOUND", "UNSUPPORTED", "CONFIRMATION_REQUIRED",
    "PRICE_CHANGED", "QUOTE_EXPIRED",
})
EXIT_OF_ACTOR = {"customer": EXIT_CUSTOMER, "provider": EXIT_PROVIDER, "platform": EXIT_PLATFORM}
DEFAULT_WAIT_S = 600


def exit_code_of(err: BerthError) -> int:
    """The exit code of a refusal: whose move it is."""
    if err.code in CUSTOMER_CODES:
        return EXIT_CUSTOMER
    if err.code == "NO_CAPACITY":
        return EXIT_PROVIDER
    if err.code == "PROVIDER_UNAVAILABLE" or isinstance(err, api.TransportError):
        return EXIT_PLATFORM
    if err.status is not None and err.status >= 500:
        return EXIT_PLATFORM
    if isinstance(err, api.BadAnswer) or err.status is None:
        return EXIT_CLI
    return EXIT_CUSTOMER  # a 4xx code this CLI does not know yet: still the request's


def exit_code_of_operation(op: api.Operation) -> int:
    if op.status == "succeeded":
        return EXIT_OK
    if op.status not in api.TERMINAL:
        return EXIT_TIMEOUT
    actor = op.failure.actor if op.failure else ("customer" if op.status == "cancelled" else None)
    return EXIT_OF_ACTOR.get(actor or "", EXIT_CLI)


# ---- argument types -----------------------------------------------------------

def _time_text(text: str) -> str:
    """A time as typed (epoch ms or ISO 8601), checked now and parsed when the body is built."""
    try:
        api.parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _price_text(text: str) -> str:
    try:
        amount = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r}: give a decimal price in USD per hour, e.g. 3.420000") from None
    if not amount.is_finite() or amount < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a non-negative decimal price, e.g. 3.420000")
    return text


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(text: str) -> int:
    """90m, 2h, 1d, 3600s or 500ms as milliseconds."""
    for unit in sorted(_UNITS_MS, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = Decimal(number)
            except InvalidOperation:
                break
            if value.is_finite() and value > 0:
                return int(value * _UNITS_MS[unit])
            break
    raise argparse.ArgumentTypeError(f"{text!r}: give a duration with a unit, e.g. 30m, 2h, 1d")


# ---- the parser -------------------------------------------------------------------

# The request's flags, in the order a suggested command writes them: (dest, flag).
REQUEST_FLAGS = (
    ("pool", "--pool"), ("gpu_model", "--gpu-model"), ("gpu_count", "--gpu-count"), ("node_count", "--node-count"),
    ("sharing", "--sharing"), ("mig_profile", "--mig-profile"), ("start", "--start"), ("end", "--end"),
    ("hours", "--hours"), ("binding", "--binding"), ("vcpu", "--vcpu"), ("memory_gib", "--memory-gib"),
    ("hugepages", "--hugepages"), ("spot", "--spot"), ("lease_seconds", "--lease-seconds"),
)
CREATE_FLAGS = (("quote", "--quote"), ("max_hourly_price", "--max-hourly-price"), ("wait_ms", "--wait-ms"),
                ("idempotency_key", "--idempotency-key"))

# API fields named in INVALID_INPUT details -> the flag that sets them.
FLAG_OF_FIELD = {
    "poolId": "--pool", "gpuModel": "--gpu-model", "gpuCount": "--gpu-count", "nodeCount": "--node-count",
    "sharing": "--sharing", "migProfile": "--mig-profile", "start": "--start", "end": "--end",
    "durationHours": "--hours", "binding": "--binding", "resources": "--vcpu/--memory-gib/--hugepages",
    "resources.vcpu": "--vcpu", "resources.memoryGiB": "--memory-gib", "resources.hugepages1Gi": "--hugepages",
    "spot": "--spot", "leaseSeconds": "--lease-seconds", "quoteId": "--quote", "maxHourlyPrice": "--max-hourly-price",
    "wait.timeoutMs": "--wait-ms", "idempotencyKey": "--idempotency-key", "Idempotency-Key": "--idempotency-key",
    "until": "--until", "by": "--by", "since": "--since", "cursor": "--cursor", "limit": "--limit",
    "state": "--state", "scope": "--scope", "Authorization": "--token",
}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a: Any, **kw: Any):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)


def _common() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    conn = common.add_argument_group("connection (flag, then environment, then config file)")
    conn.add_argument("--url", help="the control plane, e.g. http://127.0.0.1:8080 (env BERTH_URL)")
    conn.add_argument("--token", help="your bearer token (env BERTH_TOKEN)")
    conn.add_argument("--config", metavar="PATH",
                      help='JSON {"url": ..., "token": ...} (default $XDG_CONFIG_HOME/berth/config.json '
                           "or ~/.config/berth/config.json)")
    conn.add_argument("--retries", type=int, default=4, metavar="N",
                      help="retries of transport errors and PROVIDER_UNAVAILABLE, same idempotency key (default 4)")
    conn.add_argument("--request-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="seconds per attempt (default 30)")
    out = common.add_mutually_exclusive_group()
    out.add_argument("--json", dest="output", action="store_const", const="json",
                     help="print the API's JSON (the default when stdout is not a terminal)")
    out.add_argument("--table", dest="output", action="store_const", const="table",
                     help="print a table (the default on a terminal)")
    return common


def _request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", required=True, metavar="POOL", help="the pool (poolId)")
    p.add_argument("--gpu-model", required=True, metavar="MODEL", help="the device class, e.g. H100_80GB")
    p.add_argument("--gpu-count", type=int, metavar="N", help="devices per node (GPUs, MIG instances or slots)")
    p.add_argument("--node-count", type=int, metavar="N", help="nodes in the gang (default 1)")
    p.add_argument("--sharing", choices=("exclusive", "mig", "slots"), help="must equal the pool's")
    p.add_argument("--mig-profile", metavar="PROFILE", help="MIG pools: the instance profile, e.g. 1g.10gb")
    p.add_argument("--start", type=_time_text, metavar="TIME",
                   help="epoch ms or ISO 8601 (UTC unless an offset is given); absent: as soon as possible")
    window = p.add_mutually_exclusive_group(required=True)
    window.add_argument("--hours", type=float, metavar="H", help="the window's length (durationHours)")
    window.add_argument("--end", type=_time_text, metavar="TIME", help="the window's end: epoch ms or ISO 8601")
    p.add_argument("--binding", metavar="KIND", help="hold (default), node or kubernetes")
    p.add_argument("--vcpu", type=float, metavar="N", help="vcpu per node")
    p.add_argument("--memory-gib", type=float, metavar="GIB", help="memory per node, GiB")
    p.add_argument("--hugepages", type=int, metavar="N", help="1 GiB hugepages per node")
    p.add_argument("--spot", action="store_true", default=None, help="spot: may be preempted")
    p.add_argument("--lease-seconds", type=int, metavar="S", help="renew within this many seconds (30 to 604800)")


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(prog="berth", description="Berth's tenant commands")
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")

    res = groups.add_parser("reservations", help="create, read and end reservations").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    create = res.add_parser("create", parents=[common], help="reserve GPUs (202 Accepted; then wait on the operation)")
    _request_flags(create)
    create.add_argument("--quote", metavar="QUOTE_ID", help="the quote to hold the price to (quoteId)")
    create.add_argument("--max-hourly-price", type=_price_text, metavar="USD",
                        help="refuse (NO_CAPACITY price_ceiling) above this running price per hour")
    create.add_argument("--wait-ms", type=int, metavar="MS", help="hold the answer while pending, at most 30000")
    create.add_argument("--idempotency-key", metavar="KEY",
                        help="the request's key; default: a new one per invocation, kept across its retries")
    quote = res.add_parser("quote", parents=[common], help="price a request now (creates nothing)")
    _request_flags(quote)
    for name, text in (("get", "show a reservation"), ("release", "end a reservation now, refunding its quota"),
                       ("cancel", "withdraw a pending or placed reservation"),
                       ("renew", "move the lease deadline to now plus leaseSeconds")):
        sub = res.add_parser(name, parents=[common], help=text)
        sub.add_argument("reservation_id", metavar="RESERVATION")
    extend = res.add_parser("extend", parents=[common], help="move the end later, all or nothing")
    extend.add_argument("reservation_id", metavar="RESERVATION")
    how = extend.add_mutually_exclusive_group(required=True)
    how.add_argument("--until", type=_time_text, metavar="TIME", help="the new end: epoch ms or ISO 8601 (safe to retry)")
    how.add_argument("--by", type=_duration_ms, metavar="DURATION", help="extend by, e.g. 30m, 2h (repeats extend again)")
    lst = res.add_parser("list", parents=[common], help="your reservations, newest first")
    lst.add_argument("--scope", choices=("mine", "all"), help="mine (default) or the whole tenant's you may read")
    lst.add_argument("--state", help="pending, placed, binding, active, released or cancelled")
    lst.add_argument("--pool", help="only this pool")
    lst.add_argument("--limit", type=int, help="1 to 200 (default 50)")
    lst.add_argument("--cursor", help="the nextCursor of the previous page")

    ops = groups.add_parser("operations", help="the long-running record of each mutation").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    get_op = ops.add_parser("get", parents=[common], help="show an operation")
    get_op.add_argument("operation_id", metavar="OPERATION")
    wait = ops.add_parser("wait", parents=[common], help="wait until the operation ends (exit code by failure.actor)")
    wait.add_argument("operation_id", metavar="OPERATION")
    wait.add_argument("--timeout-sec", type=float, default=DEFAULT_WAIT_S, metavar="N",
                      help=f"give up after N seconds with exit code 6 (default {DEFAULT_WAIT_S})")

    usage = groups.add_parser("usage", parents=[common], help="charge history: lines per reservation and UTC day, totals")
    usage.add_argument("--reservation", metavar="RESERVATION", help="only this reservation")
    usage.add_argument("--since", type=_time_text, metavar="DAY", help="UTC days starting at or after (2026-12-01 or epoch ms)")
    usage.add_argument("--until", type=_time_text, metavar="DAY", help="UTC days starting before")
    usage.add_argument("--limit", type=int, help="lines per page, 1 to 500 (default 100)")
    usage.add_argument("--cursor", help="the nextCursor of the previous page")

    conf = groups.add_parser("confirmations", help="approvals asked by your delegated agents").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    conf_list = conf.add_parser("list", parents=[common], help="confirmations you asked or are asked")
    conf_list.add_argument("--status", choices=("pending", "approved", "denied", "expired"))
    conf_list.add_argument("--limit", type=int)
    for name in ("get", "approve", "deny"):
        sub = conf.add_parser(name, parents=[common], help=f"{name} a confirmation")
        sub.add_argument("confirmation_id", metavar="CONFIRMATION")
    return parser


# ---- the context of one invocation ----------------------------------------------------

@dataclass
class Context:
    args: argparse.Namespace
    settings: api.Settings
    client: api.AsyncClient
    out: TextIO
    err: TextIO
    json: bool
    progress: bool
    key: str | None = None  # the create's idempotency key (given or derived)

    def emit(self, doc: dict, text: str) -> None:
        if self.json:
            print(json.dumps(doc, indent=2), file=self.out)
        else:
            print(text, file=self.out)

    def say(self, text: str) -> None:
        print(text, file=self.err)


def _forced_tty(environ: dict) -> bool:
    return environ.get("BERTH_FORCE_TTY", "") not in ("", "0")


# ---- suggested commands ------------------------------------------------------------------

def _flag_value(value: Any) -> str:
    if isinstance(value, float):
        return repr(value).removesuffix(".0")
    return str(value)


def connection_flags(ctx: Context) -> list[str]:
    """The connection flags a suggested command needs to reach the same server (never the token)."""
    out: list[str] = []
    if ctx.settings.sources.get("url") == "flag":
        out += ["--url", ctx.settings.url]
    if ctx.args.config:
        out += ["--config", ctx.args.config]
    return out


def request_command(ctx: Context, command: str, overrides: dict[str, Any] | None = None,
                    keep: Sequence[str] = ()) -> str:
    """`berth reservations <command>` with this invocation's request flags, changed by overrides.

    keep: which create-only flags to carry (quote, max_hourly_price, wait_ms, idempotency_key).
    """
    overrides = overrides or {}
    words = ["berth", "reservations", command]
    flags = REQUEST_FLAGS + tuple(f for f in CREATE_FLAGS if f[0] in keep or f[0] in overrides)
    for dest, flag in flags:
        value = overrides[dest] if dest in overrides else getattr(ctx.args, dest, None)
        if value is None or value is False:
            continue
        words += [flag] if value is True else [flag, _flag_value(value)]
    return shlex.join(words + connection_flags(ctx))


def _without(words: Sequence[str], flag: str) -> list[str]:
    """words less `flag VALUE` and `flag=VALUE`."""
    out: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == flag:
            skip = True
        elif not w.startswith(flag + "="):
            out.append(w)
    return out


def same_command(ctx: Context, argv: Sequence[str]) -> str:
    """This invocation again, as typed, without the token."""
    return shlex.join(["berth", *_without(argv, "--token")])


# ---- what to do next -----------------------------------------------------------------------

def _money(value: Any) -> str:
    return f"${value}/hr"


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ms / 1000))


def _capacity_advice(ctx: Context, err: BerthError) -> list[str]:
    lines: list[str] = []
    alts = err.alternatives
    cheapest = err.cheapest_eligible_usd_per_hour
    if err.reason:
        lines.append(f"reason: {err.reason}")
    if cheapest is not None:
        lines.append(f"cheapest eligible rate: {_money(cheapest)}")
    for alt in alts:
        start = f", fits from {_when(alt.earliest_start)}" if alt.earliest_start is not None else ""
        lines.append(f"alternative: pool {alt.pool_id} ({alt.region}) at {_money(alt.total_running_usd_per_hour)}{start}")
    if ctx.args.command != "create":
        if alts:
            lines.append("next: " + request_command(ctx, "quote", {"pool": alts[0].pool_id}))
        return lines
    here = Decimal(err.details["totalRunningUsdPerHour"]) if "totalRunningUsdPerHour" in err.details else None
    if err.reason == "price_ceiling" and cheapest is not None:
        cheaper = [a for a in alts if a.total_running_usd_per_hour == cheapest]
        if cheaper and (here is None or here > cheapest):
            lines.append("next: " + request_command(ctx, "create", {"pool": cheaper[0].pool_id, "max_hourly_price": f"{cheapest}", "quote": None}))
            if here is not None:
                lines.append("  or: " + request_command(ctx, "create", {"max_hourly_price": f"{here}", "quote": None}))
        else:
            lines.append("next: " + request_command(ctx, "create", {"max_hourly_price": f"{cheapest}", "quote": None}))
    elif alts:
        change: dict[str, Any] = {"pool": alts[0].pool_id, "quote": None}
        ceiling = ctx.args.max_hourly_price
        price = alts[0].total_running_usd_per_hour
        if ceiling is not None and price is not None and Decimal(ceiling) < price:
            change["max_hourly_price"] = f"{price}"
        lines.append("next: " + request_command(ctx, "create", change, keep=("max_hourly_price",)))
    else:
        lines.append("next: change --gpu-model, --gpu-count or --node-count and quote again: "
                     + request_command(ctx, "quote"))
    return lines


def advice(ctx: Context, err: BerthError, argv: Sequence[str]) -> list[str]:
    """What to tell the user about a refusal, beyond its message: the details that matter and the next command."""
    d = err.details
    code = err.code
    create = ctx.args.group == "reservations" and ctx.args.command == "create"
    retry_same = (request_command(ctx, "create", {"idempotency_key": ctx.key}, keep=("quote", "max_hourly_price", "wait_ms"))
                  if create else same_command(ctx, argv))
    if code == "NO_CAPACITY":
        return _capacity_advice(ctx, err)
    if code in ("QUOTE_EXPIRED", "PRICE_CHANGED"):
        lines = []
        if "quotedUsdPerHour" in d:
            lines.append(f"quoted {_money(d['quotedUsdPerHour'])}, now {_money(d.get('totalRunningUsdPerHour'))}")
        lines.append("next: " + request_command(ctx, "quote"))
        lines.append("then: " + request_command(ctx, "create", {"quote": "QUOTE_ID"}, keep=("max_hourly_price",)))
        return lines
    if code == "CONFIRMATION_REQUIRED":
        return [f"approval needed: {err.approver} must approve confirmation {err.confirmation_id} "
                f"before {_when(d.get('expiresAt'))}",
                f"  ({err.approver} runs: berth confirmations approve {err.confirmation_id})",
                "then retry with the same key: " + retry_same]
    if code == "QUOTA_EXCEEDED":
        resource = str(d.get("resource", ""))
        flag = ("--gpu-count or --node-count" if resource.startswith("gpu:") else
                "--vcpu" if resource == "vcpu" else "--memory-gib or --hugepages" if resource == "memoryGiB" else "the request")
        return [f"quota {resource}: requested {d.get('requested')}, used {d.get('used')} of {d.get('limit')}",
                f"next: reduce {flag}, or ask an admin to raise the tenant's {resource} quota",
                "  after the quota is raised, the same key continues the request: " + retry_same]
    if code == "PROVIDER_UNAVAILABLE":
        return [f"the platform's doing (actor {err.actor or 'platform'}): nothing of yours needs to change",
                f"reference: {err.reference} (quote it to support if this persists)",
                "next: retry later with the same key: " + retry_same]
    if isinstance(err, api.TransportError):
        lines = [f"no answer from {ctx.settings.url} (url from {ctx.settings.sources.get('url')})"]
        if create and d.get("sent", True):
            lines.append("the request may have been accepted: do not use a new key for it")
        lines.append("next: retry with the same key: " + retry_same if create else "next: retry: " + retry_same)
        return lines
    if code == "INVALID_INPUT":
        flag = FLAG_OF_FIELD.get(str(err.field), "")
        return [f"next: fix {flag} ({d.get('rule', err.message)})" if flag else f"next: fix the request ({err.message})"]
    if code == "UNAUTHENTICATED":
        return [f"the token (from {ctx.settings.sources.get('token')}) is not accepted: check --token, BERTH_TOKEN "
                "or the config file"]
    if code == "ACCESS_DENIED":
        lines = ["your principal may not do this: ask a tenant admin to change the policy"]
        if create:
            lines.append("a refused key stays refused: a new request needs a new key (drop --idempotency-key)")
        return lines
    if code == "SPEND_LIMIT_REACHED":
        return [f"spent {d.get('spentUsd')} of {d.get('budgetUsd')} USD: ask an admin to raise the budget"]
    if code == "INSUFFICIENT_FUNDS":
        return [f"{d.get('leftUsd')} USD left, this may bill {d.get('exposureUsd')} USD: "
                "ask for fewer GPUs or hours, or have the budget raised"]
    if code == "CONFLICT":
        if d.get("reason") == "extend-in-flight":
            return [f"next: retry in {err.retry_after_seconds or 1:g} s: " + same_command(ctx, argv)]
        rid = err.reservation_id
        return [f"the key belongs to another request (reservation {rid}): a new request needs a new key "
                "(drop --idempotency-key)", f"see it: berth reservations get {rid}"]
    if code == "INVALID_STATE":
        rid = d.get("reservationId") or getattr(ctx.args, "reservation_id", None)
        lines = [f"state: {d.get('state')}"]
        if d.get("next") == "release":
            lines.append(f"next: berth reservations release {rid}")
        return lines
    if code == "NOT_FOUND":
        return ["next: check the id: berth reservations list" if d.get("field") != "poolId"
                else "next: the pool is not yours or offered to you"]
    if code == "UNSUPPORTED":
        return ["next: use --binding hold, node or kubernetes"]
    return []


def report_refusal(ctx: Context, err: BerthError, argv: Sequence[str]) -> int:
    code = exit_code_of(err)
    if ctx.json:
        print(json.dumps({"error": {"code": err.code, "message": err.message, "details": err.details}}, indent=2),
              file=ctx.out)
    status = f" (HTTP {err.status})" if err.status else ""
    ctx.say(f"berth: {err.code}{status}: {err.message}")
    for line in advice(ctx, err, argv):
        ctx.say(line)
    return code


# ---- rendering -------------------------------------------------------------------------------

def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {'-' if v is None else v}" for k, v in pairs)


def _shape(r: api.Reservation) -> str:
    device = f"{r.gpu_model} {r.mig_profile}" if r.mig_profile else r.gpu_model
    count = f"{r.node_count} x {r.gpu_count}" if r.node_count > 1 else f"{r.gpu_count}"
    return f"{count} {device}"


def _op(op: api.Operation | None) -> str | None:
    if op is None:
        return None
    text = f"{op.id} {op.kind} {op.status}"
    if op.failure is not None:
        text += f" ({op.failure.actor}: {op.failure.code})"
    return text


def render_reservation(r: api.Reservation) -> str:
    pairs: list[tuple[str, Any]] = [
        ("reservation", r.id), ("state", r.state + (f" ({r.reason})" if r.reason else "")),
        ("pool", f"{r.pool_id} ({r.region})"), ("gpus", _shape(r)), ("binding", r.binding + (", spot" if r.spot else "")),
        ("start", _when(r.start) if r.start is not None else "as soon as placed"),
        ("end", _when(r.end) if r.end is not None else f"{r.duration_hours:g} h after start"),
        ("resources", f"{r.resources.vcpu:g} vcpu, {r.resources.memory_gib:g} GiB, {r.resources.hugepages_1gi} x 1 GiB hugepages"
         if r.resources.vcpu is not None else None),
    ]
    if r.lease_seconds is not None:
        pairs.append(("lease", f"{r.lease_seconds} s, renew by {_when(r.lease_deadline)}"))
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


def render_list(page: api.ReservationPage, ctx: Context, argv: Sequence[str]) -> str:
    if not page.reservations:
        return "no reservations"
    rows = [(r.id, r.state, r.pool_id, _shape(r), _when(r.start), _when(r.end), _op(r.operation))
            for r in page.reservations]
    text = table(("ID", "STATE", "POOL", "GPUS", "START", "END", "OPERATION"), rows)
    if page.next_cursor:
        text += f"\nmore: {same_command(ctx, [*_without(argv, '--cursor'), '--cursor', page.next_cursor])}"
    return text


def render_quote(q: api.Quote, ctx: Context) -> str:
    pairs: list[tuple[str, Any]] = [
        ("quote", q.id), ("expires", _when(q.expires_at)), ("pool", f"{q.pool_id} ({q.region})"),
        ("gpus", f"{q.node_count} x {q.gpu_count} {q.gpu_model}" if q.node_count > 1 else f"{q.gpu_count} {q.gpu_model}"),
        ("price", f"{_money(q.total_running_usd_per_hour)} {q.currency}"),
        ("window", f"{q.window_hours:g} h, at most {q.total_usd} {q.currency}" if q.window_hours is not None else None),
        ("fits", "now" if q.fits_now else (f"from {_when(q.earliest_start)}" if q.earliest_start else "not within a year")),
    ]
    for alt in q.alternatives:
        pairs.append(("alternative", f"pool {alt.pool_id} ({alt.region}) at {_money(alt.total_running_usd_per_hour)}"))
    text = fields(pairs)
    return text + "\nnext: " + request_command(ctx, "create", {"quote": q.id})


def render_operation(op: api.Operation) -> str:
    pairs: list[tuple[str, Any]] = [("operation", op.id), ("kind", op.kind), ("status", op.status),
                                    ("reservation", op.reservation_id), ("created", _when(op.created_at)),
                                    ("updated", _when(op.updated_at))]
    if op.failure is not None:
        pairs += [("failure", f"{op.failure.code} (actor {op.failure.actor})"), ("message", op.failure.message),
                  ("what to do", op.failure.next)]
    return fields(pairs)


def render_usage(u: api.Usage, ctx: Context, argv: Sequence[str]) -> str:
    rows = [(line.day, line.reservation_id, line.pool_id, line.seconds, _money(line.hourly_usd), f"${line.amount_usd}",
             "yes" if line.running else "") for line in u.lines]
    parts = [table(("DAY", "RESERVATION", "POOL", "SECONDS", "RATE", "AMOUNT", "RUNNING"), rows) if rows
             else "no usage lines"]
    parts.append(fields([("page total", f"${u.page_total_usd}"), ("total", f"${u.total_usd}")]))
    if u.by_reservation:
        parts.append(table(("RESERVATION", "TOTAL"), [(t.reservation_id, f"${t.total_usd}") for t in u.by_reservation]))
    if u.next_cursor:
        parts.append(f"more: {same_command(ctx, [*_without(argv, '--cursor'), '--cursor', u.next_cursor])}")
    return "\n\n".join(parts)


def render_confirmation(c: api.Confirmation) -> str:
    return fields([("confirmation", c.id), ("status", c.status), ("agent", c.agent_id), ("approver", c.approver),
                   ("expires", _when(c.expires_at)), ("decided", _when(c.decided_at)), ("asked", c.message)])


# ---- the commands ------------------------------------------------------------------------------

def request_body(args: argparse.Namespace, create: bool) -> dict[str, Any]:
    return api.create_body(
        args.pool, args.gpu_model, gpu_count=args.gpu_count, node_count=args.node_count, sharing=args.sharing,
        mig_profile=args.mig_profile, start=args.start, end=args.end, duration_hours=args.hours, binding=args.binding,
        vcpu=args.vcpu, memory_gib=args.memory_gib, hugepages_1gi=args.hugepages, spot=args.spot,
        lease_seconds=args.lease_seconds, quote_id=args.quote if create else None,
        max_hourly_price=args.max_hourly_price if create else None, wait_ms=args.wait_ms if create else None)


async def cmd_create(ctx: Context, argv: Sequence[str]) -> int:
    body = request_body(ctx.args, create=True)
    wait_s = (body.get("wait") or {}).get("timeoutMs", 0) / 1000
    doc = await ctx.client.call("compute/reservations/create", body, idempotency_key=ctx.key, wait_s=wait_s)
    r = api.decode(doc.get("reservation"), api.Reservation)
    text = render_reservation(r)
    if r.operation is not None and not r.operation.done:
        text += "\nnext: " + shlex.join(["berth", "operations", "wait", r.operation.id, "--timeout-sec",
                                         str(DEFAULT_WAIT_S), *connection_flags(ctx)])
    ctx.emit(doc, text)
    return EXIT_OK


async def cmd_quote(ctx: Context, argv: Sequence[str]) -> int:
    doc = await ctx.client.call("compute/reservations/quote", request_body(ctx.args, create=False))
    ctx.emit(doc, render_quote(api.decode(doc.get("quote"), api.Quote), ctx))
    return EXIT_OK


def _one(path: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        doc = await ctx.client.call(path, {"reservationId": ctx.args.reservation_id})
        ctx.emit(doc, render_reservation(api.decode(doc.get("reservation"), api.Reservation)))
        return EXIT_OK

    return run


async def cmd_extend(ctx: Context, argv: Sequence[str]) -> int:
    args = ctx.args
    body: dict[str, Any] = {"reservationId": args.reservation_id}
    if args.until is not None:
        body["until"] = api.parse_time(args.until)
    else:
        body["by"] = args.by
    doc = await ctx.client.call("compute/reservations/extend", body, idempotent=args.by is None)
    x = api.decode(doc, api.ExtendResult)
    head = (f"extended to {_when(x.reservation.end)}" if x.extended else
            f"not extended: the bookings can reach {_when(x.available_until)} at most")
    ctx.emit(doc, head + "\n" + render_reservation(x.reservation))
    return EXIT_OK


async def cmd_list(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    body = {k: v for k, v in (("scope", a.scope), ("state", a.state), ("poolId", a.pool), ("limit", a.limit),
                              ("cursor", a.cursor)) if v is not None}
    doc = await ctx.client.call("compute/reservations/list", body)
    ctx.emit(doc, render_list(api.decode(doc, api.ReservationPage), ctx, argv))
    return EXIT_OK


async def cmd_operation_get(ctx: Context, argv: Sequence[str]) -> int:
    doc = await ctx.client.call("compute/operations/get", {"operationId": ctx.args.operation_id})
    ctx.emit(doc, render_operation(api.decode(doc.get("operation"), api.Operation)))
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
            step_ms = 0 if first else max(0, min(api.WAIT_STEP_MS, int((deadline - time.monotonic()) * 1000)))
            first = False
            doc = await ctx.client.call("compute/operations/wait", {"operationId": op_id, "timeoutMs": step_ms},
                                        wait_s=step_ms / 1000)
            answer = api.decode(doc, api.OperationWait)
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
            ["berth", "operations", "wait", op_id, "--timeout-sec", _flag_value(timeout_s), *connection_flags(ctx)])
        code = EXIT_TIMEOUT
    ctx.emit(doc, text)
    return code


async def cmd_usage(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    body: dict[str, Any] = {k: v for k, v in (("reservationId", a.reservation), ("limit", a.limit),
                                              ("cursor", a.cursor)) if v is not None}
    for key in ("since", "until"):
        if getattr(a, key) is not None:
            body[key] = api.parse_time(getattr(a, key))
    doc = await ctx.client.call("compute/usage/list", body)
    ctx.emit(doc, render_usage(api.decode(doc, api.Usage), ctx, argv))
    return EXIT_OK


async def cmd_confirmations_list(ctx: Context, argv: Sequence[str]) -> int:
    a = ctx.args
    body = {k: v for k, v in (("status", a.status), ("limit", a.limit)) if v is not None}
    doc = await ctx.client.call("iam/confirmations/list", body)
    items = api.decode(doc.get("confirmations"), list[api.Confirmation])
    text = table(("ID", "STATUS", "AGENT", "APPROVER", "EXPIRES"),
                 [(c.id, c.status, c.agent_id, c.approver, _when(c.expires_at)) for c in items]) if items else "no confirmations"
    ctx.emit(doc, text)
    return EXIT_OK


def _confirmation(path: str) -> Callable[[Context, Sequence[str]], Awaitable[int]]:
    async def run(ctx: Context, argv: Sequence[str]) -> int:
        doc = await ctx.client.call(path, {"confirmationId": ctx.args.confirmation_id})
        ctx.emit(doc, render_confirmation(api.decode(doc.get("confirmation"), api.Confirmation)))
        return EXIT_OK

    return run


COMMANDS: dict[tuple[str, str | None], Callable[[Context, Sequence[str]], Awaitable[int]]] = {
    ("reservations", "create"): cmd_create,
    ("reservations", "quote"): cmd_quote,
    ("reservations", "get"): _one("compute/reservations/get"),
    ("reservations", "release"): _one("compute/reservations/release"),
    ("reservations", "cancel"): _one("compute/reservations/cancel"),
    ("reservations", "renew"): _one("compute/reservations/renew"),
    ("reservations", "extend"): cmd_extend,
    ("reservations", "list"): cmd_list,
    ("operations", "get"): cmd_operation_get,
    ("operations", "wait"): cmd_operation_wait,
    ("usage", None): cmd_usage,
    ("confirmations", "list"): cmd_confirmations_list,
    ("confirmations", "get"): _confirmation("iam/confirmations/get"),
    ("confirmations", "approve"): _confirmation("iam/confirmations/approve"),
    ("confirmations", "deny"): _confirmation("iam/confirmations/deny"),
}


async def _run(ctx: Context, argv: Sequence[str]) -> int:
    handler = COMMANDS[(ctx.args.group, getattr(ctx.args, "command", None))]
    try:
        return await handler(ctx, argv)
    except BerthError as err:
        return report_refusal(ctx, err, argv)
    finally:
        await ctx.client.close()


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
         environ: dict[str, str] | None = None) -> int:
    """Run one tenant command; argv starts with the group (`reservations`, `operations`, `usage`, `confirmations`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = stdout or sys.stdout, stderr or sys.stderr
    env = dict(os.environ if environ is None else environ)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or bad arguments (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        settings = api.resolve_settings(args.url, args.token, args.config, env)
    except api.ConfigError as exc:
        print(f"berth: {exc}", file=err)
        return EXIT_USAGE
    forced = _forced_tty(env)
    as_json = args.output == "json" or (args.output is None and not (forced or out.isatty()))
    def retrying(attempt: int, error: BerthError, delay: float) -> None:
        cause = error.details.get("cause") or error.code
        same = "the same idempotency key" if args.group == "reservations" and args.command == "create" else "the same request"
        print(f"berth: {cause}; retrying in {delay:.1f}s with {same} (attempt {attempt + 1} of {args.retries + 1})",
              file=err)

    client = api.AsyncClient.from_settings(settings, retries=max(0, args.retries), timeout=args.request_timeout,
                                           user_agent="berth-cli/0.1", on_retry=retrying)
    ctx = Context(args, settings, client, out, err, as_json, progress=forced or err.isatty())
    if args.group == "reservations" and args.command == "create":
        ctx.key = args.idempotency_key or api.new_idempotency_key("cli")
    try:
        return asyncio.run(_run(ctx, argv))
    except KeyboardInterrupt:
        print("berth: interrupted" + (f"; retry with --idempotency-key {ctx.key}" if ctx.key else ""), file=err)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug of the CLI: say so plainly, with what to report
        print(f"berth: unexpected {type(exc).__name__}: {exc}", file=err)
        return EXIT_CLI


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
