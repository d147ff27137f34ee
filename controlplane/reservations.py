"""The reservations service: the seven tenant methods (create, get, list, release, cancel, extend, renew).

Each method takes a command (controlplane/commands.py), asks IAM, and makes
its change as a job of the store's writer through Transitions (one
transaction in which the state moves and everything that follows from it is
written). create writes the draft first and decides once on it: with the
embedded authorizer the replay check, the draft, its decision and its
admission are one job (one read of the key, one transaction); with a remote
one the draft is written, the decision awaited, and the draft admitted in a
second job. An agent refused where its delegating user would be allowed
opens a confirmation instead.
"""
from __future__ import annotations

import asyncio
import time
import secrets
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Callable, Iterable

import structlog

from controlplane import confirmations
from controlplane.billing import Billing
from controlplane.commands import Create, Extend, ListQuery
from controlplane.domain import states
from controlplane.domain.admission import Plan, admit, iam_attributes, reservation_attributes
from controlplane.domain.clock import Clock
from controlplane.domain.errors import (
    ACCESS_DENIED, CONFLICT, INSUFFICIENT_FUNDS, INVALID_INPUT, INVALID_STATE, NO_CAPACITY, PROVIDER_UNAVAILABLE,
    SPEND_LIMIT_REACHED, DomainError, not_found,
)
from controlplane.domain.ids import reservation_id
from controlplane.domain.model import Operation, PendingChange, Principal, Reservation, Tenant
from controlplane.domain.pricing import exposure, money
from controlplane.iam.authorizer import (
    CREATE, EXTEND, READ, RELEASE, Authorizer, AuthzRequest, Decision, Resource, access_denied, tenant_resource,
)
from controlplane.quotes import Quotes
from controlplane.reconciler import Reconciler
from controlplane.state import WriterState
from controlplane.store.port import Store, Tx
from controlplane.transitions import CatalogRef, Transitions

log = structlog.get_logger("berth.reservations")

EXTEND_STALE_MS = 60_000  # a pending change older than this was abandoned (its caller died mid-decision)
EXTEND_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Answer:
    reservation: Reservation
    operation: Operation | None
    extended: bool | None = None
    available_until: int | None = None
    not_extended: str | None = None  # why not: "already-reached" (the end is at or after the asked one) or "no-room"


QUOTED = "rsv_quote"  # the resource id a quote's dry-run decision names (a quote has no reservation)


@dataclass(frozen=True, slots=True)
class Verdict:
    """IAM's answer to a create: allow, deny, or confirm (ask `approver`, the agent's delegating user)."""

    outcome: str
    decision: Decision
    approver: str | None = None


def iam_unavailable(decision: Decision, keyed: bool = False) -> DomainError:
    """PROVIDER_UNAVAILABLE: no decision (keyed: a create, whose retry takes the same idempotency key)."""
    retry = "retry later with the same idempotency key" if keyed else "retry later"
    return DomainError(PROVIDER_UNAVAILABLE, f"the IAM decision service could not be reached: nothing was decided; "
                       f"{retry}",
                       {"actor": "platform", "reference": f"iam-{time.time_ns():x}",
                        "errors": list(decision.errors)})


def draft_of(principal: Principal, key: str, fp: str, plan: Plan, now: int) -> Reservation:
    """The draft a create writes first: the request as planned, undecided, charged nothing yet."""
    pool = plan.pool
    res = Reservation(
        id=reservation_id(principal.tenant_id, principal.id, key), tenant_id=principal.tenant_id,
        principal_id=principal.id, idempotency_key=key, fingerprint=fp, pool_id=pool.id, region=pool.region,
        state=states.DRAFT, binding=plan.binding, gpu_model=pool.gpu_model, sharing=pool.sharing,
        gpu_count=plan.gpu_count, node_count=plan.node_count, created_at=now, updated_at=now,
        mig_profile=plan.mig_profile, spot=plan.spot, lease_seconds=plan.lease_seconds,
        ending_warning_ms=pool.policy.ending_warning_ms,
    )
    if plan.whole_node:  # tenant root: fixed at creation, as the price is
        res.ssh_keys, res.login_user, res.cleaning = list(plan.ssh_keys), pool.policy.root_user, pool.policy.cleaning
        res.turnaround_ms = plan.turnaround_ms
    apply_plan(res, plan)
    return res


