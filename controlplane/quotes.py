"""Quotes and capacity answers: the price of a request now, and what would work when it cannot be had.

A quote records the request's priced fields and its hourly price at that
moment; it creates and charges nothing, holds no capacity, and expires
after 120 seconds. A create that names a quote is refused with
PRICE_CHANGED when the price or a priced field differs, and QUOTE_EXPIRED
when the quote is expired, unknown or not the tenant's. A refusal for
capacity (NO_CAPACITY) carries its reason (`price_ceiling`, `no_stock`,
`no_stock`), the other pools offered to the tenant that could hold the
request with their running price, cheapest first, and the earliest start
at which the request fits in the asked pool.
"""
from __future__ import annotations

import secrets
from dataclasses import replace
from decimal import Decimal
from typing import Any

import msgspec

from controlplane.commands import Create
from controlplane.domain.admission import MAX_LEAD_MS, CreateRequest, Plan, PoolProfile, ResourcesAsk, admit
from controlplane.domain.clock import Clock
from controlplane.domain.errors import NO_CAPACITY, PRICE_CHANGED, QUOTE_EXPIRED, DomainError
from controlplane.domain.model import Principal, Tenant
from controlplane.domain.placement import earliest_start, place
from controlplane.domain.preemption import would_preempt
from controlplane.domain.pricing import money, prorated
from controlplane.state import WriterState
from controlplane.store.port import Reads, Store
from controlplane.transitions import CatalogRef

QUOTE_TTL_MS = 120_000


class QuoteDoc(msgspec.Struct):
    id: str
    tenant_id: str
    principal_id: str
    created_at: int
    expires_at: int
    priced: dict
    hourly_usd: str


PRICED_RESOURCES = ("vcpuMilli", "memoryMiB", "hugepages1Gi")  # a priced `resources`, in ResourcesAsk's order


def priced_fields(req: CreateRequest) -> dict:
    """The fields of a request that set its price, by their wire names, as sent (a quote stores them so: the shape
    every release reads; compared through `as_booked`)."""
    res = req.resources
    return {
        "poolId": req.pool_id, "gpuModel": req.gpu_model, "sharing": req.sharing, "migProfile": req.mig_profile,
        "gpuCount": req.gpu_count, "nodeCount": req.node_count, "binding": req.binding, "spot": req.spot,
        "resources": None if res is None else dict(zip(PRICED_RESOURCES, (res.vcpu_milli, res.memory_mib,
                                                                          res.hugepages_1g))),
    }


def as_booked(priced: dict, plan: Plan, profile: PoolProfile) -> dict:
    """Priced fields as admission reads them, so that a create restating what its quote said (the pool's sharing,
    the quote's own `resources`, `resources: {}`) is no change: `sharing` left out is the pool's, and `resources`
    are what is booked above the per-GPU share of that request's gpuCount (the share itself follows gpuCount)."""
    out = {**priced, "sharing": priced.get("sharing") or plan.pool.sharing}
    count, asked = priced.get("gpuCount"), priced.get("resources")
    if plan.whole_node or not isinstance(count, int):
        return out  # a node binding books whole hosts and takes no resources
    floor = profile.share.scaled(count)
    above = ResourcesAsk(*((asked or {}).get(k) for k in PRICED_RESOURCES)).as_share().max_with(floor).minus(floor)
    out["resources"] = dict(zip(PRICED_RESOURCES, (above.vcpu_milli, above.memory_mib, above.hugepages_1g)))
    return out


def window_ms(plan: Plan) -> int:
    return plan.duration_ms if plan.start is None else (plan.end or 0) - plan.start


