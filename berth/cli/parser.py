"""The tenant CLI's arguments: one parser, its request flags made from the client's ReservationRequest fields."""
from __future__ import annotations

import argparse
import os
from dataclasses import Field, fields
from typing import Any, Callable, Sequence

from berth.client import ReservationRequest, now_ms, parse_duration_ms, parse_time
from common import argtypes, money
from common.money import parse_money

DEFAULT_WAIT_S = 600
OUTPUTS = ("table", "wide", "json", "yaml")  # -o: table and wide for people, json and yaml for programs

# ---- argument types -----------------------------------------------------------

def _time_of(now: int) -> Callable[[str], int]:
    """The type of every time flag: now, +30m, ISO 8601 or epoch ms as epoch ms, relative to one `now` for the whole
    invocation (so --start now --end +1h is exactly an hour, and every retry sends the same body)."""
    def time_arg(text: str) -> int:
        try:
            return parse_time(text, now)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    time_arg.__name__ = "time"  # argparse names the type in its error: "invalid time value"
    return time_arg


def _price_text(text: str) -> str:
    """Sent as written, so it must be the wire's money: a typo such as 1e3 is not quietly a $1000/hr ceiling."""
    if parse_money(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give a price in USD per hour in {money.RULE}")
    return text


def _duration_ms(text: str) -> int:
    """90m, 2h, 1d, 3600s or 500ms as milliseconds."""
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _SumDurations(argparse.Action):
    """A repeated duration flag adds up: --by 1h --by 30m is 90 minutes."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest, None) or 0) + values)


# ---- the request's flags: one per ReservationRequest field ----------------------------


def _ssh_key(text: str) -> str:
    """A public key as given: its line, or the path of a .pub file holding it (the server checks the key)."""
    if text.lstrip().startswith(("ssh-", "ecdsa-", "sk-")):
        return text.strip()
    path = os.path.expanduser(text)
    if not os.path.isfile(path):  # neither a key's line nor a file: do not send a path as if it were a key
        raise argparse.ArgumentTypeError(f"{text}: no such file, and not a public key's line (TYPE BASE64 "
                                         "[COMMENT]); give one, or the path of its .pub file")
    try:
        with open(path, encoding="utf-8") as f:
            line = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot read the key file: {exc}") from None
    if "PRIVATE KEY-----" in line:  # never sent: only its first line would be, and it is a secret
        raise argparse.ArgumentTypeError(f"{text}: is a private key; give its public key, {text}.pub")
    if "\n" in line:
        raise argparse.ArgumentTypeError(f"{text}: holds more than one line; give one public key per --ssh-key")
    return line


def flag_of(f: Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _add_field(p, f: Field, time_arg: Callable[[str], int], required: bool = False) -> None:
    kind = f.metadata["kind"]
    kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
    annotation = str(f.type)
    if annotation.startswith("bool"):
        p.add_argument(flag_of(f), action="store_true", default=None, **kw)
        return
    if f.metadata["metavar"]:
        kw["metavar"] = f.metadata["metavar"]
    if kind == "keys":
        p.add_argument(flag_of(f), action="append", type=_ssh_key, **kw)
        return
    if kind == "time":
        kw["type"] = time_arg
    elif kind == "price":
        kw["type"] = _price_text
    elif annotation.startswith("int"):
        kw["type"] = int
    elif annotation.startswith("float"):
        kw["type"] = argtypes.finite
    if f.name == "sharing":
        kw["choices"] = ("exclusive", "mig", "slots")
    p.add_argument(flag_of(f), required=required, **kw)


WINDOW = ("duration_hours", "end")  # one of them is required


def _request_flags(p: argparse.ArgumentParser, create: bool, time_arg: Callable[[str], int]) -> None:
    window = p.add_mutually_exclusive_group(required=True)
    for f in fields(ReservationRequest):
        if f.metadata["create_only"] and not create:
            continue
        _add_field(window if f.name in WINDOW else p, f, time_arg, required=f.name in ("pool_id", "gpu_model"))


def request_of(args: argparse.Namespace) -> ReservationRequest:
    """The request this invocation's flags give."""
    return ReservationRequest(**{f.name: getattr(args, f.name, None) for f in fields(ReservationRequest)})


# API fields named in INVALID_INPUT details -> the flag that sets them.
FLAG_OF_FIELD = {
    **{f.metadata["wire"]: flag_of(f) for f in fields(ReservationRequest)},
    "resources": "--vcpu/--memory-gib/--hugepages", "idempotencyKey": "--idempotency-key",
    "access": "--ssh-key", "access.sshKeys": "--ssh-key",
    "Idempotency-Key": "--idempotency-key", "until": "--until", "by": "--by", "since": "--since",
    "cursor": "--cursor", "limit": "--limit", "state": "--state", "scope": "--scope", "Authorization": "--token",
    "from": "--from", "reason": "--reason", "after": "--after", "nodeId": "NODE", "tenantId": "TENANT",
}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a: Any, **kw: Any):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)


