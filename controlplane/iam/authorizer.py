"""The Authorizer boundary: who asks, what action, on which resource with which attributes; allow or deny.

Requests are plain data (principal, action, resource entity with its
attributes). A missing or failed decision is a deny, carrying the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from controlplane.domain.errors import ACCESS_DENIED, DomainError
from controlplane.domain.model import Principal

CREATE = "compute:reservations:create"
READ = "compute:reservations:read"
RELEASE = "compute:reservations:release"
EXTEND = "compute:reservations:extend"
ACTIONS = (CREATE, READ, RELEASE, EXTEND)
# The operator's actions (an Operator principal on Node, Pool and Tenant resources; docs/admin-api.md).
NODES_READ = "fleet:nodes:read"
NODES_CORDON = "fleet:nodes:cordon"  # cordon and uncordon
NODES_DRAIN = "fleet:nodes:drain"
NODES_CLEAR = "fleet:nodes:clear"
NODES_RELEASE_IDENTITY = "fleet:nodes:release-identity"
POOLS_READ = "fleet:pools:read"
TENANTS_READ = "fleet:tenants:read"
FLEET_ACTIONS = (NODES_READ, NODES_CORDON, NODES_DRAIN, NODES_CLEAR, NODES_RELEASE_IDENTITY, POOLS_READ, TENANTS_READ)


@dataclass(frozen=True, slots=True)
class Resource:
    """A compute-reservation (`Reservation`), compute-tenant (`Tenant`), or for operators a `Node` or `Pool`, with its
    attributes."""

    type: str
    id: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AuthzRequest:
    principal: Principal
    action: str
    resource: Resource
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reasons: tuple[str, ...] = ()  # the policies that decided
    errors: tuple[str, ...] = ()  # why a decision could not be made (then it is a deny)
    confirm: bool = False  # a deny that the decision service says a person may overturn (remote context)
    unavailable: bool = False  # no decision could be had (the service unreachable): a deny, and the platform's fault
    policy: str = ""  # a deny: the forbid that matched (its @id annotation, else Cedar's id); "": no permit matched
    reason: str = ""  # a deny: that forbid's @reason annotation (or the decision service's context.reason)


def access_denied(decision: Decision, message: str, details: dict[str, Any]) -> DomainError:
    """The ACCESS_DENIED of a deny: the message says the forbid's reason (or that no policy permits it), and the
    details name the policy."""
    if decision.reason:
        message = f"{message}: {decision.reason}"
    elif decision.policy:
        message = f"{message}: forbidden by policy {decision.policy}"
    elif not decision.errors:
        message = f"{message}: no policy permits it"
    extra = {"policy": decision.policy, "reason": decision.reason} if decision.policy or decision.reason else {}
    return DomainError(ACCESS_DENIED, message, {**details, **extra, "errors": list(decision.errors)})


def principal_type(principal: Principal) -> str:
    return {"agent": "Agent", "operator": "Operator"}.get(principal.kind, "User")


def tenant_resource(tenant_id: str) -> Resource:
    return Resource("Tenant", tenant_id, {"tenant": tenant_id})


class Authorizer(Protocol):
    """Decides requests. `embedded` says where: True, in this process in microseconds, so `decide_now` may be
    called inside a store transaction (a create's draft, decision and admission are then one job); False, by a
    remote service, awaited outside any transaction (`decide_now` is then refused)."""

    embedded: bool

    def decide_now(self, request: AuthzRequest) -> Decision: ...

    async def decide(self, request: AuthzRequest) -> Decision: ...

    async def decide_many(self, requests: Sequence[AuthzRequest]) -> list[Decision]: ...