def apply_plan(res: Reservation, plan: Plan) -> None:
    """What admission computed for the draft (its window, share, charge and price) onto it.

    A draft continued by a retry of its key gets the plan of that retry: the
    request is the same (same fingerprint), the pool's share or price may not be.
    """
    res.gpu_count = plan.gpu_count
    res.start, res.end, res.duration_ms = plan.start, plan.end, plan.duration_ms
    res.resources, res.charge, res.hourly_usd = plan.resources, dict(plan.charge), plan.hourly_usd


def wake(waiting: Iterable[asyncio.Future]) -> None:
    """Answer every waiter (a long poll, a held create, an operation's wait) that has not been answered."""
    for fut in waiting:
        if not fut.done():
            fut.set_result(None)


class ReservationService:
    def __init__(self, store: Store, authorizer: Authorizer, clock: Clock, catalog: CatalogRef, state: WriterState,
                 moves: Transitions, billing: Billing, quotes: Quotes, reconciler: Reconciler):
        self.store = store
        self.authorizer = authorizer
        self.clock = clock
        self.catalog = catalog
        self.state = state
        self.moves = moves
        self.billing = billing
        self.quotes = quotes
        self.reconciler = reconciler
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._event_waiters: dict[str, list[asyncio.Future]] = {}  # tenant -> long polls on its events
        self.closing = False
        moves.listeners.append(self._wake_waiters)

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
            raise access_denied(decision, f"{principal.id} may not {action.rsplit(':', 1)[-1]} "
                                f"{resource.type.lower()} {resource.id}", {"action": action, "resource": resource.id})
        return decision

    def _resource(self, res: Reservation, principal: Principal, attributes: dict[str, Any] | None = None) -> Resource:
        attrs = dict(attributes if attributes is not None else reservation_attributes(res))
        owner = principal if res.principal_id == principal.id else (
            self.catalog.current.principals.get(res.principal_id) or Principal(res.principal_id, res.tenant_id)
        )
        attrs["principal"] = owner
        return Resource("Reservation", res.id, attrs)

    @staticmethod
    def _answer(reads, res: Reservation) -> Answer:
        """The reservation with its current operation, read from `reads` (the store, or a job's transaction)."""
        return Answer(res, res.operation())

    def _tenant(self, principal: Principal) -> Tenant:
        tenant = self.catalog.current.tenants.get(principal.tenant_id)
        if tenant is None:
            raise not_found("tenant", principal.tenant_id)
        return tenant

    def _wake_waiters(self, res: Reservation) -> None:
        # A saved reservation (after its commit) is when its events become readable: wake the tenant's long polls.
        wake(self._event_waiters.pop(res.tenant_id, ()))
        if res.state == states.PENDING:
            return
        wake(self._waiters.pop(res.id, ()))

    def wake_all(self, live: list[Reservation]) -> None:
        """The writer's memory was rebuilt from the database (another replica wrote): every events long poll looks
        again, and every create held while pending whose reservation is no longer pending answers."""
        pending = {res.id for res in live if res.state == states.PENDING}
        for waiting in self._event_waiters.values():
            wake(waiting)
        for rid in [rid for rid in self._waiters if rid not in pending]:
            wake(self._waiters.pop(rid))

    async def wait_while_pending(self, answer: Answer, timeout_ms: int) -> Answer:
        """Hold the create's answer while its reservation waits for capacity, at most timeout_ms."""
        if answer.reservation.state != states.PENDING or timeout_ms <= 0 or self.closing:
            return answer
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(answer.reservation.id, []).append(fut)
        try:
            await asyncio.wait_for(fut, timeout_ms / 1000)
        except asyncio.TimeoutError:
            waiters = self._waiters.get(answer.reservation.id, [])
            if fut in waiters:
                waiters.remove(fut)
        return self._answer(self.store, self.store.reservation(answer.reservation.id) or answer.reservation)

    # ---- create --------------------------------------------------------------
    async def create(self, principal: Principal, cmd: Create) -> Answer:
        """Create (or replay) the reservation, then hold the answer while it is pending for at most cmd.wait_ms."""
        key = cmd.key or secrets.token_urlsafe(18)
        tenant = self._tenant(principal)
        if self.authorizer.embedded:
            answer = await self.store.call(lambda tx: self._create_job(tx, principal, tenant, key, cmd),
                                           reads=(reservation_id(principal.tenant_id, principal.id, key),),
                                           append_only=True)
        else:
            answer = await self._create_remote(principal, tenant, key, cmd)
        if answer.reservation.state == states.PLACED and (answer.reservation.start or 0) <= self.clock.compute_now():
            self.reconciler.wake()  # its window has started: binding now, not at the reconciler's next tick
        return await self.wait_while_pending(answer, cmd.wait_ms)

    def _create_job(self, tx: Tx, principal: Principal, tenant: Tenant, key: str, cmd: Create) -> Answer | None:
        """The whole create with an embedded decision (microseconds): replay, or draft, decide and admit.

        The draft is still written first; a crash before the commit leaves
        nothing, so a retry decides afresh.
        """
        drafted = self._draft(tx, principal, tenant, key, cmd)
        if isinstance(drafted, Answer):
            return drafted
        res, plan, approved, now = drafted
        request = self._create_request(principal, res.id, plan)
        verdict = approved or self._verdict(principal, request, self.authorizer.decide_now(request),
                                            self.authorizer.decide_now)
        return self._admit(tx, res, plan, verdict, principal, tenant, now)

    async def _create_remote(self, principal: Principal, tenant: Tenant, key: str, cmd: Create) -> Answer:
        """A create decided by a remote service: the draft in one job, the decision awaited, the admission in another."""

        def draft_job(tx: Tx):
            drafted = self._draft(tx, principal, tenant, key, cmd)
            if not isinstance(drafted, Answer):
                tx.save_reservation(drafted[0])
            return drafted

        drafted = await self.store.call(draft_job)
        if isinstance(drafted, Answer):
            return drafted
        draft, plan, approved, _ = drafted
        request = self._create_request(principal, draft.id, plan)
        verdict = approved or await self._verdict_async(principal, request)

        def admit_job(tx: Tx) -> Answer:
            res = tx.reservation(draft.id)
            if res is None:  # the draft is gone: cannot happen unless the database was edited by hand
                raise not_found("reservation", draft.id)
            if res.state not in states.INTERNAL or res.decision == "deny":  # decided meanwhile by a concurrent retry
                replay = self._replay(tx, res, cmd)
                assert replay is not None
                return replay
            return self._admit(tx, res, plan, verdict, principal, tenant, self.clock.compute_now())

        return await self.store.call(admit_job)

    def _draft(self, tx: Tx, principal: Principal, tenant: Tenant, key: str,
               cmd: Create) -> Answer | tuple[Reservation, Plan, Verdict | None, int]:
        """What a create's key leads to: the answer to replay, or the draft to decide (a new one, or the key's
        earlier draft planned again) with its plan, the verdict of its approved confirmation, and now."""
        existing, approved = self._existing(tx, principal, key, cmd)
        if isinstance(existing, Answer):
            return existing
        now = self.clock.compute_now()
        plan = self._plan(tx, principal, tenant, cmd, now)
        if existing is None:
            existing = draft_of(principal, key, cmd.fingerprint, plan, now)
        else:
            apply_plan(existing, plan)
        return existing, plan, approved, now

    def _existing(self, tx: Tx, principal: Principal, key: str, cmd: Create) -> tuple[Reservation | Answer | None,
                                                                                       Verdict | None]:
        """What the key already holds: an Answer to replay, a draft to continue (with the approved verdict when
        its confirmation was approved), or nothing."""
        existing = tx.reservation(reservation_id(principal.tenant_id, principal.id, key))
        if existing is None:
            return None, None
        replay = self._replay(tx, existing, cmd)
        if replay is not None:
            return replay, None
        if existing.state == states.AWAITING_CONFIRMATION:  # approved: no second decision
            return existing, Verdict("allow", Decision(True, (f"confirmation:{existing.confirmation_id}",)))
        return existing, None

    def _create_request(self, principal: Principal, rid: str, plan: Plan) -> AuthzRequest:
        attributes = iam_attributes(plan, principal.tenant_id)
        attributes["principal"] = principal
        return AuthzRequest(principal, CREATE, Resource("Reservation", rid, attributes))

    def _plan(self, reads, principal: Principal, tenant: Tenant, cmd: Create, now: int) -> Plan:
        """Admission, the platform's own standing, and the price checks: refusals before anything is stored."""
        catalog = self.catalog.current
        req = cmd.request
        try:
            plan = admit(req, tenant, catalog.pools.get(req.pool_id), catalog.profile(req.pool_id), now)
        except DomainError as err:
            if err.code == NO_CAPACITY:
                raise self.quotes.no_capacity(err, tenant, req, now) from None
            raise
        nodes = catalog.pool_nodes(plan.pool.id)
        if nodes and not any(n.schedulable for n in nodes):
            raise DomainError(PROVIDER_UNAVAILABLE, f"every node of pool {plan.pool.id} is lost: Berth cannot place "
                              "anything there now; nothing of yours needs to change, retry later with the same key",
                              {"actor": "platform", "reference": f"pool-lost:{plan.pool.id}:{now}", "poolId": plan.pool.id})
        self.quotes.check(reads, principal, cmd, plan, tenant, now)
        return plan

    async def quote(self, principal: Principal, cmd: Create) -> dict:
        """Price a request now and answer what its create would: the same refusals (admission, IAM as a dry
        run, quota, budget), whether a person must confirm it, and where it would be placed (preempting spot work
        as a create does). Creates, charges and holds nothing."""
        tenant = self._tenant(principal)
        now = self.clock.compute_now()
        # a price ceiling in the body is refused as a create would refuse it (NO_CAPACITY price_ceiling); a quoteId
        # is not checked: a quote prices the request afresh
        plan = self._plan(self.store, principal, tenant, replace(cmd, quote_id=None), now)
        verdict = await self._verdict_async(principal, self._create_request(principal, QUOTED, plan))
        if verdict.decision.unavailable:
            raise iam_unavailable(verdict.decision)
        if verdict.outcome == "deny":
            raise access_denied(verdict.decision, f"{principal.id} may not create this reservation", {"action": CREATE})
        self._check_spend(tenant, plan)
        self.state.ledger.check(tenant, self.catalog.current.pools, plan.charge, plan.included)
        confirmation = {"required": verdict.outcome == "confirm", "approver": verdict.approver}
        return await self.quotes.quote(principal, cmd.request, plan, tenant, confirmation)

    def _replay(self, reads, existing: Reservation, cmd: Create) -> Answer | None:
        """The answer to a repeated key, or None when its draft is to be decided (or continued) now."""
        if existing.fingerprint != cmd.fingerprint and existing.fingerprint not in cmd.earlier():
            if existing.state in states.INTERNAL:  # a request never accepted: no reservation a tenant can get
                raise DomainError(CONFLICT, "idempotencyKey: this key was used for a different request, which was "
                                  "not accepted (refused, or awaiting a decision); use a new key",
                                  {"reason": "idempotency-key-reused", "field": "idempotencyKey"})
            raise DomainError(
                CONFLICT,
                "idempotencyKey: this key was used for a different request",
                {"reservationId": existing.id, "reason": "idempotency-key-reused", "field": "idempotencyKey"},
            )
        if existing.decision == "deny":
            conf = reads.confirmation(existing.confirmation_id) if existing.confirmation_id else None
            if conf is not None:  # a person denied it, or let it lapse: not a policy
                by = {"denied": f"denied by {conf.user_id}",
                      "approved": f"approved by {conf.user_id}, but not retried within the 30 minutes its draft "
                                  "waits, so the draft lapsed"}.get(conf.status, f"{conf.status} undecided")
                raise DomainError(ACCESS_DENIED, f"this key's request was {by} (confirmation {conf.id}); use a new "
                                  "key for a new request",
                                  {"action": CREATE, "confirmationId": conf.id, "status": conf.status,
                                   "approver": conf.user_id})
            raise DomainError(ACCESS_DENIED, "this key's request was refused; use a new key for a new request",
                              {"action": CREATE})
        if existing.state == states.DRAFT:
            return None
        if existing.state == states.AWAITING_CONFIRMATION:
            conf = reads.confirmation(existing.confirmation_id) if existing.confirmation_id else None
            now = self.clock.compute_now()
            if conf is not None and conf.status == "approved":
                return None
            if conf is None or conf.status != "pending" or conf.expires_at <= now:
                raise DomainError(ACCESS_DENIED, "the confirmation for this key was denied or lapsed",
                                  {"action": CREATE, "confirmationId": existing.confirmation_id})
            raise confirmations.required(conf)
        return Answer(existing, existing.create_operation() or existing.operation())  # the original receipt

    def _verdict(self, principal: Principal, request: AuthzRequest, decision: Decision,
                 decide: Callable[[AuthzRequest], Decision]) -> Verdict:
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
        """The user an agent's refused create may be put to: its delegating user, who must be able to decide it
        (scope manage: a read-scoped user can neither approve nor deny)."""
        if principal.kind != "agent" or not principal.delegated_by:
            return None
        user = self.catalog.current.principals.get(principal.delegated_by)
        return (user if user is not None and user.kind == "user" and user.tenant_id == principal.tenant_id
                and user.scope == "manage" else None)

    def _admit(self, tx: Tx, res: Reservation, plan: Plan, verdict: Verdict, principal: Principal, tenant: Tenant,
               now: int) -> Answer | None:
        """Decide the draft: allowed and charged, it becomes a reservation; refused, it stays (or is denied)."""
        if verdict.decision.unavailable:  # no decision: the draft stays undecided, a retry decides again
            if res.seq == 0:
                self.moves.save(tx, res)
                tx.refuse(iam_unavailable(verdict.decision, keyed=True))
                return None
            raise iam_unavailable(verdict.decision, keyed=True)
        if verdict.outcome == "deny":
            res.decision = "deny"
            res.updated_at = now
            self.moves.save(tx, res)
            tx.refuse(access_denied(verdict.decision, f"{principal.id} may not create this reservation",
                                    {"action": CREATE}))
            return None
        if verdict.outcome == "confirm" and res.state == states.DRAFT:
            conf = confirmations.open_for(res, principal, verdict.approver, plan, now)
            res.confirmation_id = conf.id
            states.move(res, states.AWAITING_CONFIRMATION, now)
            # The confirmation's row before the reservation is saved: a speculative run (store/pg_writer.py) stops
            # at that statement having changed nothing, and runs again under the lock without rebuilding memory.
            tx.put_confirmation(conf)
            self.moves.save(tx, res)
            self.moves.event(tx, res, "reservation.awaiting-confirmation", now, confirmationId=conf.id,
                             approver=conf.user_id)
            tx.refuse(confirmations.required(conf))
            return None
        try:
            self._check_spend(tenant, plan)
            self.state.ledger.check(tenant, self.catalog.current.pools, plan.charge, plan.included)
        except DomainError as err:
            if res.seq == 0:  # the draft stays, so the same key can be retried
                self.moves.save(tx, res)
                tx.refuse(err)
                return None
            raise
        # Allowed and charged: the draft becomes a reservation.
        res.decision = "allow"
        op = res.add_operation("create", "running", now)
        # Placed (or queued) before the charge is held: what placing reads from the database (the spot work it
        # preempts) it reads before anything in memory changes, so a speculative run can stop there cleanly.
        self.moves.place_or_queue(tx, res, now)
        tx.touch()
        self.state.ledger.hold(res.tenant_id, res.charge)
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
        # what live reservations may still bill is read before what was billed: a tick between the two reads is
        # then counted twice, never missed
        committed = self.billing.exposure_usd(tenant.id)
        spent = self.billing.spent_usd(tenant.id)
        if spent >= budget:
            raise DomainError(
                SPEND_LIMIT_REACHED,
                f"tenant {tenant.id} has spent its budget ({money(spent)} of {money(budget)} USD); pool {pool_id} checks budgets",
                {"budgetUsd": money(budget), "spentUsd": money(spent), "poolId": pool_id},
            )
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

    # ---- get, list, events --------------------------------------------------------
    async def authorize_tenant_read(self, principal: Principal) -> None:
        await self._authorize(principal, READ, tenant_resource(principal.tenant_id))

    async def get(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id)
        await self._authorize(principal, READ, self._resource(res, principal))
        return self._answer(self.store, res)

    async def list(self, principal: Principal, query: ListQuery) -> tuple[list[Answer], str | None]:
        await self.authorize_tenant_read(principal)
        before = None
        if query.cursor is not None:
            anchor = self.store.reservation(query.cursor)
            if anchor is None or anchor.tenant_id != principal.tenant_id:
                raise DomainError(INVALID_INPUT, "cursor: not a reservation of this tenant",
                                  {"field": "cursor", "rule": "must be the id of the last reservation of the previous page"})
            before = anchor.seq
        mine = principal.id if query.scope == "mine" else None
        chosen: list[Reservation] = []
        chunk = query.limit + 1
        while len(chosen) <= query.limit:
            page = self.store.reservations_page(principal.tenant_id, mine, query.state, query.pool_id, before, chunk)
            if not page:
                break
            if query.scope == "all":
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
        more = len(chosen) > query.limit
        chosen = chosen[: query.limit]
        answers = [Answer(r, r.operation()) for r in chosen]
        return answers, (chosen[-1].id if more and chosen else None)

    async def events(self, principal: Principal, after: int | None, limit: int, wait_ms: int = 0) -> list[dict]:
        """The tenant's events after the cursor; with wait_ms, held until one is committed (or the time is up)."""
        await self.authorize_tenant_read(principal)
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            rows = self.store.events(principal.tenant_id, after, limit)
            left = deadline - time.monotonic()
            if rows or left <= 0 or self.closing:
                return rows
            fut = asyncio.get_running_loop().create_future()
            waiting = self._event_waiters.setdefault(principal.tenant_id, [])
            waiting.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                pass
            finally:
                if fut in waiting:
                    waiting.remove(fut)

    async def last_event(self, principal: Principal) -> int | None:
        """The cursor after the tenant's newest event (decided as reading the tenant, like events)."""
        await self.authorize_tenant_read(principal)
        return self.store.last_event(principal.tenant_id)

    def close(self) -> None:
        """Shutting down: every long poll, and every create held while pending, answers now."""
        self.closing = True
        for waiting in (*self._event_waiters.values(), *self._waiters.values()):
            wake(waiting)

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
        answer, freed = await self.store.call(lambda tx: self._job_end(tx, reservation_id, how))
        if freed:
            self.reconciler.capacity_freed(answer.reservation.pool_id)
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
                return self._answer(tx, res), False
        else:
            if res.state in states.INTERNAL:
                raise not_found("reservation", rid, field="reservationId")
            if res.state == states.CANCELLED:
                return self._answer(tx, res), False
            started = res.state == states.PLACED and res.start is not None and res.start <= now
            if res.state not in (states.PENDING, states.PLACED) or started:  # the clock decides, not the reconciler
                raise DomainError(
                    INVALID_STATE,
                    f"reservation {rid} {'has started' if started else 'is ' + res.state}: only a reservation that has "
                    "not started can be cancelled" + ("" if res.state in states.TERMINAL else "; use release"),
                    {"state": res.state, "reservationId": rid,
                     **({} if res.state in states.TERMINAL else {"next": "release"})},
                )
        op = self.moves.end(tx, res, now, how, actor="customer", kind=how)
        return Answer(res, op), True

    # ---- extend and renew ----------------------------------------------------------
    async def extend(self, principal: Principal, cmd: Extend) -> Answer:
        res = self._visible(principal, cmd.reservation_id)
        if res.state not in states.BOOKED:
            raise DomainError(INVALID_STATE, f"reservation {res.id} is {res.state}: only placed, binding or active ones extend",
                              {"state": res.state, "reservationId": res.id})
        rid = res.id
        marked = await self.store.call(lambda tx: self._job_mark_extend(tx, rid, cmd))
        if isinstance(marked, Answer):
            return marked  # nothing to decide: already reached, or the calendar has no room
        res, new_end = marked
        attributes = reservation_attributes(res, duration_ms=new_end - (res.start or 0))
        decision = await self.authorizer.decide(AuthzRequest(principal, EXTEND, self._resource(res, principal, attributes)))
        return await self.store.call(lambda tx: self._job_apply_extend(tx, rid, new_end, decision, principal))

    @staticmethod
    def _check_extendable(res: Reservation | None, rid: str, now: int) -> None:
        """INVALID_STATE unless the reservation is placed, binding or active and its window has not ended yet
        (the clock decides, whether or not the reconciler has run)."""
        if res is None or res.state not in states.BOOKED:
            raise DomainError(INVALID_STATE, f"reservation {rid} is {res.state if res else 'gone'}: it cannot be extended",
                              {"state": res.state if res else None, "reservationId": rid})
        if res.end is not None and res.end <= now:
            raise DomainError(INVALID_STATE, f"reservation {rid}'s window ended at {res.end}: it cannot be extended; "
                              "create a new reservation", {"state": res.state, "reservationId": rid, "end": res.end})

    def _job_mark_extend(self, tx: Tx, rid: str, cmd: Extend):
        res = tx.reservation(rid)
        now = self.clock.compute_now()
        self._check_extendable(res, rid, now)
        new_end = cmd.until if cmd.until is not None else (res.end or now) + (cmd.by_ms or 0)
        # Nothing to change: answered with the reservation's latest operation, as every answer carries one; before
        # the in-flight check, so a retried until is safe while another extend is decided too
        if new_end <= (res.end or 0):  # already reached: safe to retry, no decision
            return Answer(res, res.operation(), extended=False, available_until=self.moves.room(res, res.end or now),
                          not_extended="already-reached")
        if res.pending_change is not None and now - res.pending_change.since < EXTEND_STALE_MS:
            raise DomainError(CONFLICT, "another extend of this reservation is being decided",
                              {"reason": "extend-in-flight", "retryAfterSeconds": EXTEND_RETRY_AFTER_S, "reservationId": rid})
        room = self.moves.room(res, new_end)
        if room < new_end:
            return Answer(res, res.operation(), extended=False, available_until=room, not_extended="no-room")
        res.pending_change = PendingChange(new_end, now)
        self.moves.save(tx, res, res.state)
        return res, new_end

    def _job_apply_extend(self, tx: Tx, rid: str, new_end: int, decision: Decision, principal: Principal):
        res = tx.reservation(rid)
        now = self.clock.compute_now()
        if res is None or res.state not in states.BOOKED or (res.end is not None and res.end <= now):
            self._check_extendable(res, rid, now)  # released, or ended, while IAM decided: INVALID_STATE
        if res.pending_change is None or res.pending_change.until != new_end:
            raise DomainError(CONFLICT, "another extend of this reservation was decided meanwhile",
                              {"reason": "extend-in-flight", "retryAfterSeconds": EXTEND_RETRY_AFTER_S, "reservationId": rid})
        res.pending_change = None

        def refuse(error: DomainError) -> None:
            self.moves.save(tx, res)  # the pending change is cleared either way
            tx.refuse(error)

        if decision.unavailable:
            return refuse(iam_unavailable(decision))
        if not decision.allowed:
            return refuse(access_denied(decision, f"{principal.id} may not extend reservation {rid} to {new_end}",
                                        {"action": EXTEND, "reservationId": rid}))
        if res.state not in states.BOOKED:
            return refuse(DomainError(INVALID_STATE, f"reservation {rid} became {res.state} meanwhile",
                                      {"state": res.state, "reservationId": rid}))
        tenant = self.catalog.current.tenants.get(res.tenant_id)
        try:
            if tenant is not None:
                self.check_spend(tenant, res.pool_id, self._spend_asked(res), self.billing.may_still_bill(
                    res, now, new_end) - self.billing.may_still_bill(res, now))  # the added time, as billing counts
        except DomainError as err:
            return refuse(err)
        room = self.moves.room(res, new_end)
        if room < new_end:
            self.moves.save(tx, res)
            return Answer(res, self._answer(tx, res).operation, extended=False, available_until=room,
                          not_extended="no-room")
        self.moves.set_end(tx, res, new_end)
        res.end = new_end
        if res.duration_ms is not None and res.start is not None:
            res.duration_ms = new_end - res.start
        res.extensions += 1
        op = res.add_operation("extend", "running" if res.bound else "succeeded", now)  # the nodes confirm
        res.updated_at = now
        self.moves.save(tx, res, res.state)
        self.moves.event(tx, res, "reservation.extended", now, end=new_end)
        return Answer(res, op, extended=True, available_until=self.moves.room(res, new_end))

    async def renew(self, principal: Principal, reservation_id: str) -> Answer:
        res = self._visible(principal, reservation_id)
        self._check_renewable(res, self.clock.compute_now())
        await self._authorize(principal, EXTEND, self._resource(res, principal))

        def job(tx: Tx) -> Answer:
            current = tx.reservation(reservation_id)
            now = self.clock.compute_now()
            self._check_renewable(current, now)
            current.lease_deadline = now + current.lease_seconds * 1000
            self.moves.save(tx, current, current.state)
            return self._answer(tx, current)

        return await self.store.call(job)

    @staticmethod
    def _check_renewable(res: Reservation, now: int) -> None:
        if res.lease_seconds is None:
            raise DomainError(INVALID_STATE, f"reservation {res.id} was created without leaseSeconds: there is no lease to renew",
                              {"state": res.state, "reservationId": res.id, "rule": "created without leaseSeconds"})
        if res.state not in states.BOOKED:
            raise DomainError(INVALID_STATE, f"reservation {res.id} is {res.state}: only placed, binding or active leases renew",
                              {"state": res.state, "reservationId": res.id})
        if res.lease_deadline is not None and res.lease_deadline <= now:  # lapsed, whether or not released yet
            raise DomainError(INVALID_STATE, f"reservation {res.id}'s lease lapsed at {res.lease_deadline}: it is "
                              "released; create a new reservation", {"state": res.state, "reservationId": res.id,
                                                                      "leaseDeadline": res.lease_deadline})
