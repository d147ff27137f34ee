"""Wire schemas: one msgspec definition per request and answer shape, validated strictly.

Decoding failures become INVALID_INPUT naming the field and the rule; the
answers are built here too, so each wire shape has exactly one definition.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from common.money import parse_money
from common.sshkeys import SshKeyError, parse_public_key
from controlplane.commands import Create, Extend, ListQuery
from controlplane.domain.admission import CreateRequest, ResourcesAsk
from controlplane.domain.clock import HOUR_MS
from controlplane.domain.errors import DomainError, INVALID_INPUT, invalid
from controlplane.domain.ids import fingerprint
from controlplane.domain.model import Bound, Operation, Reservation
from controlplane.domain.pricing import money
from controlplane.domain.states import PUBLIC_STATES, TERMINAL

Id = Annotated[str, Meta(min_length=1, max_length=128)]
Key = Annotated[str, Meta(min_length=1, max_length=255)]
EpochMs = Annotated[int, Meta(ge=0, le=32503680000000)]  # up to year 3000
Count = Annotated[int, Meta(ge=1, le=1024)]


class Resources(Struct, forbid_unknown_fields=True):
    vcpu: Annotated[float, Meta(ge=0, le=1_000_000)] | None = None
    memoryGiB: Annotated[float, Meta(ge=0, le=100_000_000)] | None = None
    hugepages1Gi: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None


MAX_SSH_KEYS = 16


class Access(Struct, forbid_unknown_fields=True):
    """How a node binding's tenant logs in: its OpenSSH public keys (each checked by common/sshkeys.py)."""

    sshKeys: Annotated[list[str], Meta(min_length=1, max_length=MAX_SSH_KEYS)]


class Wait(Struct, forbid_unknown_fields=True):
    timeoutMs: Annotated[int, Meta(ge=0, le=30_000)] = 0


class CreateBody(Struct, forbid_unknown_fields=True):
    poolId: Id
    gpuModel: Id
    gpuCount: Count | None = None
    nodeCount: Count = 1
    sharing: Id | None = None
    migProfile: Id | None = None
    start: EpochMs | None = None
    end: EpochMs | None = None
    durationHours: Annotated[float, Meta(gt=0, le=8784)] | None = None
    binding: Annotated[str, Meta(max_length=128)] = "hold"  # "" too is a binding Berth does not have: UNSUPPORTED
    resources: Resources | None = None
    spot: bool = False
    leaseSeconds: Annotated[int, Meta(ge=30, le=604800)] | None = None
    access: Access | None = None  # binding node: required
    idempotencyKey: Key | None = None
    wait: Wait | None = None
    quoteId: str | None = None  # any text: one that is no quote of the tenant (malformed too) is QUOTE_EXPIRED
    maxHourlyPrice: Annotated[str, Meta(min_length=1, max_length=32)] | None = None


class ReservationRef(Struct, forbid_unknown_fields=True):
    reservationId: Id


class ExtendBody(Struct, forbid_unknown_fields=True):
    reservationId: Id
    until: EpochMs | None = None
    by: Annotated[int, Meta(ge=1, le=366 * 24 * 3_600_000)] | None = None
    idempotencyKey: Key | None = None  # accepted, never replayed: a repeated `by` extends again


class ConfirmationRef(Struct, forbid_unknown_fields=True):
    confirmationId: Id


class ConfirmationList(Struct, forbid_unknown_fields=True):
    status: Literal["pending", "approved", "denied", "expired"] | None = None
    limit: Annotated[int, Meta(ge=1, le=200)] = 50


class OperationRef(Struct, forbid_unknown_fields=True):
    operationId: Id


class OperationWait(Struct, forbid_unknown_fields=True):
    operationId: Id
    timeoutMs: Annotated[int, Meta(ge=0, le=60_000)] = 30_000


class UsageBody(Struct, forbid_unknown_fields=True):
    reservationId: Id | None = None
    since: EpochMs | None = None  # UTC days starting at or after
    until: EpochMs | None = None  # UTC days starting before
    limit: Annotated[int, Meta(ge=1, le=500)] = 100
    cursor: Annotated[str, Meta(min_length=1, max_length=200)] | None = None