def _common() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    conn = common.add_argument_group("connection (flag, then environment, then the config file's profile, then its "
                                     "top-level keys)")
    conn.add_argument("--url", help="the control plane, e.g. https://cp.example.net:8080 (env BERTH_URL)")
    conn.add_argument("--token", help="your bearer token (env BERTH_TOKEN)")
    conn.add_argument("--config", metavar="PATH",
                      help='JSON {"url": ..., "token": ..., "caFile": ..., "profiles": {NAME: {"url": ...}}} '
                           "(default $XDG_CONFIG_HOME/berth/config.json or ~/.config/berth/config.json)")
    conn.add_argument("--profile", metavar="NAME",
                      help='read the config file\'s profiles.NAME before its top-level keys (env BERTH_PROFILE; '
                           'default: the file\'s "profile", if any)')
    conn.add_argument("--ca-file", metavar="FILE",
                      help="verify an https:// control plane with the CA certificates in this PEM file instead of "
                           "the system trust store (env BERTH_CA_FILE, config caFile)")
    conn.add_argument("--client-cert", metavar="FILE",
                      help="show this PEM certificate to a control plane that requires client certificates "
                           "(env BERTH_CLIENT_CERT, config clientCert; needs --client-key)")
    conn.add_argument("--client-key", metavar="FILE",
                      help="the unencrypted PEM key of --client-cert (env BERTH_CLIENT_KEY, config clientKey)")
    conn.add_argument("--retries", type=argtypes.whole(0), default=4, metavar="N",
                      help="retries of transport errors and PROVIDER_UNAVAILABLE, same idempotency key (default 4)")
    conn.add_argument("--request-timeout", type=argtypes.seconds, default=30.0, metavar="SECONDS",
                      help="seconds per attempt (default 30)")
    out = common.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", choices=OUTPUTS,
                     help="table (the default on a terminal, fitted to its width), wide (reservations: also binding, "
                          "spot and principal), json (the API's, the default when stdout is not a terminal) or yaml")
    out.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")
    out.add_argument("--table", dest="output", action="store_const", const="table", help="the same as -o table")
    return common


def _command(subs, name: str, aliases: Sequence[str] = (), **kw: Any) -> argparse.ArgumentParser:
    """A command and its aliases (`ls` for list, `rm` for release); args.command is the name whichever was typed."""
    p = subs.add_parser(name, aliases=list(aliases), **kw)
    p.set_defaults(command=name)
    return p


def _list(subs, **kw: Any) -> argparse.ArgumentParser:
    return _command(subs, "list", ("ls",), **kw)


