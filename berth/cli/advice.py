"""What the CLI says about a refusal: whose move it is (the exit code), the details that matter, the next command.

Exit codes (docs/cli.md) follow the actor of the API's error code
(common/errors.py): 3 the customer's (the request itself), 4 the provider's
(no capacity), 5 the platform's (retry later with the same key); 0 done,
1 the CLI itself failed, 2 bad arguments or configuration (nothing was sent:
also a failed TLS handshake), 6 an operation wait timed out, 130 interrupted.
"""
from __future__ import annotations

import shlex
from decimal import Decimal
import re
from typing import Any, Sequence

from berth.cli.context import Context, connection_flags, request_command, same_command, without
from berth.cli.parser import FLAG_OF_FIELD
from berth.cli.render import humane, money_rate, when
from berth.client import TERMINAL, BadAnswer, BerthError, InvalidInput, Operation, TransportError
from common import errors as error_table
from common.times import iso

EXIT_OK, EXIT_CLI, EXIT_USAGE, EXIT_CUSTOMER, EXIT_PROVIDER, EXIT_PLATFORM, EXIT_TIMEOUT = 0, 1, 2, 3, 4, 5, 6
EXIT_INTERRUPTED = 130

EXIT_OF_ACTOR = {"customer": EXIT_CUSTOMER, "provider": EXIT_PROVIDER, "platform": EXIT_PLATFORM}


TIME_FIELDS = frozenset({"start", "end", "until", "since", "from"})  # epoch ms on the wire, times on the flags
_BOUND = re.compile(r"(?<![\w.])(\d{7,})(?![\w.])")  # a number of milliseconds the API states a bound in


def in_flag_units(field: str, rule: str) -> str:
    """A rule the API states in epoch ms ("must be an integer <= 32503680000000") in the flag's own units: a
    time as ISO 8601, a duration of --by in days or hours."""
    if field in TIME_FIELDS:
        return _BOUND.sub(lambda m: iso(int(m.group(1)), "never"), rule).replace("an integer", "a time")
    if field == "by":
        def span(m: re.Match) -> str:
            ms = int(m.group(1))
            return f"{ms / 86_400_000:g}d" if ms % 86_400_000 == 0 else f"{ms / 3_600_000:g}h"
        return _BOUND.sub(span, rule).replace("an integer", "a duration")
    return rule


def exit_code_of(err: BerthError) -> int:
    """The exit code of a refusal: whose move it is."""
    known = error_table.BY_CODE.get(err.code)
    if known is not None:
        return EXIT_OF_ACTOR[known.actor]
    if isinstance(err, TransportError):
        return EXIT_USAGE if err.details.get("tls") else EXIT_PLATFORM  # a failed handshake: nothing was sent
    if err.status is not None and err.status >= 500:
        return EXIT_PLATFORM
    if err.status is not None and 300 <= err.status < 400:
        return EXIT_USAGE  # a redirect: the URL is not the control plane's (the request did not reach it)
    if err.status is not None and 400 <= err.status < 500:
        return EXIT_CUSTOMER  # a 4xx (a proxy's, or a code this CLI does not know yet): still the request's
    return EXIT_CLI  # no status, or a 2xx answer it cannot read


def outcome_unknown(err: BerthError) -> bool:
    """Whether the request may have been carried out though no answer says so: no answer after every retry, the
    server's PROVIDER_UNAVAILABLE (a change may still commit), a 5xx or a 2xx the CLI cannot read."""
    if isinstance(err, TransportError):
        return not err.details.get("tls") and err.details.get("sent", True)
    if err.code == "PROVIDER_UNAVAILABLE":
        return True
    return error_table.BY_CODE.get(err.code) is None and (err.status is None or err.status >= 500
                                                           or 200 <= err.status < 300)