class ListBody(Struct, forbid_unknown_fields=True):
    scope: Literal["mine", "all"] = "mine"
    state: Id | None = None
    poolId: Id | None = None
    limit: Annotated[int, Meta(ge=1, le=200)] = 50
    cursor: Id | None = None


EVENTS_WAIT_MAX_MS = 30_000


class EventsPage(Struct, forbid_unknown_fields=True):
    after: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None
    limit: Annotated[int, Meta(ge=1, le=500)] = 100


class EventsBody(EventsPage, forbid_unknown_fields=True):
    waitMs: Annotated[int, Meta(ge=0, le=EVENTS_WAIT_MAX_MS)] = 0  # a long poll: answer once there is an event
    fromEnd: bool = False  # no events, only the cursor after the newest: where a watch starts


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_NAMED = re.compile(r"field `(?P<name>[^`]+)`")


_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "object": "an object", "array": "an array", "null": "null"}
_EXPECTED = re.compile(r"^Expected `(?P<kind>[^`]+)`(?P<rest>.*?)(?:, got `(?P<got>[^`]+)`)?$")


def _rule(text: str) -> str:
    """msgspec's "Expected `int` >= 1, got `str`" as "must be an integer >= 1 (got a string)"."""
    m = _EXPECTED.match(text)
    if not m:
        return text[:1].lower() + text[1:]
    kinds = " or ".join(_KINDS.get(k.strip(), k.strip()) for k in m.group("kind").split("|"))
    out = f"must be {kinds}{m.group('rest')}"
    if m.group("got"):
        out += f" (got {_KINDS.get(m.group('got'), m.group('got'))})"
    return out


def field_of(message: str, schema: type | None = None) -> tuple[str, str]:
    """(field path, rule) out of a msgspec message such as "Expected `int` >= 1 - at `$.gpuCount`" ("body" where
    the document as a whole is wrong); given the schema, a value that is none of a field's choices names them."""
    path = ""
    rule = message
    m = _AT.search(message)
    if m:
        path = m.group("path").lstrip(".")
        rule = message[: m.start()]
    named = _NAMED.search(rule)
    if named and ("unknown field" in rule or "missing required field" in rule):
        path = f"{path}.{named.group('name')}" if path else named.group("name")
        rule = "is not a field of this request" if "unknown field" in rule else "is required"
    rule = _rule(rule)
    choices = _choices_at(schema, path) if schema is not None and rule.startswith("invalid enum value") else ()
    if choices:
        rule += f": give one of {', '.join(map(repr, choices))}"
    return path or "body", rule


def _choices_at(schema: type, path: str) -> tuple:
    """The values a Literal field at `path` (as field_of writes it: `pools[7].policy.cleaning`) allows; () when
    the path does not lead to one."""
    import msgspec.inspect as mi

    node: Any = mi.type_info(schema)
    for step in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if isinstance(node, mi.UnionType):  # an optional (X | None, bool | Struct): the struct or list inside
            node = next((t for t in node.types if isinstance(t, (mi.StructType, mi.ListType, mi.DictType))), None)
        if step.startswith("["):
            node = node.item_type if isinstance(node, mi.ListType) else None
        elif isinstance(node, mi.StructType):
            node = next((f.type for f in node.fields if f.encode_name == step), None)
        elif isinstance(node, mi.DictType):
            node = node.value_type
        else:
            node = None
        if node is None:
            return ()
    if isinstance(node, mi.UnionType):
        node = next((t for t in node.types if isinstance(t, mi.LiteralType)), None)
    return node.values if isinstance(node, mi.LiteralType) else ()


def syntax_error(body: bytes) -> msgspec.DecodeError | None:
    """The JSON syntax error in body, if any. The typed decoder streams: a bad field before a syntax error is met
    first, and the body must still read as bad JSON."""
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError as syntax:
        return syntax
    return None


