"""The embedded authorizer: Cedar policies through cedarpy, parsed once at start, never per call.

Principal entities (with the delegating user of an agent) are parsed once
per principal and kept; each call adds only its resource entity. Batches
(`list scope: all`) go through cedarpy's is_authorized_batch.

Decisions are memoized. A Cedar decision is a pure function of the request
and the entities; a policy can tell two reservations apart only by their
attributes, or by naming one (`Reservation::"..."` in the policy text).
So while no policy names a reservation, a decision is reused for the same
principal, action, resource type and attributes; the memo belongs to this
authorizer and goes with it when policies change.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import cedarpy

from controlplane.domain.model import Principal
from controlplane.iam.authorizer import AuthzRequest, Decision, Resource, principal_type

SCHEMA_PATH = Path(__file__).with_name("berth.cedarschema")
MEMO_SIZE = 8192
# The entity types the memo's key does not tell apart by id (it holds a request's attributes, not the resource's id).
_UNKEYED_TYPES = frozenset({"Reservation", "Tenant", "Node", "Pool"})


class PolicyError(ValueError):
    """The policy set does not parse or does not validate against Berth's schema."""


def validate(policies: str) -> None:
    """Parse and validate a policy set against Berth's IAM schema; PolicyError says what is wrong, and where:
    cedarpy's errors carry no line, so the policy at fault is found here (its line and first words)."""
    result = cedarpy.validate_policies(policies, SCHEMA_PATH.read_text())
    if result.validation_passed:
        return
    starts = statement_lines(policies)
    said: dict[str, list[str]] = {}  # where -> what is wrong there
    for e in result.errors:
        pid = getattr(e, "policy_id", "")
        if pid.startswith("policy") and pid[6:].isdigit() and int(pid[6:]) < len(starts):  # cedarpy's policyN
            where = starts[int(pid[6:])]
        else:  # a parse error names no policy: the first statement that does not parse alone is the one
            where = next((s for s in starts if not _parses(policies[s[1]:s[2]])), None)
        at = f"line {where[0]} ({policies[where[1]:where[2]].strip()[:60]!r})" if where else ""
        said.setdefault(at, []).append(str(getattr(e, "error", e)))
    raise PolicyError("; ".join(f"{at}: {', '.join(dict.fromkeys(texts))}" if at else ", ".join(texts)
                                for at, texts in said.items()) or "policies do not validate")


def _parses(statement: str) -> bool:
    try:
        cedarpy.policies_to_json_str(statement)
    except ValueError:
        return False
    return True


def statement_lines(policies: str) -> list[tuple[int, int, int]]:
    """(line, start, end) of each policy statement: the text up to each `;` outside strings and `//` comments,
    its line the first one that holds more than blanks and comments."""
    out, start, i, n = [], 0, 0, len(policies)
    while i < n:
        c = policies[i]
        if c == '"':  # a string, with backslash escapes
            i += 1
            while i < n and policies[i] != '"':
                i += 2 if policies[i] == "\\" else 1
        elif policies.startswith("//", i):
            i = policies.find("\n", i)
            i = n if i < 0 else i
        elif c == ";":
            out.append((start, i + 1))
            start = i + 1
        i += 1
    if policies[start:].strip() and not all(ln.strip().startswith("//") or not ln.strip()
                                             for ln in policies[start:].splitlines()):
        out.append((start, n))  # a last statement without its `;`
    lines = []
    for begin, end in out:
        first = begin
        for ln in policies[begin:end].splitlines(keepends=True):  # skip blank and comment lines
            if ln.strip() and not ln.strip().startswith("//"):
                break
            first += len(ln)
        lines.append((policies.count("\n", 0, first) + 1, first, end))
    return lines


def forbid_annotations(policies: str) -> dict[str, tuple[str, str]]:
    """Cedar's id of each forbid policy -> (its @id annotation or that id, its @reason annotation or "")."""
    try:
        static = json.loads(cedarpy.policies_to_json_str(policies)).get("staticPolicies", {})
    except Exception:  # noqa: BLE001 - annotations only improve messages; the set itself parsed
        return {}
    return {pid: (str(p.get("annotations", {}).get("id") or pid), str(p.get("annotations", {}).get("reason") or ""))
            for pid, p in static.items() if p.get("effect") == "forbid"}


def names_an_entity(policies: str) -> bool:
    """Does a policy name one reservation, tenant, node or pool, in its scope or its conditions? Read from the
    parsed set, so every spelling Cedar takes counts (`Reservation :: "r1"`, a line break before the `::`); a set
    that cannot be read so counts as naming one (decided without the memo: slower, never wrong)."""
    try:
        doc = json.loads(cedarpy.policies_to_json_str(policies))
    except Exception:  # noqa: BLE001
        return True

    def names(node: Any) -> bool:
        if isinstance(node, dict):
            kind = node.get("type")
            if isinstance(kind, str) and "id" in node and kind.rsplit("::", 1)[-1] in _UNKEYED_TYPES:
                return True  # an entity literal: {"type": ..., "id": ...}, in a scope or under "__entity"
            return any(names(v) for v in node.values())
        return isinstance(node, list) and any(names(v) for v in node)

    return names(doc)


def _attr(value: Any) -> Any:
    if isinstance(value, Principal):
        return {"__entity": {"type": principal_type(value), "id": value.id}}
    if isinstance(value, float):
        raise TypeError("Cedar has no float: round attributes to integers first")
    return value