def _retry(ctx: Context, argv: Sequence[str], retry_same: str, create: bool, later: bool = False) -> list[str]:
    """The next command after an answer that leaves the outcome unknown. A create is safe to send again with the
    same key; an extend --by is not (repeated, it extends again): see the end first."""
    when_ = "retry later" if later else "retry"
    if create:
        return ["the request may have been accepted: do not use a new key for it",
                f"next: {when_} with the same key: " + retry_same]
    if ctx.args.group == "reservations" and ctx.args.command == "extend" and getattr(ctx.args, "by", None):
        rid = ctx.args.reservation_id
        return ["the extend may have been applied, and --by sent again extends again",
                "next: see its end: " + shlex.join(["berth", "reservations", "get", rid, *connection_flags(ctx)]),
                "then, if it did not move, extend to the end you want (safe to repeat): "
                + shlex.join(["berth", "reservations", "extend", rid, "--until", "END", *connection_flags(ctx)])]
    return [f"next: {when_}: " + retry_same]


def events_end(err: BerthError) -> int | None:
    """Where the control plane's events now end, when it refused an events cursor past them (its database was
    restored from an older copy, or failed over and lost its last commits); None for any other refusal."""
    newest = err.details.get("newest") if isinstance(err, InvalidInput) and err.field == "after" else None
    return newest if isinstance(newest, int) else None


def exit_code_of_operation(op: Operation) -> int:
    if op.status == "succeeded":
        return EXIT_OK
    if op.status not in TERMINAL:
        return EXIT_TIMEOUT
    actor = op.failure.actor if op.failure else ("customer" if op.status == "cancelled" else None)
    return EXIT_OF_ACTOR.get(actor or "", EXIT_CLI)