def decode(body: bytes, schema: type[Struct]) -> Any:
    try:
        return msgspec.json.decode(body or b"{}", type=schema)
    except msgspec.ValidationError as exc:
        syntax = syntax_error(body or b"{}")
        if syntax is not None:
            raise DomainError(INVALID_INPUT, f"body: not valid JSON ({syntax})",
                              {"field": "body", "rule": "must be a JSON object"}) from None
        field, rule = field_of(str(exc), schema)
        raise DomainError(INVALID_INPUT, f"{field}: {rule}", {"field": field, "rule": rule}) from None
    except msgspec.DecodeError as exc:
        raise DomainError(INVALID_INPUT, f"body: not valid JSON ({exc})", {"field": "body", "rule": "must be a JSON object"}) from None


def fingerprint_of(body: CreateBody) -> str:
    """The fingerprint of the canonical request an idempotency key is compared on: the fields that are not at
    their defaults, so that a field a later release adds, left out, changes no key's fingerprint.

    Left out: `wait`, the key itself, and the quote and price ceiling (a
    retry of one ambiguous launch from a refreshed quote is the same intent).
    """
    return fingerprint(msgspec.json.encode(_set_fields(_fingerprinted(body))))


def _fingerprinted(body: CreateBody) -> CreateBody:
    return msgspec.structs.replace(body, wait=None, idempotencyKey=None, quoteId=None, maxHourlyPrice=None)


_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _set_fields(value: Any) -> Any:
    """A struct as a dict of the fields that differ from their defaults (compared by value: msgspec's
    omit_defaults compares a string by identity, so a decoded "hold" would stay), nested structs the same way."""
    if not isinstance(value, Struct):
        return value
    defaults = _DEFAULTS.get(type(value))
    if defaults is None:
        defaults = _DEFAULTS[type(value)] = tuple((f.name, f.default) for f in msgspec.structs.fields(value))
    return {name: _set_fields(v) for name, default in defaults if (v := getattr(value, name)) != default}


# Fields releases added to CreateBody since keys were first fingerprinted, newest first: each release before
# 2026-12-07 fingerprinted every field it had, those at their defaults too.
_ADDED = (("access",), ("quoteId", "maxHourlyPrice"))


def earlier_fingerprints(body: CreateBody) -> tuple[str, ...]:
    """The fingerprints releases before this one stored for the same request (every field they knew, null or
    not): a key recorded by one of them replays after an upgrade, and on a replica of this release beside one."""
    doc = msgspec.to_builtins(_fingerprinted(body))  # every field, null or not, as msgspec.json.encode has them
    forms = [fingerprint(msgspec.json.encode(doc))]
    for added in _ADDED:
        if any(doc.get(name) is not None for name in added):
            break  # a request that sets a field no earlier release had: only this release's forms
        doc = {k: v for k, v in doc.items() if k not in added}
        forms.append(fingerprint(msgspec.json.encode(doc)))
    return tuple(forms)


# ---- wire -> commands (the one conversion into the services' terms) ---------

def ssh_keys_of(access: Access | None) -> tuple[str, ...] | None:
    """access.sshKeys checked, each as its canonical line; INVALID_INPUT naming access.sshKeys[i] and the rule."""
    if access is None:
        return None
    lines: list[str] = []
    seen: dict[bytes, int] = {}
    for i, line in enumerate(access.sshKeys):
        field = f"access.sshKeys[{i}]"
        try:
            key = parse_public_key(line)
        except SshKeyError as exc:
            raise DomainError(INVALID_INPUT, f"{field}: {exc.detail}",
                              {"field": field, "rule": exc.rule}) from None
        if key.blob in seen:
            raise DomainError(INVALID_INPUT, f"{field}: the same key as access.sshKeys[{seen[key.blob]}] "
                              f"({key.fingerprint}): send each key once", {"field": field, "rule": "duplicate"})
        seen[key.blob] = i
        lines.append(key.line())
    return tuple(lines)


# The least a share may ask that a node can enforce (0 asks none): the kernel's smallest CPU quota is 1 ms of each
# 100 ms period, and memory is booked in MiB. Less was accepted, and either never bound (cpu.max refused) or, rounded
# to 0, bound with no limit at all.
LEAST_VCPU = 0.01
LEAST_MEMORY_GIB = 1 / 1024


