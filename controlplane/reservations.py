"""The reservations service: the seven tenant methods (create, get, list, release, cancel, extend, renew).

Each method reads what it needs (committed data), asks IAM, and makes its
change as a job of the store's writer through Transitions (one transaction
in which the state moves and everything that follows from it is written).
create writes the draft first and decides once on it; an agent refused
where its delegating user would be allowed opens a confirmation instead.
"""
from __future__ import annotations

import asyncio
import secrets

import msgspec
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Callable

import structlog

from controlplane.domain import states
from controlplane.domain.admission import CreateRequest, Plan, ResourcesAsk, admit, iam_attributes, reservation_attributes
from controlplane.domain.clock import Clock
from controlplane.domain.errors import (
    ACCESS_DENIED, CONFLICT, INSUFFICIENT_FUNDS, INVALID_INPUT, INVALID_STATE, NO_CAPACITY, PROVIDER_UNAVAILABLE,
    SPEND_LIMIT_REACHED, DomainError, invalid, not_found,
)
from controlplane.domain.pricing import exposure, money
from controlplane.domain.ids import fingerprint, operation_id, reservation_id
from controlplane.domain.model import Operation, PendingChange, Principal, Reservation, Tenant
from controlplane.iam.authorizer import (
    CREATE, EXTEND, READ, RELEASE, Authorizer, AuthzRequest, Decision, Resource, tenant_resource,
)
from controlplane.schemas import CreateBody, ExtendBody, ListBody, fingerprint_of
from controlplane.state import WriterState
from controlplane.store.sqlite import Commit, SqliteStore, Tx
from controlplane.transitions import CatalogRef, Transitions
from controlplane import confirmations

log = structlog.get_logger("berth.reservations")

EXTEND_STALE_MS = 60_000  # a pending change older than this was abandoned (its caller died mid-decision)
EXTEND_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Answer:
    reservation: Reservation
    operation: Operation | None
    extended: bool | None = None
    available_until: int | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """IAM's answer to a create: allow, deny, or confirm (ask `approver`, the agent's delegating user)."""

    outcome: str
    decision: Decision
    approver: str | None = None


def iam_unavailable(decision: Decision) -> DomainError:
    return DomainError(PROVIDER_UNAVAILABLE, "the IAM decision service could not be reached: nothing was decided; "
                       "retry later with the same idempotency key",
                       {"actor": "platform", "reference": f"iam:{abs(hash(decision.errors)) % 10**10}",
                        "errors": list(decision.errors)})


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


