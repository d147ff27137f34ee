"""The fleet as operators see and steer it: nodes (cordon, uncordon, drain, clear), pools and tenants; and the free
capacity of the pools a tenant may book.

Views are read from the writer's memory (the catalog, the calendar, the
quota ledger and the reservations holding a charge), so they show what
placement sees. The calendar arithmetic is plain functions at the top;
FleetService decides each call with IAM first (the admin token, `actor`
None, may do everything; an Operator principal what the policies allow) and
makes each action one store job: the node's state (domain/node_states.py)
is written to the catalog, so it survives a restart, with an event in the
fleet's stream; drain also moves the node's placed reservations that have
not started through the same placement as a create (Transitions.try_place),
or back to pending where nothing fits. Active and binding reservations run
to their end where they are.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Callable, Iterable, Mapping, Sequence

import structlog

from common.share import NO_SHARE, Share
from controlplane.billing import Billing
from controlplane.catalog import encode_item
from controlplane.domain import node_states
from controlplane.domain.quota import limits_of
from controlplane.domain.calendar import NodeCalendar, PoolCalendar
from controlplane.domain.clock import Clock
from controlplane.domain.errors import (COMPUTE_ACCESS_REQUIRED, INVALID_STATE, DomainError, invalid,
                                        not_found)
from controlplane.domain.model import Node, Pool, Principal, Reservation, Tenant
from controlplane.iam.authorizer import (NODES_CLEAR, NODES_CORDON, NODES_DRAIN, NODES_READ, NODES_RELEASE_IDENTITY,
                                         POOLS_READ, TENANTS_READ, Authorizer, AuthzRequest, Resource,
                                         access_denied, tenant_resource)
from controlplane.nodes import NodeService
from controlplane.reconciler import Reconciler
from controlplane.reservations import iam_unavailable
from controlplane.state import WriterState
from controlplane.store.port import Store, Tx
from controlplane.transitions import CatalogRef, Moved, Transitions

log = structlog.get_logger("berth.fleet")

FLEET_EVENTS = node_states.FLEET_EVENTS
DAY_MS = 86_400_000
DEFAULT_WINDOW_MS = 7 * DAY_MS
MAX_WINDOW_MS = 62 * DAY_MS
IAM_ACTION = {node_states.CORDON: NODES_CORDON, node_states.UNCORDON: NODES_CORDON,
              node_states.DRAIN: NODES_DRAIN, node_states.CLEAR: NODES_CLEAR}
EVENT_OF_ACTION = {node_states.CORDON: "node.cordoned", node_states.UNCORDON: "node.uncordoned",
                   node_states.DRAIN: "node.drained", node_states.CLEAR: "node.cleared"}
READ_ACTIONS = frozenset({NODES_READ, POOLS_READ, TENANTS_READ})


# ---- plain data --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Window:
    """[start, end) in epoch ms: which bookings a view shows."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class BookingView:
    """One reservation's hold on one node, as a calendar row shows it."""

    reservation_id: str
    tenant_id: str
    state: str
    binding: str
    spot: bool
    carried_on: bool  # a released kubernetes booking carried on past its window while pods hold the devices
    start: int
    end: int
    units: tuple[str, ...]
    gpus: tuple[int, ...]  # the GPU indices of those units

    def covers(self, t: int) -> bool:
        return self.start <= t < self.end


@dataclass(frozen=True, slots=True)
class Heartbeat:
    at: int  # epoch ms, from this process's memory (none before the first heartbeat since start)
    age_s: float


@dataclass(frozen=True, slots=True)
class NodeView:
    node: Node
    state: str  # shown: lost while lost, else the stored state
    lost: bool
    agent_version: str
    heartbeat: Heartbeat | None
    bookings: tuple[BookingView, ...]  # those overlapping the window, by start
    drained: bool  # holds no booking that ends after now
    stuck: tuple[str, ...] = ()  # kubernetes releases carried on here now (the KubernetesReleaseStuck condition)


@dataclass(frozen=True, slots=True)
class ActionResult:
    node: NodeView
    changed: bool  # False: the node already was in the state asked for (the action is idempotent)
    moved: tuple[Moved, ...] = ()  # drain: placed reservations now on other nodes
    pending: tuple[str, ...] = ()  # drain: placed reservations that fit nowhere else, now pending