def _enforceable(res: Resources | None) -> None:
    if res is None:
        return
    if res.vcpu is not None and 0 < res.vcpu < LEAST_VCPU:
        raise invalid("resources.vcpu", f"0 or at least {LEAST_VCPU}: a node cannot give less than 1 ms of CPU time "
                      f"in each 100 ms (got {res.vcpu:g})")
    if res.memoryGiB is not None and 0 < res.memoryGiB < LEAST_MEMORY_GIB:
        raise invalid("resources.memoryGiB", f"0 or at least {LEAST_MEMORY_GIB} (1 MiB, the unit memory is booked "
                      f"in; got {res.memoryGiB:g})")


def create_request(body: CreateBody) -> CreateRequest:
    res = body.resources
    _enforceable(res)
    return CreateRequest(
        pool_id=body.poolId,
        gpu_model=body.gpuModel,
        gpu_count=body.gpuCount,
        node_count=body.nodeCount,
        sharing=body.sharing,
        mig_profile=body.migProfile,
        start=body.start,
        end=body.end,
        duration_ms=round(body.durationHours * HOUR_MS) if body.durationHours is not None else None,
        binding=body.binding,
        resources=None if res is None else ResourcesAsk(
            None if res.vcpu is None else round(res.vcpu * 1000),
            None if res.memoryGiB is None else round(res.memoryGiB * 1024),
            res.hugepages1Gi,
        ),
        spot=body.spot,
        lease_seconds=body.leaseSeconds,
        ssh_keys=ssh_keys_of(body.access),
    )


def create_command(body: CreateBody, header_key: str | None) -> Create:
    """A create (or a quote) as the service takes it; INVALID_INPUT for what only the wire can get wrong. A key in
    the header is printable ASCII (what a header can carry); one in the body may be any text of 1 to 255
    characters, stored and replayed as sent."""
    if header_key is not None and not (1 <= len(header_key) <= 255 and header_key.isascii()
                                       and header_key.isprintable()):
        raise DomainError(INVALID_INPUT, "Idempotency-Key: must be 1 to 255 printable ASCII characters",
                          {"field": "Idempotency-Key", "rule": "1 to 255 printable ASCII characters"})
    if header_key is not None and body.idempotencyKey is not None and header_key != body.idempotencyKey:
        raise DomainError(INVALID_INPUT, "idempotencyKey: differs from the Idempotency-Key header",
                          {"field": "idempotencyKey", "rule": "must equal the Idempotency-Key header when both are given"})
    ceiling = None
    if body.maxHourlyPrice is not None:
        ceiling = parse_money(body.maxHourlyPrice)
        if ceiling is None:
            raise DomainError(INVALID_INPUT, 'maxHourlyPrice: must be a decimal string with at most six decimals, below 10^12, '
                              'e.g. "3.000000"', {"field": "maxHourlyPrice", "rule": "a decimal string, six decimals at most"})
    request = create_request(body)
    if request.ssh_keys is not None:  # the keys are compared as checked lines (spacing does not make a new request)
        body = msgspec.structs.replace(body, access=Access(list(request.ssh_keys)))
    return Create(request, fingerprint_of(body), header_key or body.idempotencyKey,
                  body.wait.timeoutMs if body.wait else 0, body.quoteId, ceiling, lambda: earlier_fingerprints(body))


def extend_command(body: ExtendBody) -> Extend:
    if (body.until is None) == (body.by is None):
        raise DomainError(INVALID_INPUT, "until: give exactly one of until (epoch ms) or by (milliseconds)",
                          {"field": "until", "rule": "exactly one of until or by"})
    return Extend(body.reservationId, body.until, body.by)


def list_query(body: ListBody) -> ListQuery:
    check_state_filter(body.state)
    return ListQuery(body.scope, body.state, body.poolId, body.limit, body.cursor)


# ---- answers -------------------------------------------------------------

# Seed 002: "Cluster operations are cluster_create and cluster_terminate". A gang (nodeCount > 1, all nodes or none)
# is Berth's cluster; its release and its cancel both terminate it. Stored under the kinds every release knows (a
# replica of the previous release reads them), named so on the wire only.
CLUSTER_KINDS = {"create": "cluster_create", "release": "cluster_terminate", "cancel": "cluster_terminate"}