class Quotes:
    def __init__(self, store: Store, clock: Clock, catalog: CatalogRef, state: WriterState):
        self.store = store
        self.clock = clock
        self.catalog = catalog
        self.state = state

    # ---- answers that say what would work -----------------------------------------
    def alternatives(self, tenant: Tenant, req: CreateRequest, now: int) -> list[dict]:
        """Other pools offered to the tenant that could hold the request, cheapest first."""
        catalog = self.catalog.current
        out = []
        for pool in catalog.pools.values():
            if pool.id == req.pool_id or not pool.visible_to(tenant.id) or pool.gpu_model != req.gpu_model:
                continue
            try:
                plan = admit(replace(req, pool_id=pool.id, sharing=None), tenant, pool, catalog.profile(pool.id), now)
            except DomainError:
                continue
            alt: dict[str, Any] = {"poolId": pool.id, "region": pool.region, "totalRunningUsdPerHour": money(plan.hourly_usd)}
            start = self.earliest(plan, now)
            if start is not None:
                alt["earliestStart"] = start
            out.append((plan.hourly_usd, pool.id, alt))
        out.sort(key=lambda item: (item[0], item[1]))
        return [alt for _, _, alt in out]

    def earliest(self, plan: Plan, now: int) -> int | None:
        """The earliest start, at or after the asked one, at which the request fits in its pool."""
        s, e = plan.window_for(now)
        return earliest_start(self.state.calendar.pool(plan.pool.id), self.catalog.current.nodes, plan.ask(s, e),
                              s, MAX_LEAD_MS)

    def no_capacity(self, err: DomainError, tenant: Tenant, req: CreateRequest, now: int) -> DomainError:
        """Admission's refusal of a shape the pool could never hold, as the seed's `no_stock`, with alternatives."""
        alternatives = self.alternatives(tenant, req, now)
        details = {**err.details, "reason": "no_stock", "alternatives": alternatives}
        if not alternatives:
            return DomainError(NO_CAPACITY, err.message + f"; no other pool offered to tenant {tenant.id} has "
                               f"{req.gpu_model} for it: change the accelerator or the count and quote again", details)
        return DomainError(NO_CAPACITY, err.message + "; other pools can: see details.alternatives", details)

    # ---- price checks on create ------------------------------------------------------
    def check(self, reads: Reads, principal: Principal, cmd: Create, plan: Plan, tenant: Tenant, now: int) -> None:
        """The quote a create names (PRICE_CHANGED, QUOTE_EXPIRED) and its price ceiling (NO_CAPACITY price_ceiling)."""
        ceiling = cmd.max_hourly_price
        if cmd.quote_id is not None:
            self._check_quote(reads, principal, cmd, plan, now)
        if ceiling is not None and plan.hourly_usd > ceiling:
            # The cheapest rate at which THIS request (its pool, shape and window) is accepted: the pool's price.
            # Other pools, cheaper or not, are alternatives.
            alternatives = self.alternatives(tenant, cmd.request, now)
            details: dict[str, Any] = {
                "reason": "price_ceiling", "cheapestEligibleUsdPerHour": money(plan.hourly_usd),
                "totalRunningUsdPerHour": money(plan.hourly_usd), "maxHourlyPrice": money(ceiling),
                "alternatives": alternatives, "poolId": plan.pool.id,
            }
            start = self.earliest(plan, now)
            if start is not None:
                details["earliestStart"] = start
            raise DomainError(NO_CAPACITY, f"No {plan.node_count} x {plan.gpu_count} {plan.pool.gpu_model} capacity in pool "
                              f"{plan.pool.id} within ${money(ceiling)}/hr: it runs at ${money(plan.hourly_usd)}/hr", details)

    def _check_quote(self, reads: Reads, principal: Principal, cmd: Create, plan: Plan, now: int) -> None:
        found = reads.quote(cmd.quote_id) if cmd.quote_id else None
        if found is None or found[0] != principal.tenant_id:
            named = cmd.quote_id if len(cmd.quote_id or "") <= 64 else None  # a malformed id is not echoed whole
            shown = repr(named) if named is not None else f"a {len(cmd.quote_id or '')}-character id"
            raise DomainError(QUOTE_EXPIRED, f"quoteId: {shown} is not a quote of this tenant; request a fresh quote",
                              {"field": "quoteId", "quoteId": named})
        doc = msgspec.json.decode(found[2], type=QuoteDoc)
        if doc.expires_at <= now:
            raise DomainError(QUOTE_EXPIRED, f"quote {doc.id} expired at {doc.expires_at}; request a fresh quote",
                              {"field": "quoteId", "quoteId": doc.id, "expiresAt": doc.expires_at})
        profile = self.catalog.current.profile(plan.pool.id)
        quoted, asked = as_booked(doc.priced, plan, profile), as_booked(priced_fields(cmd.request), plan, profile)
        changed = [k for k, v in asked.items() if quoted.get(k) != v]
        if changed or Decimal(doc.hourly_usd) != plan.hourly_usd:
            raise DomainError(PRICE_CHANGED, (f"{', '.join(changed)} changed since the quote" if changed else
                              f"the price changed from ${doc.hourly_usd}/hr to ${money(plan.hourly_usd)}/hr") +
                              "; request a fresh quote",
                              {"quoteId": doc.id, "quotedUsdPerHour": doc.hourly_usd,
                               "totalRunningUsdPerHour": money(plan.hourly_usd), "changed": changed})

    # ---- the quote itself ---------------------------------------------------------------
    def placement_now(self, plan: Plan, now: int) -> tuple[int | None, int]:
        """(earliest start, spot reservations preempted) as a create sent now would be placed: in the asked window
        (preempting spot work when the request is not spot, unless a pool-lease queue is ahead of it), else the
        earliest start at which it fits."""
        s, e = plan.window_for(now)
        if plan.pool.policy.placer == "pool-lease" and self.state.queue(plan.pool.id):
            return None, 0
        nodes, ask = self.catalog.current.nodes, plan.ask(s, e)
        if place(self.state.calendar.pool(plan.pool.id), nodes, ask) is not None:
            return s, 0  # fits as asked: nothing to preempt, no search for a later start
        if not plan.spot:  # as try_place: preemption only when the request does not fit as it is
            victims = would_preempt(self.state.calendar, plan.pool.id, nodes, ask,
                                    list(self.state.spot.get(plan.pool.id, ())))
            if victims:
                return s, len(victims)
        return self.earliest(plan, now), 0

    async def quote(self, principal: Principal, req: CreateRequest, plan: Plan, tenant: Tenant,
                    confirmation: dict) -> dict:
        now = self.clock.compute_now()
        start, preempts = self.placement_now(plan, now)
        doc = QuoteDoc("qt_" + secrets.token_hex(12), tenant.id, principal.id, now, now + QUOTE_TTL_MS,
                       priced_fields(req), money(plan.hourly_usd))
        await self.store.call(lambda tx: tx.put_quote(doc.id, doc.tenant_id, doc.expires_at, msgspec.json.encode(doc)))
        return {
            "id": doc.id, "createdAt": now, "expiresAt": doc.expires_at, "currency": "USD",
            "poolId": plan.pool.id, "region": plan.pool.region, "gpuModel": plan.pool.gpu_model,
            "gpuCount": plan.gpu_count, "nodeCount": plan.node_count, "resources": plan.resources.to_wire(),
            "totalRunningUsdPerHour": doc.hourly_usd,
            "windowHours": window_ms(plan) / 3_600_000,
            "totalUsd": money(prorated(plan.hourly_usd, window_ms(plan))),
            "earliestStart": start, "fitsNow": start is not None and start <= now, "preemptsSpot": preempts,
            "confirmation": confirmation,
            "alternatives": self.alternatives(tenant, req, now),
            "priced": doc.priced,
        }
