"""Bearer tokens on HTTP: the Authorization header read, and resolved to a tenant's principal or an operator through
the token table; whether that principal may call a mutation (its scope, and its delegating user's)."""
from __future__ import annotations

from typing import Awaitable, Callable, Mapping

from aiohttp import web

from controlplane.domain.errors import ACCESS_DENIED, COMPUTE_ACCESS_REQUIRED, UNAUTHENTICATED, DomainError
from controlplane.domain.model import Principal
from controlplane.tokens import Tokens


def bearer(request: web.Request) -> str:
    sent = request.headers.getall("Authorization", [])
    if len(sent) > 1:  # which one a proxy or a server reads differs: refused rather than guessed
        raise DomainError(UNAUTHENTICATED, "Authorization: send one header, not several",
                          {"field": "Authorization"})
    header = sent[0] if sent else ""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not token.isprintable() or not token.isascii():
        # a token is printable ASCII; anything else (a byte that is not UTF-8, a control character) is no token
        raise DomainError(UNAUTHENTICATED, "Authorization: send 'Bearer <token>' (printable ASCII)",
                          {"field": "Authorization"})
    return token


async def known_first(request: web.Request, tokens: Tokens, catch_up: Callable[[], Awaitable[None]]) -> None:
    """A token this replica does not know may have been issued a moment ago by another one (an agent registered
    there, a bootstrap applied there) whose commit it has not heard of yet: the memory catches up (`catch_up`)
    before the token is judged, so a client behind a balancer is not refused for the replica it reached. A request
    without a well-formed bearer token is left to the checks that refuse it."""
    try:
        token = bearer(request)
    except DomainError:
        return
    if tokens.resolve(token) is None:
        await catch_up()


# What each API takes, for the refusal of a token it does not.
TENANT_TOKENS = "a tenant principal's token (a user's or an agent's: the bootstrap file's principals[].token)"
ADMIN_OR_OPERATOR = ("the admin token (the bootstrap file's adminToken) or an operator's token (a principal of kind "
                     "operator)")
ADMIN_ONLY = "the admin token (the bootstrap file's adminToken)"
_OTHER_KINDS = {"admin": "the admin token", "node": "a node's token", "node-bootstrap": "a pool's node bootstrap token"}


def refused_token(found: tuple[str, str] | None, principals: Mapping[str, Principal], takes: str,
                  code: str = ACCESS_DENIED) -> DomainError:
    """401 UNAUTHENTICATED for a token nobody knows (or whose principal is gone); 403 `code` for a known token this
    API does not take (another API's), saying whose it is and what this one takes."""
    principal = principals.get(found[1]) if found is not None and found[0] == "principal" else None
    if found is None or (found[0] == "principal" and principal is None):
        why = "unknown token" if found is None else "the token's principal no longer exists"
        return DomainError(UNAUTHENTICATED, f"Authorization: {why}; this API takes {takes}", {"field": "Authorization"})
    if principal is not None:
        whose = f"{principal.id}'s token ({'an operator' if principal.kind == 'operator' else 'a tenant principal'})"
    else:
        whose = _OTHER_KINDS.get(found[0], "this token")
    return DomainError(code, f"Authorization: {whose} is valid, but this API takes {takes}",
                       {"field": "Authorization", "takes": takes})


def principal_of(request: web.Request, tokens: Tokens, principals) -> Principal:
    """The tenant's principal a tenant API call acts as (an operator acts on the fleet, never as a tenant)."""
    found = tokens.resolve(bearer(request))
    principal = principals.get(found[1]) if found is not None and found[0] == "principal" else None
    if principal is None or principal.kind == "operator":
        raise refused_token(found, principals, TENANT_TOKENS, COMPUTE_ACCESS_REQUIRED)
    return principal


def operator_of(request: web.Request, tokens: Tokens, principals) -> Principal | None:
    """Who calls the admin API: None for the bootstrap file's admin token (every fleet action), else an operator
    principal, whose every action IAM decides."""
    found = tokens.resolve(bearer(request))
    if found is not None and found[0] == "admin":
        request["admin"] = True  # for the access log
        return None
    principal = principals.get(found[1]) if found is not None and found[0] == "principal" else None
    if principal is None or principal.kind != "operator":
        raise refused_token(found, principals, ADMIN_OR_OPERATOR)
    request["principal"] = principal
    return principal


def admin_of(request: web.Request, tokens: Tokens, principals, takes: str = ADMIN_ONLY) -> None:
    """The admin token only (bootstraps and budgets rewrite who may do what; /metrics names every node)."""
    found = tokens.resolve(bearer(request))
    if found is None or found[0] != "admin":
        raise refused_token(found, principals, takes)
    request["admin"] = True  # for the access log


def manage_access(principal: Principal, principals: Mapping[str, Principal], path: str) -> None:
    """COMPUTE_ACCESS_REQUIRED unless the caller may change things (`path`: the mutation's): its token's scope is
    manage and, for an agent, so is the scope of the user it acts for (an agent has no more access than that
    user). Every create passes here: the method's name is made only for a refusal."""
    if principal.scope == "manage" and (principal.kind != "agent" or not principal.delegated_by):
        return
    method = path.rsplit("/", 1)[-1]
    if principal.scope != "manage":
        raise DomainError(COMPUTE_ACCESS_REQUIRED, f"{principal.id}'s token has {principal.scope} access: {method} "
                          "needs Compute Manage access; use a token with scope manage",
                          {"scope": principal.scope, "required": "manage"})
    user = principals.get(principal.delegated_by) if principal.kind == "agent" and principal.delegated_by else None
    if user is not None and user.scope != "manage":
        raise DomainError(COMPUTE_ACCESS_REQUIRED, f"{principal.id} acts for {user.id}, who has {user.scope} access: "
                          f"{method} needs Compute Manage access, and an agent has no more access than the user it "
                          f"acts for; give {user.id} scope manage, or let the agent act for a user who has it",
                          {"scope": user.scope, "required": "manage", "delegatedBy": user.id})