class CedarAuthorizer:
    embedded = True

    def __init__(self, policies: str, principal_lookup: Callable[[str], Principal | None]):
        self._lookup = principal_lookup
        self.load(policies)

    def load(self, policies: str) -> None:
        """Take a new policy set (parsed once); the memo and the cached entities go with the old one."""
        try:
            parsed = cedarpy.PolicySet.from_str(policies)
        except Exception as exc:  # cedarpy raises ValueError/RuntimeError variants
            raise PolicyError(f"policies do not parse: {exc}") from exc
        self._policies = parsed
        self._forbids = forbid_annotations(policies)
        self._entities: dict[tuple, cedarpy.Entities] = {}
        self._memo: OrderedDict | None = None if names_an_entity(policies) else OrderedDict()

    def _memo_key(self, req: AuthzRequest):
        if self._memo is None:
            return None
        try:
            # In the attributes' own order (one builder makes them): the same request is the same key.
            attrs = tuple((k, (v.id, v.kind) if isinstance(v, Principal) else v)
                          for k, v in req.resource.attributes.items())
            key = (req.principal.id, req.principal.tenant_id, req.principal.kind, req.principal.delegated_by,
                   req.action, req.resource.type,
                   attrs, json.dumps(req.context, sort_keys=True) if req.context else "")
            hash(key)
            return key
        except TypeError:  # an unhashable attribute value: decide without the memo
            return None

    def _principal_entities(self, principal: Principal) -> cedarpy.Entities:
        key = (principal.id, principal.tenant_id, principal.kind, principal.delegated_by)
        cached = self._entities.get(key)
        if cached is not None:
            return cached
        attrs: dict[str, Any] = {"tenant": principal.tenant_id}
        docs = []
        if principal.kind == "agent" and principal.delegated_by:
            attrs["delegatedBy"] = {"__entity": {"type": "User", "id": principal.delegated_by}}
            user = self._lookup(principal.delegated_by)
            if user is not None:
                docs.append({"uid": {"type": "User", "id": user.id}, "attrs": {"tenant": user.tenant_id}, "parents": []})
        docs.append({"uid": {"type": principal_type(principal), "id": principal.id}, "attrs": attrs, "parents": []})
        entities = cedarpy.Entities.from_json_str(json.dumps(docs))
        if len(self._entities) > 4096:
            self._entities.clear()
        self._entities[key] = entities
        return entities

    @staticmethod
    def _resource_doc(resource: Resource) -> dict:
        return {
            "uid": {"type": resource.type, "id": resource.id},
            "attrs": {k: _attr(v) for k, v in resource.attributes.items()},
            "parents": [],
        }

    @staticmethod
    def _request(req: AuthzRequest) -> dict:
        return {
            "principal": {"type": principal_type(req.principal), "id": req.principal.id},
            "action": {"type": "Action", "id": req.action},
            "resource": {"type": req.resource.type, "id": req.resource.id},
            "context": req.context,
        }

    def _decision(self, result: cedarpy.AuthzResult) -> Decision:
        diagnostics = result.diagnostics
        reasons = tuple(diagnostics.reasons)
        policy = reason = ""
        if not result.allowed:
            matched = [self._forbids[r] for r in reasons if r in self._forbids]
            if matched:  # of several forbids, one that says why (the order of Cedar's reasons is no priority)
                policy, reason = min(matched, key=lambda m: (not m[1], m[0]))
        return Decision(bool(result.allowed), reasons, tuple(str(e) for e in diagnostics.errors), policy=policy,
                        reason=reason)

    def decide_now(self, req: AuthzRequest) -> Decision:
        key = self._memo_key(req)
        if key is not None:
            hit = self._memo.get(key)  # type: ignore[union-attr]
            if hit is not None:
                return hit
        decision = self._decide(req)
        if key is not None and not decision.errors:
            self._memo[key] = decision  # type: ignore[index]
            if len(self._memo) > MEMO_SIZE:  # type: ignore[arg-type]
                self._memo.popitem(last=False)  # type: ignore[union-attr]
        return decision

    def _decide(self, req: AuthzRequest) -> Decision:
        try:
            entities = self._principal_entities(req.principal).with_added_json_str(json.dumps([self._resource_doc(req.resource)]))
            return self._decision(cedarpy.is_authorized(self._request(req), self._policies, entities))
        except Exception as exc:  # a failed decision is a deny
            return Decision(False, (), (f"decision failed: {exc}",))

    async def decide(self, request: AuthzRequest) -> Decision:
        return self.decide_now(request)

    async def decide_many(self, requests: Sequence[AuthzRequest]) -> list[Decision]:
        if not requests:
            return []
        by_principal: dict[tuple[str, str], list[int]] = {}
        for i, req in enumerate(requests):
            by_principal.setdefault((req.principal.id, req.principal.kind), []).append(i)
        out: list[Decision] = [Decision(False)] * len(requests)
        for indices in by_principal.values():
            reqs = [requests[i] for i in indices]
            try:
                docs = {}
                for r in reqs:
                    docs[(r.resource.type, r.resource.id)] = self._resource_doc(r.resource)
                entities = self._principal_entities(reqs[0].principal).with_added_json_str(json.dumps(list(docs.values())))
                results = cedarpy.is_authorized_batch([self._request(r) for r in reqs], self._policies, entities)
                for i, result in zip(indices, results):
                    out[i] = self._decision(result)
            except Exception as exc:
                for i in indices:
                    out[i] = Decision(False, (), (f"decision failed: {exc}",))
        return out