@dataclass(frozen=True, slots=True)
class Count:
    total: int
    booked: int  # in use now
    free: int  # not in use now, on nodes that take placements


@dataclass(frozen=True, slots=True)
class PoolView:
    pool: Pool
    nodes: Mapping[str, int]  # shown state -> count (every state named)
    gpus: Count
    units: Count  # the bookable devices: whole GPUs, MIG instances or slots
    pending: int  # reservations waiting for capacity in the pool


EVENT_PAGES_READ = 10  # an operator's page of fleet events reads at most this many pages past hidden events


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: Tenant
    limits: Mapping[str, int]  # its quota: its own rows and its offers' (domain/quota.py's limits_of)
    used: Mapping[str, int]  # quota held, internal keys and units (domain/quota.py)
    spent_usd: Decimal  # billed so far
    committed_usd: Decimal  # what its live reservations may still bill until their windows end
    reservations: Mapping[str, int]  # live reservations by state


@dataclass(frozen=True, slots=True)
class FreeStep:
    at: int
    units: int  # devices free from `at` until the next step


@dataclass(frozen=True, slots=True)
class OfferedPool:
    """A pool the tenant owns or is offered: what can be booked there, and its devices free over the window."""

    pool: Pool
    units: int  # devices of its nodes that take placements
    free: tuple[FreeStep, ...]
    owned: bool = False
    bindings: tuple[str, ...] = ("hold",)  # the binding kinds this tenant may ask for here
    per_gpu: Share = NO_SHARE  # what a whole GPU brings of its host (exclusive pools)
    node_shapes: tuple[tuple[int, int], ...] = ()  # (GPUs per node, nodes of that size), largest first
    profiles: tuple[tuple[str, int], ...] = ()  # (MIG profile, instances) of a mig pool


def bindings_for(pool: Pool, tenant_id: str) -> tuple[str, ...]:
    """hold always; node where the pool gives tenant root; kubernetes on a kubernetes pool, for its owner only."""
    return ("hold",) + (("node",) if pool.policy.tenant_root else ()) + (
        ("kubernetes",) if pool.policy.kubernetes and pool.owner == tenant_id else ())


# ---- the calendar, read -----------------------------------------------------------------------

def window_of(now: int, start: int | None, end: int | None) -> Window:
    """The window a view asks for: from `start` (default now) for 7 days, at most 62 days."""
    s = now if start is None else start
    e = s + DEFAULT_WINDOW_MS if end is None else end
    if e <= s:
        raise invalid("until", "must be after from")
    if e - s > MAX_WINDOW_MS:
        raise invalid("until", f"at most {MAX_WINDOW_MS // DAY_MS} days after from")
    return Window(s, e)


def _gpus_of(node: Node, units: Iterable[str]) -> tuple[int, ...]:
    index = {u.id: u.gpu_index for u in node.units}
    return tuple(sorted({index[u] for u in units if u in index}))


def carried_on(res: Reservation) -> bool:
    """Whether the reservation's bookings run past its window: a kubernetes release held by pods (the seed's
    carry-on in 5-minute steps)."""
    hold = getattr(res, "hold", None)
    return hold is not None and getattr(hold, "carried_from", None) is not None


def bookings_on(node: Node, cal: NodeCalendar | None, lookup: Callable[[str], Reservation | None],
                window: Window) -> list[BookingView]:
    """The node's bookings that overlap the window, by start (each reservation holds one host booking per node)."""
    if cal is None:
        return []
    out = []
    for hb in cal.overlapping(window.start, window.end):
        res = lookup(hb.owner)
        if res is None:  # ended in a job not yet seen here
            continue
        placement = next((p for p in res.placements if p.node_id == node.id), None)
        units = tuple(placement.units) if placement else ()
        out.append(BookingView(res.id, res.tenant_id, res.state, res.binding, res.spot, carried_on(res), hb.start,
                               hb.end, units, _gpus_of(node, units)))
    out.sort(key=lambda b: (b.start, b.reservation_id))
    return out


