"""Confirmations: an agent's refused create put to its delegating user (after OpenID CIBA).

A confirmation has an id, an expiry (30 minutes after it opened), a polling
interval and a message that tells the approving person exactly what is
asked. Only the delegating user may approve or deny it; the agent that
asked can read it but never decide it. Approval lets a retry with the same
key continue the draft; a denial or a lapse leaves the key ACCESS_DENIED.
"""
from __future__ import annotations

import time

from controlplane.domain import states
from controlplane.domain.admission import Plan
from controlplane.domain.clock import Clock
from controlplane.domain.errors import ACCESS_DENIED, CONFIRMATION_REQUIRED, INVALID_STATE, DomainError, not_found
from controlplane.domain.ids import _digest
from controlplane.domain.model import Confirmation, Principal, Reservation
from controlplane.domain.timers import CONFIRMATION_WINDOW_MS
from controlplane.store.port import Store, Tx
from controlplane.transitions import Transitions

POLL_INTERVAL_S = 5


def confirmation_id(reservation_id: str) -> str:
    return "cnf_" + _digest("confirmation", reservation_id)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000))


def describe(agent: Principal, res: Reservation, plan: Plan, expires_at: int) -> tuple[str, dict]:
    """The question put to the user, in words, and the attributes it is about."""
    pool = plan.pool
    if plan.start is None:
        window = f"for {(plan.duration_ms or 0) / 3_600_000:g} hours from when it can be placed"
    else:
        window = f"from {_when(plan.start)} to {_when(plan.end or 0)}"
    what = f"{plan.node_count} x {plan.gpu_count}" if plan.node_count > 1 else f"{plan.gpu_count}"
    device = f"{pool.gpu_model} {plan.mig_profile}" if plan.mig_profile else pool.gpu_model
    share = plan.resources.to_wire()
    message = (
        f"{agent.id} asks, acting for you, to reserve {what} {device} in pool {pool.id} ({pool.region}) {window}, "
        f"binding {plan.binding}{', spot' if plan.spot else ''}, with {share['vcpu']:g} vcpu and "
        f"{share['memoryGiB']:g} GiB memory per node. Approve or deny before {_when(expires_at)}."
    )
    asked = {
        "poolId": pool.id, "region": pool.region, "gpuModel": pool.gpu_model, "migProfile": plan.mig_profile,
        "gpuCount": plan.gpu_count * plan.node_count, "nodeCount": plan.node_count, "start": plan.start,
        "end": plan.end, "durationHours": (plan.duration_ms or ((plan.end or 0) - (plan.start or 0))) / 3_600_000,
        "binding": plan.binding, "spot": plan.spot, "resources": share,
    }
    return message, asked


def open_for(res: Reservation, agent: Principal, approver: str, plan: Plan, now: int) -> Confirmation:
    expires = now + CONFIRMATION_WINDOW_MS
    message, asked = describe(agent, res, plan, expires)
    return Confirmation(confirmation_id(res.id), res.tenant_id, res.id, agent.id, approver, "pending", now, expires,
                        message, asked)


def to_wire(conf: Confirmation) -> dict:
    return {
        "id": conf.id, "agentId": conf.agent_id, "approver": conf.user_id,
        "status": conf.status, "createdAt": conf.created_at, "expiresAt": conf.expires_at, "message": conf.message,
        "asked": conf.asked, "decidedAt": conf.decided_at, "interval": POLL_INTERVAL_S,
    }


def required(conf: Confirmation) -> DomainError:
    return DomainError(CONFIRMATION_REQUIRED, conf.message, {
        "confirmationId": conf.id, "expiresAt": conf.expires_at, "approver": conf.user_id, "asked": conf.asked,
        "interval": POLL_INTERVAL_S,
        "next": f"ask {conf.user_id} to approve {conf.id}, then retry with the same idempotency key",
    })


def lapse(tx: Tx, moves: Transitions, res: Reservation, now: int, status: str = "expired") -> None:
    """The draft behind a confirmation that was denied or lapsed: its key is refused from now on. An approval the
    agent did not retry within the 30 minutes stays on record as the person gave it (the draft lapses, event
    `confirmation.lapsed`); a pending one expires."""
    conf = tx.confirmation(res.confirmation_id) if res.confirmation_id else None
    event = f"confirmation.{status}"
    if conf is not None and conf.status == "approved" and status == "expired":
        event = "confirmation.lapsed"
    elif conf is not None and conf.status in ("pending", "approved"):
        conf.status = status
        conf.decided_at = now
        tx.put_confirmation(conf)
    res.decision = "deny"
    states.move(res, states.DRAFT, now)
    moves.save(tx, res, states.AWAITING_CONFIRMATION)
    moves.event(tx, res, event, now, confirmationId=res.confirmation_id)


class ConfirmationService:
    def __init__(self, store: Store, clock: Clock, moves: Transitions):
        self.store = store
        self.clock = clock
        self.moves = moves

    def _visible(self, principal: Principal, conf_id: str) -> Confirmation:
        conf = self.store.confirmation(conf_id)
        if conf is None or conf.tenant_id != principal.tenant_id or principal.id not in (conf.user_id, conf.agent_id):
            raise not_found("confirmation", conf_id, field="confirmationId")
        return self._current(conf)

    def _current(self, conf: Confirmation) -> Confirmation:
        if conf.status == "pending" and conf.expires_at <= self.clock.compute_now():
            conf.status = "expired"  # as the reconciler will record it
        return conf

    def list(self, principal: Principal, status: str | None, limit: int) -> list[Confirmation]:
        rows = self.store.confirmations(principal.tenant_id, principal.id, principal.id, None, limit * 2)
        out = [self._current(c) for c in rows]
        return [c for c in out if status is None or c.status == status][:limit]

    def get(self, principal: Principal, conf_id: str) -> Confirmation:
        return self._visible(principal, conf_id)

    async def decide(self, principal: Principal, conf_id: str, approve: bool) -> Confirmation:
        conf = self._visible(principal, conf_id)
        if principal.id != conf.user_id:
            raise DomainError(ACCESS_DENIED, f"only {conf.user_id}, who delegated to {conf.agent_id}, may decide this confirmation",
                              {"confirmationId": conf_id, "approver": conf.user_id})

        def job(tx: Tx) -> Confirmation:
            current = tx.confirmation(conf_id)
            now = self.clock.compute_now()
            if current.status == ("approved" if approve else "denied"):
                return current  # a repeated decision changes nothing
            if current.status != "pending" or current.expires_at <= now:
                raise DomainError(INVALID_STATE, f"confirmation {conf_id} is {self._current(current).status}",
                                  {"confirmationId": conf_id, "status": self._current(current).status})
            res = tx.reservation(current.reservation_id)
            if approve:
                current.status, current.decided_at = "approved", now
                tx.put_confirmation(current)
                if res is not None:
                    self.moves.event(tx, res, "confirmation.approved", now, confirmationId=conf_id)
            elif res is not None and res.state == states.AWAITING_CONFIRMATION:
                lapse(tx, self.moves, res, now, "denied")
                current = tx.confirmation(conf_id)
            return current

        return await self.store.call(job)
