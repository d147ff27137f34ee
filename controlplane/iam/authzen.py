"""The remote authorizer: decisions from an external service in the OpenID AuthZEN evaluation shape.

`POST {base}/access/v1/evaluation` with `{subject, action, resource, context}`
(the resource's attributes as its `properties`) answered by `{decision,
context}`; batches go to `/access/v1/evaluations`. A decision service may
say that a person can overturn a deny by answering `context.confirmation:
{"required": true}`. A timeout, a transport error, a non-2xx answer or a
malformed body is a deny whose error says what happened, marked unavailable:
the control plane answers PROVIDER_UNAVAILABLE (the platform's fault,
retry later with the same key) rather than a refusal of the request.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

import aiohttp

from controlplane.domain.model import Principal
from controlplane.iam.authorizer import AuthzRequest, Decision, principal_type


def _value(v: Any) -> Any:
    if isinstance(v, Principal):
        return {"type": principal_type(v), "id": v.id}
    return v


def evaluation(req: AuthzRequest) -> dict:
    p = req.principal
    subject_props: dict[str, Any] = {"tenant": p.tenant_id}
    if p.delegated_by:
        subject_props["delegatedBy"] = {"type": "User", "id": p.delegated_by}
    return {
        "subject": {"type": principal_type(p), "id": p.id, "properties": subject_props},
        "action": {"name": req.action},
        "resource": {"type": req.resource.type, "id": req.resource.id,
                     "properties": {k: _value(v) for k, v in req.resource.attributes.items()}},
        "context": req.context,
    }


def _decision(body: Any) -> Decision:
    if not isinstance(body, dict) or not isinstance(body.get("decision"), bool):
        return Decision(False, (), ("the decision service answered without a boolean 'decision'",), unavailable=True)
    context = body.get("context") if isinstance(body.get("context"), dict) else {}
    confirmation = context.get("confirmation")
    confirm = isinstance(confirmation, dict) and confirmation.get("required") is True
    reason = context.get("reason")
    policy = context.get("policy")
    denied = not body["decision"]
    return Decision(body["decision"], (str(reason),) if reason else (), (), confirm=confirm and denied,
                    policy=str(policy)[:200] if denied and policy else "", reason=str(reason)[:500] if denied and reason else "")


class AuthZenAuthorizer:
    embedded = False

    def decide_now(self, request: AuthzRequest) -> Decision:
        raise TypeError("a remote decision is awaited (decide), never taken inside a transaction")

    def __init__(self, base_url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = headers or {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, path: str, body: dict) -> Any:
        async with self._client().post(self.base_url + path, json=body) as resp:
            if resp.status // 100 != 2:
                raise RuntimeError(f"the decision service answered HTTP {resp.status}")
            return await resp.json(content_type=None)

    async def decide(self, request: AuthzRequest) -> Decision:
        try:
            return _decision(await self._post("/access/v1/evaluation", evaluation(request)))
        except asyncio.TimeoutError:
            return Decision(False, (), (f"the decision service at {self.base_url} did not answer within {self.timeout.total} s",),
                            unavailable=True)
        except (aiohttp.ClientError, RuntimeError, ValueError) as exc:
            return Decision(False, (), (f"the decision service at {self.base_url} failed: {exc}",), unavailable=True)

    async def decide_many(self, requests: Sequence[AuthzRequest]) -> list[Decision]:
        if not requests:
            return []
        try:
            body = await self._post("/access/v1/evaluations", {"evaluations": [evaluation(r) for r in requests]})
            items = body.get("evaluations") if isinstance(body, dict) else None
            if not isinstance(items, list) or len(items) != len(requests):
                raise ValueError("the batch answer does not match the requests")
            return [_decision(item) for item in items]
        except (asyncio.TimeoutError, aiohttp.ClientError, RuntimeError, ValueError):
            return [await self.decide(r) for r in requests]  # fall back to single evaluations