def _busy_units(node: Node, cal: NodeCalendar | None, t: int) -> set[str]:
    """The node's units booked at instant t: of those it has now (a device it no longer reports keeps its bookings
    on the calendar, but is not counted as the node's)."""
    if cal is None:
        return set()
    busy = set()
    for uid in (u.id for u in node.units):
        tl = cal.devices.get(uid)
        if tl is None:
            continue
        j = bisect_left(tl.starts, t + 1)  # the last booking starting at or before t
        if j and tl.ends[j - 1] > t:
            busy.add(uid)
    return busy


def pool_counts(nodes: Sequence[Node], pool_cal: PoolCalendar, now: int) -> tuple[Count, Count]:
    """(GPUs, units) of the pool: in total, in use now, and free now on nodes that take placements."""
    gpu_total = gpu_booked = gpu_free = unit_total = unit_booked = unit_free = 0
    for node in nodes:
        busy = _busy_units(node, pool_cal.nodes.get(node.id), now)
        busy_gpus = {u.gpu_index for u in node.units if u.id in busy}
        gpus = {u.gpu_index for u in node.units}
        gpu_total += len(gpus)
        unit_total += len(node.units)
        gpu_booked += len(busy_gpus)
        unit_booked += len(busy)
        if node.placeable:
            gpu_free += len(gpus - busy_gpus)
            unit_free += len(node.units) - len(busy)
    return Count(gpu_total, gpu_booked, gpu_free), Count(unit_total, unit_booked, unit_free)


def free_steps(nodes: Sequence[Node], pool_cal: PoolCalendar, window: Window) -> tuple[int, tuple[FreeStep, ...]]:
    """(devices of the nodes that take placements, the free devices over the window as steps): one sweep over the
    bookings overlapping it, so the cost follows the bookings shown, not the calendar."""
    total = 0
    changes: Counter = Counter()
    for node in nodes:
        if not node.placeable:
            continue
        total += len(node.units)
        cal = pool_cal.nodes.get(node.id)
        if cal is None:
            continue
        for tl in (cal.devices[u.id] for u in node.units if u.id in cal.devices):  # the devices it has now
            j = bisect_left(tl.ends, window.start + 1)  # the first booking ending after the window's start
            while j < len(tl.starts) and tl.starts[j] < window.end:
                changes[max(tl.starts[j], window.start)] += 1
                if tl.ends[j] < window.end:
                    changes[tl.ends[j]] -= 1
                j += 1
    steps = [FreeStep(window.start, total)]
    busy = 0
    for at in sorted(changes):
        busy += changes[at]
        if at == window.start:
            steps[0] = FreeStep(at, total - busy)
        elif steps[-1].units != total - busy:
            steps.append(FreeStep(at, total - busy))
    return total, tuple(steps)


# ---- IAM's resources --------------------------------------------------------------------------

def node_resource(node: Node, pool: Pool | None) -> Resource:
    return Resource("Node", node.id, {"tenant": pool.owner if pool else "", "poolId": node.pool_id,
                                      "region": pool.region if pool else "", "gpuModel": pool.gpu_model if pool else "",
                                      "hostname": node.hostname})


def pool_resource(pool: Pool) -> Resource:
    return Resource("Pool", pool.id, {"tenant": pool.owner, "region": pool.region, "gpuModel": pool.gpu_model,
                                      "sharing": pool.sharing})


# ---- the service ------------------------------------------------------------------------------