def _no_stock_advice(ctx: Context, err: BerthError) -> list[str]:
    """A shape no node of the pool can ever hold: the largest one it can, as the next command."""
    d, a = err.details, ctx.args
    most, with_most, fit = d.get("maxGpuCountPerNode") or 0, d.get("nodesWithMaxGpuCount") or 0, d.get("nodesThatFit") or 0
    asked = (a.gpu_count or 1) * (a.node_count or 1)
    command = a.command if a.command in ("create", "quote") else "quote"
    if most and (a.gpu_count or 1) > most:
        nodes = min(with_most, -(-asked // most))
        lines = [f"largest: {with_most} node(s) of {most} GPUs each"]
        lines.append("next: " + request_command(ctx, command, {"gpu_count": most, "node_count": nodes if nodes > 1 else None,
                                                               "quote_id": None}))
        return lines
    if fit and (a.node_count or 1) > fit:
        return [f"largest gang: {fit} node(s) with this share",
                "next: " + request_command(ctx, command, {"node_count": fit if fit > 1 else None, "quote_id": None})]
    return ["next: ask for less vCPU, memory or hugepages (--vcpu, --memory-gib, --hugepages), or fewer GPUs: "
            + request_command(ctx, "quote")]


def _capacity_advice(ctx: Context, err: BerthError) -> list[str]:
    lines: list[str] = []
    alts = err.alternatives
    cheapest = err.cheapest_eligible_usd_per_hour
    if err.reason:
        lines.append(f"reason: {err.reason}")
    if cheapest is not None:
        lines.append(f"cheapest eligible rate: {money_rate(cheapest)}")
    for alt in alts:
        start = f", fits from {when(alt.earliest_start)}" if alt.earliest_start is not None else ""
        lines.append(f"alternative: pool {alt.pool_id} ({alt.region}) at {money_rate(alt.total_running_usd_per_hour)}{start}")
    if err.reason == "no_stock" and not alts:
        return lines + _no_stock_advice(ctx, err)
    if ctx.args.command != "create":
        if alts:
            lines.append("next: " + request_command(ctx, "quote", {"pool_id": alts[0].pool_id}))
        return lines
    if err.reason == "price_ceiling" and cheapest is not None:
        # cheapest is the rate at which this request is accepted in its pool; a cheaper pool that fits the
        # ceiling as asked comes first.
        ceiling = Decimal(ctx.args.max_hourly_price) if ctx.args.max_hourly_price is not None else None
        within = [a for a in alts if a.total_running_usd_per_hour is not None
                  and (ceiling is None or a.total_running_usd_per_hour <= ceiling)]
        raise_to = request_command(ctx, "create", {"max_hourly_price": f"{cheapest}", "quote_id": None})
        if within:
            lines.append("next: " + request_command(ctx, "create", {"pool_id": within[0].pool_id, "quote_id": None},
                                                    keep=("max_hourly_price",)))
            lines.append("  or: " + raise_to)
        else:
            lines.append("next: " + raise_to)
    elif alts:
        change: dict[str, Any] = {"pool_id": alts[0].pool_id, "quote_id": None}
        ceiling = ctx.args.max_hourly_price
        price = alts[0].total_running_usd_per_hour
        if ceiling is not None and price is not None and Decimal(ceiling) < price:
            change["max_hourly_price"] = f"{price}"
        lines.append("next: " + request_command(ctx, "create", change, keep=("max_hourly_price",)))
    else:
        lines.append("next: change --gpu-model, --gpu-count or --node-count and quote again: "
                     + request_command(ctx, "quote"))
    return lines


LIST_OF_GROUP = {"confirmations": "berth confirmations list"}  # where a tenant command's ids are listed (default:
# reservations list, which shows reservations and their operations)

LIST_OF_FIELD = {"nodeId": "berth admin nodes list", "poolId": "berth admin pools list",
                 "tenantId": "berth admin tenants list"}


def _admin_advice(ctx: Context, err: BerthError) -> list[str] | None:
    """The operator's commands: what to run next (None: the tenant commands' advice applies as well)."""
    d = err.details
    flags = connection_flags(ctx)
    if err.code == "NOT_FOUND" and d.get("field") in LIST_OF_FIELD:
        return ["next: see what exists: " + shlex.join([*shlex.split(LIST_OF_FIELD[d["field"]]), *flags])]
    if err.code == "INVALID_STATE":
        lines = [f"state: {d.get('state')}"]
        nxt = d.get("next")
        if nxt == "wait":
            lines.append("next: wait; the node leaves this state on its own")
        elif nxt:
            lines.append("next: " + shlex.join([*shlex.split(str(nxt)), *flags]))
        return lines
    if err.code == "UNAUTHENTICATED":
        return [f"the token (from {ctx.settings.sources.get('token')}) is neither the bootstrap file's adminToken nor "
                "an operator's (a principal of kind operator): check --token, BERTH_TOKEN or the config file"]
    if err.code == "ACCESS_DENIED" and d.get("field") == "Authorization":  # a valid token of another API
        return [f"the token (from {ctx.settings.sources.get('token')}) is not one the admin API takes: give "
                f"{d.get('takes', 'the admin token or an operator')} with --token, BERTH_TOKEN or the config file"]
    if err.code == "ACCESS_DENIED":
        if d.get("policy"):
            return [f"refused by policy {d['policy']}" + (f": {d['reason']}" if d.get("reason") else "")
                    + ": ask whoever keeps the Cedar policies (docs/admin-api.md)"]
        return [f"no policy lets you {d.get('action')} on {d.get('resource')}: ask whoever keeps the Cedar policies "
                f"for a permit of Action::\"{d.get('action')}\" (docs/admin-api.md)"]
    return None


def advice(ctx: Context, err: BerthError, argv: Sequence[str]) -> list[str]:
    """What to tell the user about a refusal, beyond its message: the details that matter and the next command."""
    d = err.details
    code = err.code
    if ctx.args.group == "admin":
        lines = _admin_advice(ctx, err)
        if lines is not None:
            return lines
    create = ctx.args.group == "reservations" and ctx.args.command == "create"
    retry_same = (request_command(ctx, "create", {"idempotency_key": ctx.key}, keep=("quote_id", "max_hourly_price", "wait_ms", "idempotency_key"))
                  if create else same_command(ctx, argv))
    if code == "NO_CAPACITY":
        return _capacity_advice(ctx, err)
    if code in ("QUOTE_EXPIRED", "PRICE_CHANGED"):
        lines = []
        if "quotedUsdPerHour" in d:
            lines.append(f"quoted {money_rate(d['quotedUsdPerHour'])}, now {money_rate(d.get('totalRunningUsdPerHour'))}")
        lines.append("next: " + request_command(ctx, "quote"))
        lines.append("then: " + request_command(ctx, "create", {"quote_id": "QUOTE_ID"}, keep=("max_hourly_price",)))
        return lines
    if code == "CONFIRMATION_REQUIRED":
        return [f"approval needed: {err.approver} must approve confirmation {err.confirmation_id} "
                f"before {when(d.get('expiresAt'))}",
                f"  ({err.approver} runs: berth confirmations approve {err.confirmation_id})",
                "then retry with the same key: " + retry_same]
    if code == "QUOTA_EXCEEDED":
        resource = str(d.get("resource", ""))
        kind = resource.rsplit(":", 1)[-1]  # offer:POOL:vcpu is the pool's offer to the tenant
        flag = ("--gpu-count or --node-count" if resource.startswith("gpu:") else
                "--vcpu" if kind == "vcpu" else "--memory-gib or --hugepages" if kind == "memoryGiB" else "the request")
        limit = (f"pool {resource.split(':')[1]}'s {kind} quota for your tenant (its offer)"
                 if resource.startswith("offer:") else f"the tenant's {resource} quota")
        within = d.get("withinShare") or 0
        counted = (f"{d.get('requested')} above the {within} that come with the GPUs count against it"
                   if within else f"this needs {d.get('requested')}")
        return [f"quota {resource}: {counted}; {d.get('used')} of {d.get('limit')} in use",
                f"next: reduce {flag}, or ask an admin to raise {limit}",
                ("  after the quota is raised, the same key continues the request: " if create else
                 "  after the quota is raised: ") + retry_same]
    if code == "PROVIDER_UNAVAILABLE":
        return [f"the platform's doing (actor {err.actor or 'platform'}): nothing of yours needs to change",
                f"reference: {err.reference} (quote it to support if this persists)",
                *_retry(ctx, argv, retry_same, create, later=True)]
    if isinstance(err, TransportError) and d.get("tls"):
        return [f"url from {ctx.settings.sources.get('url')}; nothing was sent",
                "next: fix the connection settings, then: " + retry_same]
    if isinstance(err, TransportError):
        lines = [f"no answer from {ctx.settings.url} (url from {ctx.settings.sources.get('url')})"]
        if d.get("hint"):
            lines.append(d["hint"])
        if not d.get("sent", True):  # nothing went out: the same command is safe, whatever it is
            return lines + [("next: retry with the same key: " if create else "next: retry: ") + retry_same]
        return lines + _retry(ctx, argv, retry_same, create)
    if err.status is not None and 300 <= err.status < 400:
        return [f"url from {ctx.settings.sources.get('url')}: give the control plane's own base URL (--url, BERTH_URL "
                "or the config file)" + (f"; it redirects to {d['redirect']}" if d.get("redirect") else "")]
    if outcome_unknown(err):  # a 5xx or an unreadable answer (a proxy's page, another version's code)
        return [f"the answer does not say what happened (url from {ctx.settings.sources.get('url')}; a proxy or "
                "load balancer between may have answered)", *_retry(ctx, argv, retry_same, create, later=True)]
    end = events_end(err)
    if end is not None:  # a cursor from before a restore or a failover: the new events follow the end
        return [f"the control plane's events now end at {end} (its database was restored or failed over)",
                "next: " + same_command(ctx, [*without(argv, "--after"), "--after", str(end)])]
    if code == "INVALID_INPUT":
        field, _, index = str(err.field).partition("[")  # access.sshKeys[1]: the second --ssh-key
        flag = FLAG_OF_FIELD.get(field, "")
        if flag and index.rstrip("]").isdigit():
            flag = f"{flag} number {int(index.rstrip(']')) + 1}"
        rule = in_flag_units(field, d.get("rule", err.message))
        return [f"next: fix {flag} ({rule})" if flag else f"next: fix the request ({err.message})"]
    if code == "UNAUTHENTICATED":
        return [f"the token (from {ctx.settings.sources.get('token')}) is not accepted: check --token, BERTH_TOKEN "
                "or the config file"]
    if code == "ACCESS_DENIED":
        conf = d.get("confirmationId")
        if conf and ctx.args.group == "confirmations":  # deciding one that is not this principal's to decide
            lines = [f"only {d.get('approver', 'the delegating user')} may approve or deny {conf}: ask them to run "
                     f"berth confirmations approve {conf}"]
        elif conf:  # a person decided (or let it lapse), not a policy
            how = {"denied": f"was denied by {d.get('approver', 'its approver')}",
                   "expired": "expired before it was decided"}.get(d.get("status"), "was denied or lapsed")
            lines = [f"confirmation {conf} {how}: if it is still wanted, ask {d.get('approver', 'its approver')} "
                     "first, then send a new request"]
        elif d.get("policy"):
            lines = [f"refused by policy {d['policy']}" + (f": {d['reason']}" if d.get("reason") else "")
                     + "; change the request, or ask a tenant admin about the policy"]
        else:
            lines = ["no policy permits this for your principal: ask a tenant admin for a permit"]
        if create and getattr(ctx.args, "idempotency_key", None):
            lines.append("a refused key stays refused: a new request needs a new key (drop --idempotency-key)")
        return lines
    if code == "COMPUTE_ACCESS_REQUIRED" and d.get("field") == "Authorization":  # a valid token of another API
        return [f"the token (from {ctx.settings.sources.get('token')}) is not a tenant's: give {d.get('takes')} "
                "with --token, BERTH_TOKEN or the config file (operators: berth admin ...)"]
    if code == "COMPUTE_ACCESS_REQUIRED":
        return [f"the token (from {ctx.settings.sources.get('token')}) has {d.get('scope')} access; this needs "
                f"{d.get('required', 'manage')}: use a token with scope {d.get('required', 'manage')}"]
    # A create refused for money keeps its draft, as for quota: the same key continues it once the budget allows.
    continues = (["  after the budget is raised, the same key continues the request: " + retry_same] if create else [])
    if code == "SPEND_LIMIT_REACHED":
        return [f"spent {d.get('spentUsd')} of {d.get('budgetUsd')} USD: ask an admin to raise the budget", *continues]
    if code == "INSUFFICIENT_FUNDS":
        return [f"{d.get('leftUsd')} USD left, this may bill {d.get('exposureUsd')} USD: "
                "ask for fewer GPUs or hours (a new request: drop --idempotency-key), or have the budget raised",
                *continues]
    if code == "CONFLICT":
        if d.get("reason") == "extend-in-flight":
            return [f"next: retry in {err.retry_after_seconds or 1:g} s: " + same_command(ctx, argv)]
        rid = err.reservation_id
        if rid is None:  # the key's request was never accepted: nothing to get
            return ["the key belongs to another request, which was not accepted: a new request needs a new key "
                    "(drop --idempotency-key)"]
        return [f"the key belongs to another request (reservation {rid}): a new request needs a new key "
                "(drop --idempotency-key)", f"see it: berth reservations get {rid}"]
    if code == "INVALID_STATE":
        rid = d.get("reservationId") or getattr(ctx.args, "reservation_id", None)
        lines = [f"state: {d['state']}"] if d.get("state") else [f"status: {d['status']}"] if d.get("status") else []
        if d.get("next") == "release":
            lines.append(f"next: berth reservations release {rid}")
        return lines
    if code == "NOT_FOUND" and err.message.startswith("no method "):  # the path, not an id, was not found
        return [f"the URL {ctx.settings.url} (from {ctx.settings.sources.get('url')}) does not reach this method of a "
                "Berth control plane: give its base URL, with no path (a proxy's prefix included only where the "
                "proxy strips it), or the control plane is of an earlier release than this CLI (berth --version)"]
    if code == "NOT_FOUND":
        if d.get("field") == "poolId":
            return ["the pool is not yours or offered to you; the pools you may book: "
                    + shlex.join(["berth", "pools", "list", *connection_flags(ctx)])]
        listing = LIST_OF_GROUP.get(ctx.args.group, "berth reservations list")
        return ["next: check the id: " + shlex.join([*shlex.split(listing), *connection_flags(ctx)])]
    if code == "UNSUPPORTED":
        return ["next: use --binding hold, node or kubernetes"]
    return []


def report_refusal(ctx: Context, err: BerthError, argv: Sequence[str]) -> int:
    code = exit_code_of(err)
    if ctx.structured:
        envelope = {"error": {"code": err.code, "message": err.message, "details": err.details}}
        streaming = getattr(ctx.args, "follow", False) or getattr(ctx.args, "watch", False)
        # a stream's records are one line each (--follow --json): its last one, the refusal, too
        (ctx.emit_record if streaming else ctx.emit)(envelope, "")
    status = f" (HTTP {err.status})" if err.status else ""
    ctx.say(f"berth: {err.code}{status}: {humane(err.message)}")
    for line in advice(ctx, err, argv):
        ctx.say(line)
    return code