class ReservationService:
    def __init__(self, store: SqliteStore, authorizer: Authorizer, clock: Clock, catalog: CatalogRef,
                 state: WriterState, transitions: Transitions | None = None):
        self.store = store
        self.authorizer = authorizer
        self.clock = clock
        self.catalog = catalog
        self.state = state
        self.moves = transitions or Transitions(clock, catalog, state)
        self._background: set[asyncio.Task] = set()
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self.moves.listeners.append(self._wake_waiters)
        self.spent_usd: Callable[[str], Decimal] = lambda tenant_id: Decimal(0)  # wiring gives Billing's
        self.exposure_usd: Callable[[str], Decimal] = lambda tenant_id: Decimal(0)
        self.quotes = None  # wiring gives Quotes
        self.on_due: Callable[[], None] = lambda: None  # a reservation whose window already started: wake the reconciler

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
        if decision.unavailable:
            raise iam_unavailable(decision)
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

    @staticmethod
    def _answer_in(tx: Tx, res: Reservation) -> Answer:
        return Answer(res, tx.operation(res.operation_id) if res.operation_id else None)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for background work (wakes of pending queues) to finish."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _wake_waiters(self, res: Reservation) -> None:
        if res.state == states.PENDING:
            return
        for fut in self._waiters.pop(res.id, ()):
            if not fut.done():
                fut.set_result(None)

    async def _wait_while_pending(self, answer: Answer, timeout_ms: int) -> Answer:
        """Hold the create's answer while its reservation waits for capacity, at most timeout_ms."""
        if answer.reservation.state != states.PENDING or timeout_ms <= 0:
            return answer
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(answer.reservation.id, []).append(fut)
        try:
            await asyncio.wait_for(fut, timeout_ms / 1000)
        except asyncio.TimeoutError:
            waiters = self._waiters.get(answer.reservation.id, [])
            if fut in waiters:
                waiters.remove(fut)
        return self._answer(self.store.reservation(answer.reservation.id) or answer.reservation)

    def wake(self, pool_id: str) -> None:
        """Freed capacity: try the pool's pending reservations now."""
        if not self.state.pending.get(pool_id):
            return
        self._spawn(self.writer.call(lambda tx: self.moves.place_pending(tx, pool_id)))

    # ---- create --------------------------------------------------------------
    async def create(self, principal: Principal, body: CreateBody, header_key: str | None) -> Answer:
        if header_key is not None and body.idempotencyKey is not None and header_key != body.idempotencyKey:
            raise DomainError(INVALID_INPUT, "idempotencyKey: differs from the Idempotency-Key header",
                              {"field": "idempotencyKey", "rule": "must equal the Idempotency-Key header when both are given"})
        key = header_key or body.idempotencyKey or secrets.token_urlsafe(18)
        rid = reservation_id(principal.tenant_id, principal.id, key)
        fp = fingerprint(fingerprint_of(body))
        wait_ms = body.wait.timeoutMs if body.wait else 0

        existing = self.store.reservation(rid)
        confirmed = False
        if existing is not None:
            replay = self._replay(existing, fp, self.store.operation, self.store.confirmation)
            if replay is not None:
                return await self._wait_while_pending(replay, wait_ms)
            confirmed = existing.state == states.AWAITING_CONFIRMATION  # approved: no second decision

        catalog = self.catalog.current
        tenant = catalog.tenants.get(principal.tenant_id)
        if tenant is None:
            raise not_found("tenant", principal.tenant_id)
        now = self.clock.compute_now()
        plan = self._plan(principal, tenant, body, now)

        draft = None
        if existing is None:
            draft = Reservation(
                id=rid, tenant_id=tenant.id, principal_id=principal.id, idempotency_key=key, fingerprint=fp,
                pool_id=plan.pool.id, region=plan.pool.region, state=states.DRAFT, binding=plan.binding,
                gpu_model=plan.pool.gpu_model, sharing=plan.pool.sharing, gpu_count=plan.gpu_count,
                node_count=plan.node_count, created_at=now, updated_at=now, mig_profile=plan.mig_profile,
                start=plan.start, end=plan.end, duration_ms=plan.duration_ms, spot=plan.spot,
                lease_seconds=plan.lease_seconds, resources=plan.resources, charge=plan.charge,
                hourly_usd=plan.hourly_usd,
            )
        attributes = iam_attributes(plan, tenant.id)
        attributes["principal"] = principal
        request = AuthzRequest(principal, CREATE, Resource("Reservation", rid, attributes))
        approved = Verdict("allow", Decision(True, (f"confirmation:{existing.confirmation_id}",))) if confirmed else None

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
                        replay = self._replay(res, fp, tx.operation, tx.confirmation)
                        if replay is not None:
                            return replay
                    else:
                        res = draft  # stored by the admission below, in whatever state it ends
                verdict = approved or self._verdict(principal, request, decide_now(request), decide_now)
                return self._admit(tx, res or tx.reservation(rid), rid, plan, verdict, principal, tenant)

            answer = await self.writer.call(job)
        else:
            if draft is not None:
                stored = await self.writer.call(lambda tx: self._write_draft(tx, draft))
                if stored is not draft:
                    replay = self._replay(stored, fp, self.store.operation, self.store.confirmation)
                    if replay is not None:
                        return await self._wait_while_pending(replay, wait_ms)
            verdict = approved or await self._verdict_async(principal, request)
            answer = await self.writer.call(
                lambda tx: self._admit(tx, tx.reservation(rid), rid, plan, verdict, principal, tenant))
        if answer.reservation.state == states.PLACED and (answer.reservation.start or 0) <= self.clock.compute_now():
            self.on_due()  # its window has started: the reconciler moves it to binding now, not at its next tick
        return await self._wait_while_pending(answer, wait_ms)

    def _plan(self, principal: Principal, tenant: Tenant, body: CreateBody, now: int) -> Plan:
        """Admission, the platform's own standing, and the price checks: refusals before anything is stored."""
        catalog = self.catalog.current
        req = to_request(body)
        try:
            plan = admit(req, tenant, catalog.pools.get(body.poolId), catalog.profile(body.poolId), now)
        except DomainError as err:
            if err.code == NO_CAPACITY and self.quotes is not None:
                raise self.quotes.no_capacity(err, tenant, req, now) from None
            raise
        nodes = catalog.pool_nodes(plan.pool.id)
        if nodes and not any(n.schedulable for n in nodes):
            raise DomainError(PROVIDER_UNAVAILABLE, f"every node of pool {plan.pool.id} is lost: Berth cannot place "
                              "anything there now; nothing of yours needs to change, retry later with the same key",
                              {"actor": "platform", "reference": f"pool-lost:{plan.pool.id}:{now}", "poolId": plan.pool.id})
        if self.quotes is not None:
            self.quotes.check(principal, body, plan, tenant, req, now)
        return plan

    async def quote(self, principal: Principal, body: CreateBody) -> dict:
        """Price a request now: creates and charges nothing, holds no capacity."""
        catalog = self.catalog.current
        tenant = catalog.tenants.get(principal.tenant_id)
        if tenant is None:
            raise not_found("tenant", principal.tenant_id)
        now = self.clock.compute_now()
        plan = self._plan(principal, tenant, msgspec.structs.replace(body, quoteId=None, maxHourlyPrice=None), now)
        return await self.quotes.quote(principal, body, plan, tenant, to_request(body))

    def _replay(self, existing: Reservation, fp: str, operation_of, confirmation_of) -> Answer | None:
        """The answer to a repeated key, or None when its draft is to be decided (or continued) now."""
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
        if existing.state == states.AWAITING_CONFIRMATION:
            conf = confirmation_of(existing.confirmation_id) if existing.confirmation_id else None
            now = self.clock.compute_now()
            if conf is not None and conf.status == "approved":
                return None
            if conf is None or conf.status != "pending" or conf.expires_at <= now:
                raise DomainError(ACCESS_DENIED, "the confirmation for this key was denied or lapsed",
                                  {"reservationId": existing.id, "confirmationId": existing.confirmation_id})
            raise confirmations.required(conf)
        return Answer(existing, operation_of(existing.operation_id) if existing.operation_id else None)

    def _verdict(self, principal: Principal, request: AuthzRequest, decision: Decision, decide) -> Verdict:
        if decision.allowed:
            return Verdict("allow", decision)
        user = self._delegating_user(principal)
        if user is None:
            return Verdict("deny", decision)
        if decision.confirm or decide(replace(request, principal=user)).allowed:
            return Verdict("confirm", decision, user.id)
        return Verdict("deny", decision)

    async def _verdict_async(self, principal: Principal, request: AuthzRequest) -> Verdict:
        decision = await self.authorizer.decide(request)
        if decision.allowed:
            return Verdict("allow", decision)
        user = self._delegating_user(principal)
        if user is None:
            return Verdict("deny", decision)
        if decision.confirm or (await self.authorizer.decide(replace(request, principal=user))).allowed:
            return Verdict("confirm", decision, user.id)
        return Verdict("deny", decision)

    def _delegating_user(self, principal: Principal) -> Principal | None:
        if principal.kind != "agent" or not principal.delegated_by:
            return None
        user = self.catalog.current.principals.get(principal.delegated_by)
        return user if user is not None and user.kind == "user" and user.tenant_id == principal.tenant_id else None

    @staticmethod
    def _write_draft(tx: Tx, draft: Reservation) -> Reservation:
        existing = tx.reservation(draft.id)
        if existing is not None:
            return existing
        tx.insert_reservation(draft)
        return draft

    def _admit(self, tx: Tx, res: Reservation | None, rid: str, plan: Plan, verdict: Verdict,
               principal: Principal, tenant: Tenant) -> Answer | Commit:
        if res is None:  # the draft is gone: cannot happen unless the database was edited by hand
            raise not_found("reservation", rid)
        if res.state not in states.INTERNAL:
            return self._answer_in(tx, res)
        if res.decision == "deny":
            raise DomainError(ACCESS_DENIED, "this key's request was refused", {"reservationId": rid, "action": CREATE})
        now = self.clock.compute_now()
        if verdict.decision.unavailable:  # no decision: the draft stays undecided, a retry decides again
            if res.seq == 0:
                self.moves.save(tx, res)
                return Commit(iam_unavailable(verdict.decision))
            raise iam_unavailable(verdict.decision)
        if verdict.outcome == "deny":
            res.decision = "deny"
            res.updated_at = now
            self.moves.save(tx, res)
            return Commit(DomainError(
                ACCESS_DENIED, f"{principal.id} may not create this reservation",
                {"reservationId": rid, "action": CREATE, "errors": list(verdict.decision.errors)},
            ))
        if verdict.outcome == "confirm" and res.state == states.DRAFT:
            conf = confirmations.open_for(res, principal, verdict.approver, plan, now)
            res.confirmation_id = conf.id
            states.move(res, states.AWAITING_CONFIRMATION, now)
            self.moves.save(tx, res)
            tx.put_confirmation(conf)
            self.moves.event(tx, res, "reservation.awaiting-confirmation", now, confirmationId=conf.id,
                             approver=conf.user_id)
            return Commit(confirmations.required(conf))

        catalog = self.catalog.current
        try:
            self._check_spend(tenant, plan)
            self.state.ledger.check(tenant, catalog.pools, plan.charge)
        except DomainError as err:
            if res.seq == 0:  # the draft stays, so the same key can be retried
                self.moves.save(tx, res)
                return Commit(err)
            raise
        # Allowed and charged: the draft becomes a reservation.
        res.decision = "allow"
        res.charge = dict(plan.charge)
        res.resources = plan.resources
        res.gpu_count = plan.gpu_count
        res.start, res.end, res.duration_ms = plan.start, plan.end, plan.duration_ms
        op = Operation(operation_id(rid, "create"), "create", rid, res.tenant_id, "running", now, now)
        res.operation_id = op.id
        tx.touch()
        self.state.ledger.hold(res.tenant_id, res.charge)
        tx.put_operation(op)
        self.moves.place_or_queue(tx, res, now)
        return Answer(res, op)

    def _check_spend(self, tenant: Tenant, plan: Plan) -> None:
        pool, offer = plan.pool, plan.offer
        window = plan.duration_ms if plan.start is None else (plan.end or 0) - plan.start
        self.check_spend(tenant, pool.id, pool.policy.budget_check or (offer is not None and offer.budget_check),
                         exposure(plan.hourly_usd, window or 0))

    def check_spend(self, tenant: Tenant, pool_id: str, asked: bool, new_exposure: Decimal) -> None:
        """SPEND_LIMIT_REACHED when the budget is spent; INSUFFICIENT_FUNDS when what is left cannot cover the new exposure.

        What is left is the budget less what was billed and less what the
        tenant's live reservations may still bill.
        """
        if not asked:
            return
        budget = tenant.budget_usd if tenant.budget_usd is not None else Decimal(0)
        spent = self.spent_usd(tenant.id)
        if spent >= budget:
            raise DomainError(
                SPEND_LIMIT_REACHED,
                f"tenant {tenant.id} has spent its budget ({money(spent)} of {money(budget)} USD); pool {pool_id} checks budgets",
                {"budgetUsd": money(budget), "spentUsd": money(spent), "poolId": pool_id},
            )
        committed = self.exposure_usd(tenant.id)
        left = budget - spent - committed
        if new_exposure > left:
            raise DomainError(
                INSUFFICIENT_FUNDS,
                f"tenant {tenant.id} has {money(max(left, Decimal(0)))} USD left of its budget, and this may bill "
                f"{money(new_exposure)} USD: fund the budget or ask for less",
                {"budgetUsd": money(budget), "spentUsd": money(spent), "committedUsd": money(committed),
                 "leftUsd": money(left), "exposureUsd": money(new_exposure), "poolId": pool_id},
            )

    def _spend_asked(self, res: Reservation) -> bool:
        pool = self.catalog.current.pools.get(res.pool_id)
        if pool is None:
            return False
        offer = pool.offer_for(res.tenant_id) if pool.owner != res.tenant_id else None
        return pool.policy.budget_check or (offer is not None and offer.budget_check)

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
                failed = next((d for d in decisions if d.unavailable), None)
                if failed is not None:
                    raise iam_unavailable(failed)
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
        return await self._end(reservation_id, "release")

    async def cancel(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id)
        await self._authorize(principal, RELEASE, self._resource(res, principal))
        return await self._end(reservation_id, "cancel")

    async def _end(self, reservation_id: str, how: str) -> Answer:
        answer, freed = await self.writer.call(lambda tx: self._job_end(tx, reservation_id, how))
        if freed:
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
        op = self.moves.end(tx, res, now, how, actor="customer", kind=how)
        return Answer(res, op), True

    # ---- extend and renew ----------------------------------------------------------
    async def extend(self, principal: Principal, body: ExtendBody) -> Answer:
        if (body.until is None) == (body.by is None):
            raise invalid("until", "give exactly one of until (epoch ms) or by (milliseconds)")
        res = self._visible(principal, body.reservationId)
        if res.state not in states.BOOKED:
            raise DomainError(INVALID_STATE, f"reservation {res.id} is {res.state}: only placed, binding or active ones extend",
                              {"state": res.state, "reservationId": res.id})
        rid = res.id
        marked = await self.writer.call(lambda tx: self._job_mark_extend(tx, rid, body))
        if isinstance(marked, Answer):
            return marked  # nothing to decide: already reached, or the calendar has no room
        res, new_end = marked
        attributes = reservation_attributes(res, duration_ms=new_end - (res.start or 0))
        decision = await self.authorizer.decide(AuthzRequest(principal, EXTEND, self._resource(res, principal, attributes)))
        return await self.writer.call(lambda tx: self._job_apply_extend(tx, rid, new_end, decision, principal))

    def _room(self, res: Reservation, new_end: int) -> int:
        """The latest end up to new_end that the reservation's devices and host shares can reach."""
        latest = self.state.calendar.latest_end(res.id, new_end)
        catalog = self.catalog.current
        for b in self.state.calendar.bookings_of(res.id):
            node = catalog.nodes.get(b.node_id)
            cal = self.state.calendar.pools[b.pool_id].nodes[b.node_id]
            if node is None or b.share.empty or cal.host_fits(b.end, latest, b.share, node.capacity):
                continue
            starts = sorted({h.start for h in cal.host if b.end < h.start < latest} | {latest})
            room = b.end
            for s in starts:
                if not cal.host_fits(b.end, s, b.share, node.capacity):
                    break
                room = s
            latest = min(latest, room)
        return latest

    def _job_mark_extend(self, tx: Tx, rid: str, body: ExtendBody):
        res = tx.reservation(rid)
        now = self.clock.compute_now()
        if res is None or res.state not in states.BOOKED:
            raise DomainError(INVALID_STATE, f"reservation {rid} is {res.state if res else 'gone'}: it cannot be extended",
                              {"state": res.state if res else None, "reservationId": rid})
        if res.pending_change is not None and now - res.pending_change.since < EXTEND_STALE_MS:
            raise DomainError(CONFLICT, "another extend of this reservation is being decided",
                              {"reason": "extend-in-flight", "retryAfterSeconds": EXTEND_RETRY_AFTER_S, "reservationId": rid})
        new_end = body.until if body.until is not None else (res.end or now) + (body.by or 0)
        if new_end <= (res.end or 0):  # already reached: safe to retry, no decision
            return Answer(res, None, extended=False, available_until=self._room(res, res.end or now))
        room = self._room(res, new_end)
        if room < new_end:
            return Answer(res, None, extended=False, available_until=room)
        res.pending_change = PendingChange(new_end, now)
        self.moves.save(tx, res, res.state)
        return res, new_end

    def _job_apply_extend(self, tx: Tx, rid: str, new_end: int, decision: Decision, principal: Principal):
        res = tx.reservation(rid)
        now = self.clock.compute_now()
        if res is None or res.pending_change is None or res.pending_change.until != new_end:
            raise DomainError(CONFLICT, "another extend of this reservation was decided meanwhile",
                              {"reason": "extend-in-flight", "retryAfterSeconds": EXTEND_RETRY_AFTER_S, "reservationId": rid})
        res.pending_change = None
        if decision.unavailable:
            self.moves.save(tx, res)
            return Commit(iam_unavailable(decision))
        if not decision.allowed:
            self.moves.save(tx, res)
            return Commit(DomainError(ACCESS_DENIED, f"{principal.id} may not extend reservation {rid} to {new_end}",
                                      {"action": EXTEND, "reservationId": rid, "errors": list(decision.errors)}))
        if res.state not in states.BOOKED:
            self.moves.save(tx, res)
            return Commit(DomainError(INVALID_STATE, f"reservation {rid} became {res.state} meanwhile",
                                      {"state": res.state, "reservationId": rid}))
        tenant = self.catalog.current.tenants.get(res.tenant_id)
        try:
            if tenant is not None:
                self.check_spend(tenant, res.pool_id, self._spend_asked(res),
                                 exposure(res.hourly_usd, new_end - (res.end or new_end)))
        except DomainError as err:
            self.moves.save(tx, res)
            return Commit(err)
        room = self._room(res, new_end)
        if room < new_end:
            self.moves.save(tx, res)
            return Answer(res, self._answer_in(tx, res).operation, extended=False, available_until=room)
        tx.set_bookings_end(rid, new_end)
        tx.touch()
        self.state.calendar.set_end(rid, new_end)
        res.end = new_end
        if res.duration_ms is not None and res.start is not None:
            res.duration_ms = new_end - res.start
        res.extensions += 1
        op = Operation(operation_id(rid, "extend", res.extensions), "extend", rid, res.tenant_id, "succeeded", now, now)
        tx.put_operation(op)
        res.operation_id = op.id
        res.updated_at = now
        self.moves.save(tx, res, res.state)
        self.moves.event(tx, res, "reservation.extended", now, end=new_end)
        return Answer(res, op, extended=True, available_until=self._room(res, new_end))

    async def renew(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id)
        self._check_renewable(res)
        await self._authorize(principal, EXTEND, self._resource(res, principal))

        def job(tx: Tx) -> Answer:
            current = tx.reservation(reservation_id)
            self._check_renewable(current)
            now = self.clock.compute_now()
            current.lease_deadline = now + current.lease_seconds * 1000
            self.moves.save(tx, current, current.state)
            return self._answer_in(tx, current)

        return await self.writer.call(job)

    @staticmethod
    def _check_renewable(res: Reservation) -> None:
        if res.lease_seconds is None:
            raise DomainError(INVALID_STATE, f"reservation {res.id} was created without leaseSeconds: there is no lease to renew",
                              {"state": res.state, "reservationId": res.id, "rule": "created without leaseSeconds"})
        if res.state not in states.BOOKED:
            raise DomainError(INVALID_STATE, f"reservation {res.id} is {res.state}: only placed, binding or active leases renew",
                              {"state": res.state, "reservationId": res.id})