def build_parser(now: int | None = None) -> argparse.ArgumentParser:
    """The tenant CLI's parser; every time flag's now and +1h count from `now` (default: the clock, read once)."""
    time_arg = _time_of(now_ms() if now is None else now)
    common = _common()
    parser = _Parser(prog="berth", description="Berth's tenant commands")
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")

    res = groups.add_parser("reservations", help="create, read and end reservations").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    create = _command(res, "create", parents=[common], help="reserve GPUs (202 Accepted; then wait on the operation)")
    _request_flags(create, create=True, time_arg=time_arg)
    create.add_argument("--idempotency-key", metavar="KEY",
                        help="the request's key; default: a new one per invocation, kept across its retries")
    quote = _command(res, "quote", parents=[common], help="price a request now (creates nothing)")
    _request_flags(quote, create=False, time_arg=time_arg)
    for name, aliases, text in (("get", (), "show a reservation"),
                                ("release", ("rm",), "end a reservation now, refunding its quota"),
                                ("cancel", (), "withdraw a pending or placed reservation"),
                                ("renew", (), "move the lease deadline to now plus leaseSeconds")):
        sub = _command(res, name, aliases, parents=[common], help=text)
        sub.add_argument("reservation_id", metavar="RESERVATION")
    extend = _command(res, "extend", parents=[common], help="move the end later, all or nothing")
    extend.add_argument("reservation_id", metavar="RESERVATION")
    how = extend.add_mutually_exclusive_group(required=True)
    how.add_argument("--until", type=time_arg, metavar="TIME",
                     help="the new end: +2h (from now), ISO 8601 or epoch ms (safe to retry)")
    how.add_argument("--by", type=_duration_ms, action=_SumDurations, metavar="DURATION",
                     help="extend by, e.g. 30m, 2h; repeated, the durations add up (--by 1h --by 30m: 90m); "
                          "running the command again extends again")
    lst = _list(res, parents=[common], help="your reservations, newest first (--watch: and then each change)")
    lst.add_argument("--scope", choices=("mine", "all"), help="mine (default) or the whole tenant's you may read")
    lst.add_argument("--state", help="pending, placed, binding, active, released or cancelled")
    lst.add_argument("--pool", help="only this pool")
    lst.add_argument("--limit", type=int, help="1 to 200 (default 50)")
    lst.add_argument("--cursor", help="the nextCursor of the previous page")
    lst.add_argument("--watch", "-w", action="store_true",
                     help="then print a reservation's row again each time it changes, until Ctrl-C (a long poll "
                          "on the events cursor; json: one object per line, yaml: one document each)")

    pools = groups.add_parser("pools", help="what you can book: your tenant's pools and their free devices"
                              ).add_subparsers(dest="command", required=True, metavar="COMMAND")
    pool_list = _list(pools, parents=[common], help="the pools your tenant owns or is offered")
    pool_get = _command(pools, "get", parents=[common], help="one pool, with its free devices over the window")
    pool_get.add_argument("pool_id", metavar="POOL")
    for sub in (pool_list, pool_get):
        sub.add_argument("--from", dest="start", type=time_arg, metavar="TIME",
                         help="free devices from (default now; also +1d, ISO 8601 or epoch ms)")
        sub.add_argument("--until", type=time_arg, metavar="TIME", help="until (default a week after --from)")
    groups.add_parser("whoami", parents=[common], help="who your token speaks for: tenant, principal, kind, scope")

    events = groups.add_parser("events", help="what happened to your tenant's reservations").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    ev_list = _list(events, parents=[common], help="the tenant's events, oldest first (--follow: "
                    "and then each new one as it happens, until Ctrl-C)")
    ev_list.add_argument("--after", type=int, metavar="SEQ", help="only events after this cursor (an event's seq)")
    ev_list.add_argument("--limit", type=int, help="events per page, 1 to 500 (default 100)")
    ev_list.add_argument("--reservation", metavar="RESERVATION", help="only this reservation's events")
    ev_list.add_argument("--follow", "-f", action="store_true",
                         help="keep printing events as they are committed (a long poll on the cursor)")

    ops = groups.add_parser("operations", help="the long-running record of each mutation").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    get_op = _command(ops, "get", parents=[common], help="show an operation")
    get_op.add_argument("operation_id", metavar="OPERATION")
    wait = _command(ops, "wait", parents=[common], help="wait until the operation ends, showing the reservation's "
                    "conditions (exit code by failure.actor; gives up at once when the reservation is stuck)")
    wait.add_argument("operation_id", metavar="OPERATION")
    wait.add_argument("--timeout-sec", type=argtypes.seconds, default=DEFAULT_WAIT_S, metavar="N",
                      help=f"give up after N seconds with exit code 6 (default {DEFAULT_WAIT_S})")

    usage = groups.add_parser("usage", parents=[common], help="charge history: lines per reservation and UTC day, totals")
    usage.add_argument("--reservation", metavar="RESERVATION", help="only this reservation")
    usage.add_argument("--since", type=time_arg, metavar="DAY",
                       help="UTC days starting at or after (2026-12-01, --since=-7d, now or epoch ms)")
    usage.add_argument("--until", type=time_arg, metavar="DAY", help="UTC days starting before (as --since)")
    usage.add_argument("--limit", type=int, help="lines per page, 1 to 500 (default 100)")
    usage.add_argument("--cursor", help="the nextCursor of the previous page")

    conf = groups.add_parser("confirmations", help="approvals asked by your delegated agents").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    conf_list = _list(conf, parents=[common], help="confirmations you asked or are asked")
    conf_list.add_argument("--status", choices=("pending", "approved", "denied", "expired"))
    conf_list.add_argument("--limit", type=int)
    for name in ("get", "approve", "deny"):
        sub = _command(conf, name, parents=[common], help=f"{name} a confirmation")
        sub.add_argument("confirmation_id", metavar="CONFIRMATION")

    admin = groups.add_parser("admin", help="the operator's commands (--token: the bootstrap file's adminToken, or "
                                            "an operator principal's token)")
    admin_groups = admin.add_subparsers(dest="admin_group", required=True, metavar="GROUP")
    nodes = admin_groups.add_parser("nodes", help="the fleet's nodes").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    node_list = _list(nodes, parents=[common], help="every node: state, agent, heartbeat, bookings now and next")
    node_list.add_argument("--pool", help="only this pool")
    node_list.add_argument("--state", choices=("ready", "cordoned", "draining", "cleaning", "maintenance", "lost"))
    node_get = _command(nodes, "get", parents=[common], help="one node, with its bookings in the window")
    node_get.add_argument("node_id", metavar="NODE")
    for sub in (node_list, node_get):
        sub.add_argument("--from", dest="start", type=time_arg, metavar="TIME",
                         help="bookings from (default now; also +1d, ISO 8601 or epoch ms)")
        sub.add_argument("--until", type=time_arg, metavar="TIME", help="bookings until (default a week after --from)")
    for name, text in (("cordon", "no new placements on the node; its bookings stay"),
                       ("uncordon", "a cordoned or draining node takes placements again"),
                       ("drain", "cordon, and move placed reservations that have not started to other nodes "
                                 "(or back to pending); active ones run to their end"),
                       ("clear", "a node in maintenance becomes ready")):
        sub = _command(nodes, name, parents=[common], help=text)
        sub.add_argument("node_id", metavar="NODE")
        sub.add_argument("--reason", help="why, recorded in the node's event and the log")
    release = _command(nodes, "release-identity", parents=[common],
                       help="let the node's next registration come from any host (a replaced machine)")
    release.add_argument("node_id", metavar="NODE")
    pools = admin_groups.add_parser("pools", help="the fleet's pools").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    _list(pools, parents=[common], help="every pool: nodes by state, GPUs in use and free")
    pool_get = _command(pools, "get", parents=[common], help="one pool")
    pool_get.add_argument("pool_id", metavar="POOL")
    tenants = admin_groups.add_parser("tenants", help="the tenants").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    _list(tenants, parents=[common], help="every tenant: quota used, budget, spend")
    tenant_get = _command(tenants, "get", parents=[common], help="one tenant: each quota row, budget, spend")
    tenant_get.add_argument("tenant_id", metavar="TENANT")
    events = admin_groups.add_parser("events", help="what operators did to nodes").add_subparsers(
        dest="command", required=True, metavar="COMMAND")
    event_list = _list(events, parents=[common], help="the fleet's events, oldest first")
    event_list.add_argument("--after", type=int, metavar="SEQ", help="the nextCursor of the previous page")
    event_list.add_argument("--limit", type=int, help="1 to 500 (default 100)")
    return parser
