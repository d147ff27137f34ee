"""The reservations service: create, get, list, release and cancel.

Each method reads what it needs (committed data), asks IAM, and makes its
change as one job of the store's writer: one transaction in which the state
moves, the calendar and the quota ledger follow, and the event and the
operation are written. create is two jobs around the IAM decision: the
draft is written first, so a retry with the same key finds it and decides
the same draft again.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable

import structlog

from controlplane.catalog import Catalog
from controlplane.domain import states
from controlplane.domain.admission import (
    CreateRequest, Plan, ResourcesAsk, admit, iam_attributes, reservation_attributes,
)
from controlplane.domain.calendar import Booking
from controlplane.domain.clock import Clock
from controlplane.domain.errors import (
    ACCESS_DENIED, CONFLICT, INVALID_INPUT, INVALID_STATE, SPEND_LIMIT_REACHED, DomainError, not_found,
)
from controlplane.domain.ids import fingerprint, operation_id, reservation_id
from controlplane.domain.model import Failure, Operation, Placement, Principal, Reservation
from controlplane.domain.placement import Ask, place
from controlplane.domain.share import Share
from controlplane.iam.authorizer import CREATE, READ, RELEASE, Authorizer, AuthzRequest, Decision, Resource, tenant_resource
from controlplane.schemas import CreateBody, ListBody, fingerprint_of
from controlplane.state import WriterState
from controlplane.store.sqlite import BookingRow, Commit, SqliteStore, Tx

log = structlog.get_logger("berth.reservations")

WAKE_ATTEMPTS = 64  # pending reservations tried per wake; the reconciler's retry covers the rest


@dataclass(frozen=True, slots=True)
class Answer:
    reservation: Reservation
    operation: Operation | None


class CatalogRef:
    """The current catalog; replaced whole when an operator changes it."""

    def __init__(self, catalog: Catalog):
        self.current = catalog


def to_request(body: CreateBody) -> CreateRequest:
    res = body.resources
    return CreateRequest(
        pool_id=body.poolId,
        gpu_model=body.gpuModel,
        gpu_count=body.gpuCount,
        node_count=body.nodeCount,
        sharing=body.sharing,
        mig_profile=body.migProfile,
        start=body.start,
        end=body.end,
        duration_ms=round(body.durationHours * 3_600_000) if body.durationHours is not None else None,
        binding=body.binding,
        resources=None if res is None else ResourcesAsk(
            None if res.vcpu is None else round(res.vcpu * 1000),
            None if res.memoryGiB is None else round(res.memoryGiB * 1024),
            res.hugepages1Gi,
        ),
        spot=body.spot,
        lease_seconds=body.leaseSeconds,
    )


def ask_of(res: Reservation, start: int, end: int) -> Ask:
    return Ask(
        gpu_count=res.gpu_count, node_count=res.node_count, share=res.resources, start=start, end=end,
        sharing=res.sharing, mig_profile=res.mig_profile, whole_node=res.binding == "node",
    )


class ReservationService:
    def __init__(self, store: SqliteStore, authorizer: Authorizer, clock: Clock, catalog: CatalogRef, state: WriterState):
        self.store = store
        self.authorizer = authorizer
        self.clock = clock
        self.catalog = catalog
        self.state = state
        self._background: set[asyncio.Task] = set()
        self.listeners: list[Callable[[str, Reservation], None]] = []  # (event type, reservation) after commit

    @property
    def writer(self):
        return self.store.writer

    # ---- shared pieces ------------------------------------------------------
    def _visible(self, principal: Principal, reservation_id: str, drafts_found: bool = False) -> Reservation:
        res = self.store.reservation(reservation_id)
        if res is None or res.tenant_id != principal.tenant_id or (res.state in states.INTERNAL and not drafts_found):
            raise not_found("reservation", reservation_id, field="reservationId")
        return res

    async def _authorize(self, principal: Principal, action: str, resource: Resource) -> Decision:
        decision = await self.authorizer.decide(AuthzRequest(principal, action, resource))
        if not decision.allowed:
            raise DomainError(
                ACCESS_DENIED,
                f"{principal.id} may not {action.rsplit(':', 1)[-1]} {resource.type.lower()} {resource.id}",
                {"action": action, "resource": resource.id, "errors": list(decision.errors)},
            )
        return decision

    def _resource(self, res: Reservation, principal: Principal, attributes: dict[str, Any] | None = None) -> Resource:
        attrs = dict(attributes if attributes is not None else reservation_attributes(res))
        owner = principal if res.principal_id == principal.id else (
            self.catalog.current.principals.get(res.principal_id) or Principal(res.principal_id, res.tenant_id)
        )
        attrs["principal"] = owner
        return Resource("Reservation", res.id, attrs)

    def _answer(self, res: Reservation) -> Answer:
        op = self.store.operation(res.operation_id) if res.operation_id else None
        return Answer(res, op)

    def _event(self, tx: Tx, res: Reservation, type_: str, now: int, **data: Any) -> None:
        payload = {"state": res.state, "poolId": res.pool_id, **data}
        if res.reason and res.state in states.TERMINAL:
            payload.setdefault("reason", res.reason)
        tx.event(res.tenant_id, res.id, type_, now, payload)

    def _notify(self, type_: str, res: Reservation) -> None:
        for listener in self.listeners:
            listener(type_, res)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for background work (wakes of pending queues) to finish."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # ---- placement inside a job ----------------------------------------------
    def _window(self, res: Reservation, now: int) -> tuple[int, int]:
        if res.asap:
            return now, now + (res.duration_ms or 0)
        return max(res.start or now, now), res.end or now

    def try_place(self, tx: Tx, res: Reservation, now: int) -> bool:
        """Book the reservation in its window if it fits (calendar and rows); True when placed."""
        start, end = self._window(res, now)
        if end <= start:
            return False
        catalog = self.catalog.current
        placements = place(self.state.calendar.pool(res.pool_id), catalog.nodes, ask_of(res, start, end))
        if placements is None:
            return False
        self.book(tx, res, placements, start, end, catalog)
        return True

    def book(self, tx: Tx, res: Reservation, placements: list[Placement], start: int, end: int, catalog: Catalog) -> None:
        bookings = []
        for p in placements:
            share = catalog.nodes[p.node_id].capacity if res.binding == "node" else res.resources
            bookings.append(Booking(res.id, res.pool_id, p.node_id, tuple(p.units), start, end, share))
        tx.insert_bookings(
            BookingRow(b.reservation_id, b.pool_id, b.node_id, b.units, b.start, b.end,
                       b.share.vcpu_milli, b.share.memory_mib, b.share.hugepages_1g)
            for b in bookings
        )
        tx.touch()
        for b in bookings:
            self.state.calendar.book(b)
        res.placements = placements
        if res.binding == "node":
            res.resources = bookings[0].share
        if res.asap:
            res.start, res.end = start, end

    def _unbook(self, tx: Tx, res: Reservation, now: int) -> None:
        tx.end_bookings(res.id, now)
        tx.touch()
        self.state.calendar.release(res.id, now)

    def _refund(self, tx: Tx, res: Reservation) -> None:
        tx.touch()
        self.state.ledger.refund(res.tenant_id, res.charge)
        self.state.queue(res.pool_id).pop(res.id, None)

    # ---- create --------------------------------------------------------------
    async def create(self, principal: Principal, body: CreateBody, header_key: str | None) -> Answer:
        if header_key is not None and body.idempotencyKey is not None and header_key != body.idempotencyKey:
            raise DomainError(INVALID_INPUT, "idempotencyKey: differs from the Idempotency-Key header",
                              {"field": "idempotencyKey", "rule": "must equal the Idempotency-Key header when both are given"})
        key = header_key or body.idempotencyKey or secrets.token_urlsafe(18)
        rid = reservation_id(principal.tenant_id, principal.id, key)
        fp = fingerprint(fingerprint_of(body))

        existing = self.store.reservation(rid)
        if existing is not None:
            replay = self._replay(existing, fp)
            if replay is not None:
                return replay

        catalog = self.catalog.current
        tenant = catalog.tenants.get(principal.tenant_id)
        if tenant is None:
            raise not_found("tenant", principal.tenant_id)
        req = to_request(body)
        now = self.clock.compute_now()
        plan = admit(req, tenant, catalog.pools.get(req.pool_id), catalog.profile(req.pool_id), now)

        draft = None
        if existing is None:
            draft = Reservation(
                id=rid, tenant_id=tenant.id, principal_id=principal.id, idempotency_key=key, fingerprint=fp,
                pool_id=plan.pool.id, region=plan.pool.region, state=states.DRAFT, binding=plan.binding,
                gpu_model=plan.pool.gpu_model, sharing=plan.pool.sharing, gpu_count=plan.gpu_count,
                node_count=plan.node_count, created_at=now, updated_at=now, mig_profile=plan.mig_profile,
                start=plan.start, end=plan.end, duration_ms=plan.duration_ms, spot=plan.spot,
                lease_seconds=plan.lease_seconds, resources=plan.resources, charge=plan.charge,
            )
        attributes = iam_attributes(plan, tenant.id)
        attributes["principal"] = principal
        request = AuthzRequest(principal, CREATE, Resource("Reservation", rid, attributes))

        decide_now = getattr(self.authorizer, "decide_sync", None)
        if decide_now is not None:
            # An embedded decision takes microseconds, so the draft, its decision and
            # its admission are one transaction: the draft is still written first, and
            # a crash before the commit leaves nothing, so the retry decides afresh.
            def job(tx: Tx):
                res = None
                if draft is not None:
                    res = tx.reservation(rid)
                    if res is not None:  # a concurrent request with the same key got here first
                        replay = self._replay(res, fp, tx.operation)
                        if replay is not None:
                            return replay
                    else:
                        res = draft  # stored by the admission below, in whatever state it ends
                return self._job_admit(tx, rid, plan, decide_now(request), principal, res)

            answer = await self.writer.call(job)
        else:
            if draft is not None:
                stored = await self.writer.call(lambda tx: self._job_write_draft(tx, draft, principal))
                if stored is not draft:
                    replay = self._replay(stored, fp)
                    if replay is not None:
                        return replay
            decision = await self.authorizer.decide(request)
            answer = await self.writer.call(lambda tx: self._job_admit(tx, rid, plan, decision, principal))
        self._notify("created", answer.reservation)
        return answer

    def _replay(self, existing: Reservation, fp: str, operation_of=None) -> Answer | None:
        """The answer to a repeated key, or None when its draft is to be decided again.

        operation_of reads the operation (a job passes its transaction's reader).
        """
        if existing.fingerprint != fp:
            raise DomainError(
                CONFLICT,
                "idempotencyKey: this key was used for a different request",
                {"reservationId": existing.id, "reason": "idempotency-key-reused", "field": "idempotencyKey"},
            )
        if existing.decision == "deny":
            raise DomainError(ACCESS_DENIED, "this key's request was refused; use a new key for a new request",
                              {"reservationId": existing.id, "action": CREATE})
        if existing.state == states.DRAFT:
            return None
        if operation_of is None:
            return self._answer(existing)
        return Answer(existing, operation_of(existing.operation_id) if existing.operation_id else None)

    @staticmethod
    def _job_write_draft(tx: Tx, draft: Reservation, principal: Principal) -> Reservation:
        existing = tx.reservation(draft.id)
        if existing is not None:
            return existing
        tx.insert_reservation(draft)
        return draft

    def _job_admit(self, tx: Tx, rid: str, plan: Plan, decision: Decision, principal: Principal,
                   res: Reservation | None = None) -> Answer | Commit:
        return self._admit(tx, res if res is not None else tx.reservation(rid), rid, plan, decision, principal)

    def _admit(self, tx: Tx, res: Reservation | None, rid: str, plan: Plan, decision: Decision,
               principal: Principal) -> Answer | Commit:
        if res is None:  # the draft is gone: cannot happen unless the database was edited by hand
            raise not_found("reservation", rid)
        if res.state != states.DRAFT:
            return Answer(res, tx.operation(res.operation_id) if res.operation_id else None)
        now = self.clock.compute_now()
        if res.decision == "deny":
            raise DomainError(ACCESS_DENIED, "this key's request was refused", {"reservationId": rid, "action": CREATE})
        if not decision.allowed:
            res.decision = "deny"
            res.updated_at = now
            tx.save_reservation(res)
            return Commit(DomainError(
                ACCESS_DENIED,
                f"{principal.id} may not create this reservation",
                {"reservationId": rid, "action": CREATE, "errors": list(decision.errors)},
            ))
        catalog = self.catalog.current
        tenant = catalog.tenants[res.tenant_id]
        try:
            self._check_spend(tenant, plan)
            self.state.ledger.check(tenant, catalog.pools, plan.charge)
        except DomainError as err:
            if res.seq == 0:  # the draft stays, so the same key can be retried
                tx.save_reservation(res)
                return Commit(err)
            raise

        # Allowed and charged: the draft becomes a reservation.
        res.decision = "allow"
        res.charge = dict(plan.charge)
        res.resources = plan.resources
        res.gpu_count = plan.gpu_count
        res.start, res.end, res.duration_ms = plan.start, plan.end, plan.duration_ms
        res.lease_deadline = now + plan.lease_seconds * 1000 if plan.lease_seconds else None
        op = Operation(operation_id(rid, "create"), "create", rid, res.tenant_id, "running", now, now)
        res.operation_id = op.id
        tx.touch()
        self.state.ledger.hold(res.tenant_id, res.charge)
        if self.try_place(tx, res, now):
            states.move(res, states.PLACED, now)
        else:
            states.move(res, states.PENDING, now)
            res.set_condition("Unschedulable", "True", "NoFit",
                              f"no {res.gpu_count} x {res.gpu_model} fit in pool {res.pool_id} for the window; retried as capacity frees", now)
            self.state.queue(res.pool_id)[res.id] = None
        tx.save_reservation(res)
        tx.put_operation(op)
        self._event(tx, res, states.EVENT_OF_STATE[res.state], now)
        return Answer(res, op)

    def _check_spend(self, tenant, plan: Plan) -> None:
        asked = plan.pool.policy.budget_check or (plan.offer is not None and plan.offer.budget_check)
        if not asked:
            return
        budget = tenant.budget_usd if tenant.budget_usd is not None else Decimal(0)
        spent = self.spent_usd(tenant.id)
        if spent >= budget:
            raise DomainError(
                SPEND_LIMIT_REACHED,
                f"tenant {tenant.id} has spent its budget ({spent} of {budget} USD); pool {plan.pool.id} checks budgets",
                {"budgetUsd": f"{budget:.6f}", "spentUsd": f"{spent:.6f}", "poolId": plan.pool.id},
            )

    def spent_usd(self, tenant_id: str) -> Decimal:
        """What the tenant has been billed so far (billing accrues from active to released)."""
        return Decimal(0)

    # ---- get and list ----------------------------------------------------------
    async def authorize_tenant_read(self, principal: Principal) -> None:
        await self._authorize(principal, READ, tenant_resource(principal.tenant_id))

    async def get(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id)
        await self._authorize(principal, READ, self._resource(res, principal))
        return self._answer(res)

    async def list(self, principal: Principal, body: ListBody) -> tuple[list[Answer], str | None]:
        await self.authorize_tenant_read(principal)
        before = None
        if body.cursor is not None:
            anchor = self.store.reservation(body.cursor)
            if anchor is None or anchor.tenant_id != principal.tenant_id:
                raise DomainError(INVALID_INPUT, "cursor: not a reservation of this tenant",
                                  {"field": "cursor", "rule": "must be the id of the last reservation of the previous page"})
            before = anchor.seq
        mine = principal.id if body.scope == "mine" else None
        chosen: list[Reservation] = []
        chunk = body.limit + 1
        while len(chosen) <= body.limit:
            page = self.store.reservations_page(principal.tenant_id, mine, body.state, body.poolId, before, chunk)
            if not page:
                break
            if body.scope == "all":
                decisions = await self.authorizer.decide_many(
                    [AuthzRequest(principal, READ, self._resource(r, principal)) for r in page]
                )
                chosen.extend(r for r, d in zip(page, decisions) if d.allowed)
            else:
                chosen.extend(page)
            before = page[-1].seq
            if len(page) < chunk:
                break
        more = len(chosen) > body.limit
        chosen = chosen[: body.limit]
        ops = self.store.operations([r.operation_id for r in chosen if r.operation_id])
        answers = [Answer(r, ops.get(r.operation_id) if r.operation_id else None) for r in chosen]
        return answers, (chosen[-1].id if more and chosen else None)

    # ---- release and cancel ------------------------------------------------------
    async def release(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id, drafts_found=True)
        await self._authorize(principal, RELEASE, self._resource(res, principal))
        answer, freed = await self.writer.call(lambda tx: self._job_end(tx, reservation_id, "release"))
        if freed:
            self._notify("freed", answer.reservation)
            self.wake(answer.reservation.pool_id)
        return answer

    async def cancel(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id)
        await self._authorize(principal, RELEASE, self._resource(res, principal))
        answer, freed = await self.writer.call(lambda tx: self._job_end(tx, reservation_id, "cancel"))
        if freed:
            self._notify("freed", answer.reservation)
            self.wake(answer.reservation.pool_id)
        return answer

    def _job_end(self, tx: Tx, rid: str, how: str) -> tuple[Answer, bool]:
        res = tx.reservation(rid)
        if res is None:
            raise not_found("reservation", rid, field="reservationId")
        now = self.clock.compute_now()
        if how == "release":
            if res.state in states.INTERNAL:
                raise DomainError(INVALID_STATE, f"reservation {rid} is still a request being decided; it cannot be released",
                                  {"state": res.state, "reservationId": rid})
            if res.state in states.TERMINAL:
                return self._answer_in(tx, res), False
        else:
            if res.state in states.INTERNAL:
                raise not_found("reservation", rid, field="reservationId")
            if res.state == states.CANCELLED:
                return self._answer_in(tx, res), False
            if res.state not in (states.PENDING, states.PLACED):
                raise DomainError(
                    INVALID_STATE,
                    f"reservation {rid} is {res.state}: only a pending or placed reservation can be cancelled; use release",
                    {"state": res.state, "reservationId": rid, "next": "release"},
                )
        op = self.end(tx, res, now, how, actor="customer")
        return Answer(res, op), True

    def end(self, tx: Tx, res: Reservation, now: int, reason: str, actor: str = "customer",
            kind: str | None = None) -> Operation | None:
        """End a live reservation now (released, or cancelled if it never held devices); one transaction.

        `reason` goes on the reservation and its event; `kind` names the
        operation recorded for the ending mutation (release, cancel), none
        for endings the platform decides.
        """
        kind = kind if kind is not None else (reason if reason in ("release", "cancel") else None)
        booked = res.state in states.BOOKED
        target = states.CANCELLED if res.state == states.PENDING or reason == "cancel" else states.RELEASED
        if booked:
            self._unbook(tx, res, now)
        if res.state in states.CHARGED:
            self._refund(tx, res)
        states.move(res, target, now, reason)
        res.clear_condition("Unschedulable")
        res.clear_condition("Queued")
        create_op = tx.operation(operation_id(res.id, "create"))
        if create_op is not None and create_op.status == "running":
            create_op.status = "cancelled" if actor == "customer" else "failed"
            create_op.updated_at = now
            create_op.failure = _ending_failure(reason, actor)
            tx.put_operation(create_op)
        op = None
        if kind is not None:
            op = Operation(operation_id(res.id, kind), kind, res.id, res.tenant_id, "succeeded", now, now)
            tx.put_operation(op)
            res.operation_id = op.id
        elif create_op is not None:
            op = create_op
        tx.update_reservation(res)
        self._event(tx, res, states.EVENT_OF_STATE[res.state], now, reason=reason)
        return op

    @staticmethod
    def _answer_in(tx: Tx, res: Reservation) -> Answer:
        return Answer(res, tx.operation(res.operation_id) if res.operation_id else None)

    # ---- freed capacity wakes the pool's pending reservations --------------------
    def wake(self, pool_id: str) -> None:
        if not self.state.pending.get(pool_id):
            return
        self._spawn(self.writer.call(lambda tx: self.place_pending(tx, pool_id)))

    def place_pending(self, tx: Tx, pool_id: str, attempts: int = WAKE_ATTEMPTS) -> list[str]:
        """Try the pool's pending reservations oldest first; the ids placed."""
        queue = self.state.queue(pool_id)
        placed: list[str] = []
        now = self.clock.compute_now()
        for rid in list(queue)[:attempts]:
            res = tx.reservation(rid)
            if res is None or res.state != states.PENDING:
                tx.touch()
                queue.pop(rid, None)
                continue
            if self.try_place(tx, res, now):
                states.move(res, states.PLACED, now)
                res.clear_condition("Unschedulable")
                res.clear_condition("Queued")
                tx.update_reservation(res)
                self._event(tx, res, states.EVENT_OF_STATE[states.PLACED], now)
                queue.pop(rid, None)
                placed.append(rid)
        return placed


def _ending_failure(reason: str, actor: str) -> Failure:
    messages = {
        "release": ("released", "The reservation was released before its devices were ready.", "Create a new reservation when you need the devices."),
        "cancel": ("cancelled", "The reservation was cancelled before it started.", "Create a new reservation when you need the devices."),
        "expired": ("expired", "The window passed before the devices could be placed. Nothing was billed.", "Request a fresh quote, perhaps for another window or pool."),
        "preempted": ("preempted", "Spot capacity was taken back for a reservation that is not spot.", "Retry later or book without spot."),
        "lease-lapsed": ("lease-lapsed", "The lease was not renewed in time.", "Renew within leaseSeconds, or create without a lease."),
    }
    code, message, nxt = messages.get(reason, (reason, f"The reservation ended: {reason}.", "Create a new reservation."))
    return Failure(code, actor, message, nxt)