def operation_kind(op: Operation, node_count: int) -> str:
    return CLUSTER_KINDS.get(op.kind, op.kind) if node_count > 1 else op.kind


def operation_to_wire(op: Operation | None, node_count: int) -> dict | None:
    """The operation as the API answers it; `node_count`: its reservation's (a gang's are named as a cluster's)."""
    if op is None:
        return None
    out: dict[str, Any] = {
        "id": op.id,
        "kind": operation_kind(op, node_count),
        "status": op.status,
        "reservationId": op.reservation_id,
        "createdAt": op.created_at,
        "updatedAt": op.updated_at,
    }
    if op.failure is not None:
        out["errorMessage"] = op.failure.code  # the seed's errorMessage; failure is its structured reading
        out["failure"] = {
            "code": op.failure.code,
            "actor": op.failure.actor,
            "message": op.failure.message,
            "next": op.failure.next,
        }
    return out


def window_hours(res: Reservation) -> float | None:
    """The window's length in hours: end - start once both are known (a fixed window, an as-soon-as-possible one
    placed, either extended), else the length asked for."""
    if res.start is not None and res.end is not None:
        return (res.end - res.start) / 3_600_000
    return res.duration_ms / 3_600_000 if res.duration_ms is not None else None


def ended_at(res: Reservation) -> int | None:
    """When a released or cancelled reservation reached that state; for one that ended before the moment was stored
    (or whose record a replica of the previous release rewrote), its last change."""
    if res.state not in TERMINAL:
        return None
    return res.ended_at if res.ended_at is not None else res.updated_at


def reservation_to_wire(res: Reservation, operation: Operation | None) -> dict:
    out: dict[str, Any] = {
        "id": res.id,
        "tenantId": res.tenant_id,
        "principalId": res.principal_id,
        "poolId": res.pool_id,
        "region": res.region,
        "state": res.state,
        "binding": res.binding,
        "gpuModel": res.gpu_model,
        "sharing": res.sharing,
        "migProfile": res.mig_profile,
        "gpuCount": res.gpu_count,
        "nodeCount": res.node_count,
        "start": res.start,
        "end": res.end,
        "durationHours": window_hours(res),
        "spot": res.spot,
        "leaseSeconds": res.lease_seconds,
        "leaseDeadline": res.lease_deadline,
        "resources": res.resources.to_wire(),
        "hourlyUsd": money(res.hourly_usd),
        "idempotencyKey": res.idempotency_key,
        "placements": [{"nodeId": p.node_id, "devices": list(p.units)} for p in res.placements],
        "conditions": [
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": c.last_transition_time,
            }
            for c in res.conditions
        ],
        "bound": [bound_to_wire(b) for b in res.bound],
        "operation": operation_to_wire(operation, res.node_count),
        "createdAt": res.created_at,
        "updatedAt": res.updated_at,
        "reason": res.reason,
        "endedAt": ended_at(res),
    }
    if res.binding == "node":  # tenant root: the keys and account the nodes take (docs/node-binding.md)
        out["access"] = {"sshKeys": list(res.ssh_keys), "user": res.login_user}
        out["turnaroundMinutes"] = res.turnaround_ms / 60_000
    return out


def bound_to_wire(b: Bound) -> dict:
    out: dict[str, Any] = {"nodeId": b.node_id, "at": b.at, "cgroup": b.cgroup, "devices": list(b.devices)}
    if b.ssh is not None:  # node binding: how to connect
        out["ssh"] = {"host": b.ssh.host, "port": b.ssh.port, "user": b.ssh.user, "hostKeys": list(b.ssh.host_keys)}
    return out


def check_state_filter(state: str | None) -> None:
    if state is not None and state not in PUBLIC_STATES:
        raise DomainError(
            INVALID_INPUT,
            f"state: must be one of {', '.join(PUBLIC_STATES)}",
            {"field": "state", "rule": "must be a public state", "allowed": list(PUBLIC_STATES)},
        )