class FleetService:
    def __init__(self, store: Store, clock: Clock, catalog: CatalogRef, state: WriterState, moves: Transitions,
                 nodes: NodeService, authorizer: Authorizer, reconciler: Reconciler, billing: Billing):
        self.store = store
        self.clock = clock
        self.catalog = catalog
        self.state = state
        self.moves = moves
        self.nodes = nodes
        self.authorizer = authorizer
        self.reconciler = reconciler
        self.billing = billing

    # ---- IAM ---------------------------------------------------------------------------------
    async def _allow(self, actor: Principal | None, action: str, resource: Resource) -> None:
        if actor is None:  # the admin token
            return
        if action not in READ_ACTIONS and actor.scope != "manage":
            raise DomainError(COMPUTE_ACCESS_REQUIRED, f"{actor.id}'s token has {actor.scope} access: "
                              f"{action} needs manage access; use a token with scope manage",
                              {"scope": actor.scope, "required": "manage"})
        decision = await self.authorizer.decide(AuthzRequest(actor, action, resource))
        if decision.unavailable:
            raise iam_unavailable(decision)
        if not decision.allowed:
            raise access_denied(decision, f"{actor.id} may not {action.split(':', 1)[1]} "
                                f"{resource.type.lower()} {resource.id}", {"action": action, "resource": resource.id})

    async def _allowed(self, actor: Principal | None, action: str, resources: Sequence[Resource]) -> list[bool]:
        """One batch decision per list: the resources the operator may see (a failed decision hides the item)."""
        if actor is None:
            return [True] * len(resources)
        decisions = await self.authorizer.decide_many([AuthzRequest(actor, action, r) for r in resources])
        if any(d.unavailable for d in decisions):
            raise iam_unavailable(next(d for d in decisions if d.unavailable))
        return [d.allowed for d in decisions]

    # ---- reads of memory ------------------------------------------------------------------------
    def _reservations(self) -> Callable[[str], Reservation | None]:
        """A reservation by id: those holding a charge (pending, placed, binding, active) as the writer holds them,
        others (a released one whose devices pods still hold) from the store."""
        charged = {rid: res for held in self.state.charged.values() for rid, res in held.items()}
        return lambda rid: charged.get(rid) or self.store.reservation(rid)

    def _node(self, node_id: str) -> Node:
        node = self.catalog.current.nodes.get(node_id)
        if node is None:
            raise not_found("node", node_id, field="nodeId")
        return node

    def _pool_of(self, node: Node) -> Pool | None:
        return self.catalog.current.pools.get(node.pool_id)

    def view(self, node: Node, window: Window, reservations: Callable[[str], Reservation | None] | None = None
             ) -> NodeView:
        reservations = self._reservations() if reservations is None else reservations
        now = self.clock.compute_now()
        cal = self.state.calendar.pool(node.pool_id).nodes.get(node.id)
        live = self.nodes.live.get(node.id)
        heartbeat = None
        if live is not None and live.last_seen is not None:
            age = max(0.0, self.clock.monotonic() - live.last_seen)
            heartbeat = Heartbeat(now - round(age * 1000), age)
        lost = not node.schedulable
        drained = cal is None or not any(hb.end > now for hb in cal.host)  # the calendar keeps only live bookings
        stuck = tuple(b.reservation_id for b in bookings_on(node, cal, reservations, Window(now, now + 1))
                      if b.carried_on)
        return NodeView(node, node_states.shown(node.state, lost), lost, live.agent_version if live else "",
                        heartbeat, tuple(bookings_on(node, cal, reservations, window)), drained, stuck)

    # ---- nodes ----------------------------------------------------------------------------------
    async def list_nodes(self, actor: Principal | None, window: Window, pool_id: str | None = None,
                         state: str | None = None) -> list[NodeView]:
        catalog = self.catalog.current
        if pool_id is not None and pool_id not in catalog.pools:
            raise not_found("pool", pool_id, field="poolId")
        nodes = sorted((n for n in catalog.nodes.values() if pool_id is None or n.pool_id == pool_id),
                       key=lambda n: (n.pool_id, n.id))
        allowed = await self._allowed(actor, NODES_READ, [node_resource(n, catalog.pools.get(n.pool_id)) for n in nodes])
        reservations = self._reservations()
        views = [self.view(n, window, reservations) for n, ok in zip(nodes, allowed) if ok]
        return [v for v in views if state is None or v.state == state]

    async def get_node(self, actor: Principal | None, node_id: str, window: Window) -> NodeView:
        node = self._node(node_id)
        await self._allow(actor, NODES_READ, node_resource(node, self._pool_of(node)))
        return self.view(node, window)

    async def act(self, actor: Principal | None, node_id: str, action: str, reason: str | None = None) -> ActionResult:
        """cordon, uncordon, drain or clear a node: one job, idempotent, with its event (when anything changed)."""
        node = self._node(node_id)
        await self._allow(actor, IAM_ACTION[action], node_resource(node, self._pool_of(node)))
        who = actor.id if actor is not None else "admin"
        changed, moved, pending = await self.store.call(lambda tx: self._act_job(tx, node_id, action, who, reason))
        node = self._node(node_id)
        log.info("node action", action=action, node_id=node_id, state=node.state, changed=changed, by=who, reason=reason,
                 moved=len(moved), pending=len(pending))
        if moved or pending or (changed and node.placeable):
            # Capacity to place pending work: the node takes placements again, or a moved gang freed its other nodes.
            self.reconciler.capacity_freed(node.pool_id)
        now = self.clock.compute_now()
        return ActionResult(self.view(node, Window(now, now + DEFAULT_WINDOW_MS)), changed, tuple(moved), tuple(pending))

    def _act_job(self, tx: Tx, node_id: str, action: str, who: str, reason: str | None):
        catalog = self.catalog.current
        node = catalog.nodes.get(node_id)
        if node is None:
            raise not_found("node", node_id, field="nodeId")
        after = node_states.apply(action, node.state, node.cleaning.before if node.cleaning else node_states.READY)
        if isinstance(after, node_states.Refusal):
            nxt = f"berth admin nodes {after.next} {node_id}" if after.next not in ("", "wait") else after.next or None
            raise DomainError(INVALID_STATE, f"{action} {node_id}: {after.message}",
                              {"field": "nodeId", "rule": f"{action} needs a node in "
                               f"{' or '.join(s for s in node_states.TABLE[action])}", "state": after.state,
                               "next": nxt})
        now = self.clock.compute_now()
        current = replace(node, state=after, state_reason="") if after != node.state else node
        returns_to = None
        if after == node_states.CLEANING and node.cleaning is not None:
            # a cordon or a drain while the node is cleaned is what it returns to once clean
            later = node_states.apply(action, node.cleaning.before)
            if isinstance(later, str) and later != node.cleaning.before:
                returns_to = later
                current = replace(node, cleaning=replace(node.cleaning, before=later))
        changed = current is not node
        if changed:
            tx.put_catalog("node", node_id, encode_item(current))
            # Before any move, so that placement no longer sees the node as a place for them.
            self.catalog.current = catalog.with_changes(nodes={**catalog.nodes, node_id: current})
        try:
            moved, pending = self.moves.move_off(tx, current, now, "drain") if action == node_states.DRAIN else ([], [])
        except BaseException:
            self.catalog.current = catalog  # the job rolls back: so does the node's state in memory
            raise
        if changed or moved or pending:
            data = {"nodeId": node_id, "poolId": node.pool_id, "state": after, "from": node.state, "by": who}
            if returns_to is not None:
                data["returnsTo"] = returns_to
            if reason:
                data["reason"] = reason
            if action == node_states.DRAIN:
                data["moved"] = [m.reservation_id for m in moved]
                data["pending"] = pending
            tx.event(FLEET_EVENTS, None, EVENT_OF_ACTION[action], now, data)
        return changed, moved, pending

    async def release_identity(self, actor: Principal | None, node_id: str) -> Node:
        node = self._node(node_id)
        await self._allow(actor, NODES_RELEASE_IDENTITY, node_resource(node, self._pool_of(node)))
        return await self.nodes.release_identity(node_id)

    async def events(self, actor: Principal | None, after: int | None, limit: int) -> tuple[list[dict], int | None]:
        """The fleet's events after the cursor, oldest first: those of the nodes the operator may read, read on
        past hidden ones until the page holds `limit` or EVENT_PAGES_READ pages were read; and the cursor past
        every event read (hidden ones included, so that paging always moves on)."""
        rows = self.store.events(FLEET_EVENTS, after, limit)
        if actor is None:
            return rows, rows[-1]["seq"] if rows else after
        shown: list[dict] = []
        cursor = after
        for _ in range(EVENT_PAGES_READ):
            if not rows:
                break
            catalog = self.catalog.current
            nodes = [catalog.nodes.get(str(r["data"].get("nodeId", ""))) for r in rows]
            known = [(r, n) for r, n in zip(rows, nodes) if n is not None]
            allowed = await self._allowed(actor, NODES_READ, [node_resource(n, catalog.pools.get(n.pool_id))
                                                              for _, n in known])
            readable = {r["seq"] for (r, _), ok in zip(known, allowed) if ok}
            for r in rows:
                cursor = r["seq"]
                if r["seq"] in readable:
                    shown.append(r)
                    if len(shown) == limit:
                        return shown, cursor
            if len(rows) < limit:  # the end of the events
                break
            rows = self.store.events(FLEET_EVENTS, cursor, limit)
        return shown, cursor

    # ---- pools and tenants ------------------------------------------------------------------------
    def pool_view(self, pool: Pool) -> PoolView:
        nodes = self.catalog.current.pool_nodes(pool.id)
        shown = Counter(node_states.shown(n.state, not n.schedulable) for n in nodes)
        gpus, units = pool_counts(nodes, self.state.calendar.pool(pool.id), self.clock.compute_now())
        return PoolView(pool, {s: shown.get(s, 0) for s in node_states.SHOWN}, gpus, units,
                        len(self.state.pending.get(pool.id, ())))

    async def list_pools(self, actor: Principal | None) -> list[PoolView]:
        pools = sorted(self.catalog.current.pools.values(), key=lambda p: p.id)
        allowed = await self._allowed(actor, POOLS_READ, [pool_resource(p) for p in pools])
        return [self.pool_view(p) for p, ok in zip(pools, allowed) if ok]

    async def get_pool(self, actor: Principal | None, pool_id: str) -> PoolView:
        pool = self.catalog.current.pools.get(pool_id)
        if pool is None:
            raise not_found("pool", pool_id, field="poolId")
        await self._allow(actor, POOLS_READ, pool_resource(pool))
        return self.pool_view(pool)

    def tenant_view(self, tenant: Tenant) -> TenantView:
        live = Counter(res.state for res in self.state.charged_of(tenant.id))
        return TenantView(tenant, limits_of(tenant, self.catalog.current.pools),
                          dict(self.state.ledger.usage(tenant.id)), self.billing.spent_usd(tenant.id),
                          self.billing.exposure_usd(tenant.id), dict(sorted(live.items())))

    async def list_tenants(self, actor: Principal | None) -> list[TenantView]:
        tenants = sorted(self.catalog.current.tenants.values(), key=lambda t: t.id)
        allowed = await self._allowed(actor, TENANTS_READ, [tenant_resource(t.id) for t in tenants])
        return [self.tenant_view(t) for t, ok in zip(tenants, allowed) if ok]

    async def get_tenant(self, actor: Principal | None, tenant_id: str) -> TenantView:
        tenant = self.catalog.current.tenants.get(tenant_id)
        if tenant is None:
            raise not_found("tenant", tenant_id, field="tenantId")
        await self._allow(actor, TENANTS_READ, tenant_resource(tenant_id))
        return self.tenant_view(tenant)

    # ---- the tenant's side: what it may book, and what is free --------------------------------------
    def offered_pools(self, tenant_id: str, window: Window) -> list[OfferedPool]:
        """The pools the tenant owns or is offered (not archived), with their free devices over the window. Only
        counts: no other tenant's booking is named."""
        out = []
        catalog = self.catalog.current
        for pool in sorted(catalog.pools.values(), key=lambda p: p.id):
            if not pool.visible_to(tenant_id):
                continue
            nodes = catalog.pool_nodes(pool.id)
            units, steps = free_steps(nodes, self.state.calendar.pool(pool.id), window)
            shapes = Counter(n.gpu_count for n in nodes)
            profiles = Counter(u.mig_profile for n in nodes for u in n.units if u.mig_profile)
            out.append(OfferedPool(pool, units, steps, owned=pool.owner == tenant_id,
                                   bindings=bindings_for(pool, tenant_id), per_gpu=catalog.profile(pool.id).share,
                                   node_shapes=tuple(sorted(shapes.items(), reverse=True)),
                                   profiles=tuple(sorted(profiles.items()))))
        return out
