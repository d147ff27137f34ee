"""Admission of a create: the request checked against its pool, turned into what will be booked and charged.

Everything that can be decided before the draft exists lives here: the
pool's visibility (NOT_FOUND), the binding (UNSUPPORTED, INVALID_INPUT),
device class, sharing and MIG profile, the window, the host resources per
node (the per-GPU share is also the floor), the quota charge, the IAM
attributes of the draft, and whether the pool could ever hold the request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Sequence

from controlplane.domain.clock import HOUR_MS, MINUTE_MS
from controlplane.domain.errors import NO_CAPACITY, UNSUPPORTED, DomainError, invalid, not_found
from controlplane.domain.model import BINDINGS, Node, Offer, Pool, Reservation, Tenant
from controlplane.domain.placement import Ask, could_ever_fit, eligible_units
from controlplane.domain.pricing import hourly
from controlplane.domain.quota import charge_for, unit_key
from common.share import NO_SHARE, Share, host_share_per_gpu, pool_share_per_gpu

START_SKEW_MS = 5 * MINUTE_MS  # a start this far in the past is taken as "now" (clock skew)
MIN_WINDOW_MS = 1000
MAX_WINDOW_MS = 366 * 24 * HOUR_MS
MAX_LEAD_MS = 366 * 24 * HOUR_MS


@dataclass(frozen=True, slots=True)
class ResourcesAsk:
    vcpu_milli: int | None = None
    memory_mib: int | None = None
    hugepages_1g: int | None = None

    def as_share(self) -> Share:
        return Share(self.vcpu_milli or 0, self.memory_mib or 0, self.hugepages_1g or 0)


@dataclass(frozen=True, slots=True)
class CreateRequest:
    pool_id: str
    gpu_model: str
    gpu_count: int | None = None
    node_count: int = 1
    sharing: str | None = None
    mig_profile: str | None = None
    start: int | None = None
    end: int | None = None
    duration_ms: int | None = None
    binding: str = "hold"
    resources: ResourcesAsk | None = None
    spot: bool = False
    lease_seconds: int | None = None
    ssh_keys: tuple[str, ...] | None = None  # access.sshKeys, checked and canonical (schemas.py); node bindings


@dataclass(frozen=True, slots=True)
class Plan:
    """A create that passed admission: what to book, charge and ask IAM about."""

    pool: Pool
    offer: Offer | None
    binding: str
    gpu_count: int
    node_count: int
    mig_profile: str | None
    start: int | None  # None: as soon as possible for duration_ms
    end: int | None
    duration_ms: int | None
    spot: bool
    lease_seconds: int | None
    resources: Share  # booked per node (for a node binding: each node's whole capacity)
    charge: dict[str, int]
    whole_node: bool
    excess: Share = NO_SHARE  # booked per node above the per-GPU share
    hourly_usd: Decimal = Decimal(0)
    floor: Share = NO_SHARE  # per node, what the GPUs' per-GPU share brings (booked, not charged)
    ssh_keys: tuple[str, ...] = ()  # node bindings: the tenant's keys
    turnaround_ms: int = 0  # node bindings: the calendar keeps each node this long past the window (cleaning)

    @property
    def included(self) -> dict[str, int]:
        """Of each charged host resource, what the whole request books within the per-GPU share."""
        f = self.floor
        return {"vcpu_milli": f.vcpu_milli * self.node_count,
                "memory_mib": (f.memory_mib + f.hugepages_1g * 1024) * self.node_count}

    def ask(self, start: int, end: int) -> Ask:
        """What placement must find for the window [start, end) (and a node binding's turnaround after it)."""
        return Ask(
            gpu_count=self.gpu_count,
            node_count=self.node_count,
            share=self.resources,
            start=start,
            end=end + self.turnaround_ms,
            sharing=self.pool.sharing,
            mig_profile=self.mig_profile,
            whole_node=self.whole_node,
        )

    def window_for(self, now: int) -> tuple[int, int]:
        if self.start is None:
            return now, now + (self.duration_ms or 0)
        return self.start, self.end  # type: ignore[return-value]


def pool_share(pool: Pool, nodes: Sequence[Node]) -> Share:
    """The pool's per-GPU share for whole-GPU requests (share.py holds the one definition)."""
    if pool.sharing != "exclusive":
        return NO_SHARE
    hosts = [host_share_per_gpu(n.capacity.vcpu_milli, n.capacity.memory_mib, n.gpu_count) for n in nodes]
    return pool_share_per_gpu(hosts, pool.policy.per_gpu)


@dataclass(frozen=True, slots=True)
class PoolProfile:
    """What admission needs to know of a pool's nodes, computed once per catalog, not per request."""

    share: Share
    mig_profiles: tuple[str, ...]
    node_gpu_counts: frozenset[int]
    # Nodes by how much they could ever hold, largest first, so that "could the
    # pool ever hold this" stops as soon as node_count nodes qualify.
    nodes_by_size: tuple[Node, ...]
    # "Could the pool ever hold this shape": (nodes that could, most units of one node), per shape; the nodes
    # do not change under a profile (a catalog change makes a new one), so each shape is answered once.
    holds: dict = field(default_factory=dict, compare=False)


def profile_of(pool: Pool, nodes: Sequence[Node]) -> PoolProfile:
    return PoolProfile(
        share=pool_share(pool, nodes),
        mig_profiles=tuple(sorted({u.mig_profile for n in nodes for u in n.units if u.mig_profile})),
        node_gpu_counts=frozenset(n.gpu_count for n in nodes),
        nodes_by_size=tuple(sorted(nodes, key=lambda n: (len(n.units), n.capacity.vcpu_milli, n.capacity.memory_mib), reverse=True)),
    )


def _window(req: CreateRequest, now: int) -> tuple[int | None, int | None, int | None]:
    if req.end is not None and req.duration_ms is not None:
        raise invalid("end", "give end or durationHours, not both")
    if req.end is None and req.duration_ms is None:
        raise invalid("durationHours", "give end or durationHours")
    if req.duration_ms is not None and req.duration_ms < MIN_WINDOW_MS:
        raise invalid("durationHours", "must be at least one second")
    if req.start is None and req.end is None:
        if req.duration_ms > MAX_WINDOW_MS:  # type: ignore[operator]
            raise invalid("durationHours", "must be at most 366 days")
        return None, None, req.duration_ms
    start = now if req.start is None else req.start
    if start < now - START_SKEW_MS:
        raise invalid("start", "must not be in the past", now=now)
    if start > now + MAX_LEAD_MS:
        raise invalid("start", "must be within 366 days from now", now=now)
    start = max(start, now)
    end = req.end if req.end is not None else start + req.duration_ms  # type: ignore[operator]
    if end <= start:
        raise invalid("end", "must be after start")
    if end - start < MIN_WINDOW_MS:
        raise invalid("end", "the window must be at least one second")
    if end - start > MAX_WINDOW_MS:
        raise invalid("end", "the window must be at most 366 days")
    return start, end, None


def admit(req: CreateRequest, tenant: Tenant, pool: Pool | None, profile: PoolProfile, now: int) -> Plan:
    """Check a create against its pool (and the profile of its nodes); the Plan, or the documented refusal."""
    if pool is None or not pool.visible_to(tenant.id):
        raise not_found("pool", req.pool_id, field="poolId")
    if req.binding not in BINDINGS:
        raise DomainError(
            UNSUPPORTED,
            f"binding: {req.binding!r} is not supported; use one of {', '.join(BINDINGS)}",
            {"field": "binding", "supported": list(BINDINGS)},
        )
    if req.gpu_model != pool.gpu_model:
        raise invalid("gpuModel", f"pool {pool.id} holds {pool.gpu_model}", expected=pool.gpu_model)
    if req.sharing is not None and req.sharing != pool.sharing:
        raise invalid("sharing", f"pool {pool.id} shares its GPUs as {pool.sharing!r}", expected=pool.sharing)
    if pool.sharing == "mig":
        if not req.mig_profile:
            raise invalid("migProfile", f"required: pool {pool.id} books MIG instances")
        profiles = list(profile.mig_profiles)
        if profiles and req.mig_profile not in profiles:
            raise invalid("migProfile", f"pool {pool.id} offers {', '.join(profiles)}", offered=profiles)
    elif req.mig_profile is not None:
        raise invalid("migProfile", f"pool {pool.id} does not share its GPUs as MIG instances")
    whole_node = req.binding == "node"
    if whole_node:
        if not pool.policy.tenant_root:
            raise invalid("binding", f"'node' needs a pool with policy.tenantRoot; pool {pool.id} has none")
        if req.resources is not None:
            raise invalid("resources", "a node binding books whole nodes: cgroup limits mean nothing to root")
        if pool.sharing != "exclusive":
            raise invalid("binding", "'node' books whole GPUs; this pool shares them")
        if req.ssh_keys is None:
            raise invalid("access.sshKeys", "required for binding 'node': 1 to 16 OpenSSH public keys (e.g. the "
                          f"line of ~/.ssh/id_ed25519.pub) the tenant logs in to {pool.policy.root_user} with")
    elif req.ssh_keys is not None:
        raise invalid("access", f"only binding 'node' takes access (SSH keys for tenant root); binding "
                      f"{req.binding!r} gives devices, not a login: leave access out")
    if req.binding == "kubernetes":
        if not pool.policy.kubernetes:
            raise invalid("binding", f"'kubernetes' needs a pool with policy.kubernetes; pool {pool.id} has none")
        if tenant.id != pool.owner:
            raise invalid("binding", "only the pool's owner books into its Kubernetes cluster: the kubelet gives bound GPUs to any pod")
    if req.lease_seconds is not None and not 30 <= req.lease_seconds <= 7 * 24 * 3600:
        raise invalid("leaseSeconds", "must be between 30 and 604800")

    gpu_count = req.gpu_count
    if whole_node:
        sizes = set(profile.node_gpu_counts)
        if not sizes:  # no node to size it by: as a hold would be told, the pool cannot hold it
            raise DomainError(NO_CAPACITY, f"pool {pool.id} can never hold a node binding: none of its 0 nodes has "
                              f"{pool.gpu_model} to give", {"reason": "no_stock", "poolId": pool.id, "nodesThatFit": 0,
                                                            "maxGpuCountPerNode": 0, "nodesWithMaxGpuCount": 0})
        if gpu_count is None:
            if len(sizes) != 1:
                raise invalid("gpuCount", "required for a node binding in a pool whose nodes differ in GPU count")
            gpu_count = sizes.pop()
        elif gpu_count not in sizes:
            raise invalid("gpuCount", f"a node binding books every GPU of a node; nodes of pool {pool.id} have "
                          + " or ".join(str(s) for s in sorted(sizes)), sizes=sorted(sizes))
    elif gpu_count is None:
        raise invalid("gpuCount", "required")

    start, end, duration_ms = _window(req, now)

    # Host resources per node: the per-GPU share is the floor; the excess is charged. A node binding books whole
    # hosts: it is seen (by IAM and quota) as the largest host of its size in the pool, since which one it gets
    # is known only at placement; its 1 GiB hugepages count as memory, as in any booking.
    floor = profile.share.scaled(gpu_count)
    if whole_node:
        resources = whole_host(profile.nodes_by_size, gpu_count)
    else:
        asked = req.resources.as_share() if req.resources is not None else NO_SHARE
        resources = asked.max_with(floor)
    excess = resources.minus(floor)
    offer = pool.offer_for(tenant.id) if tenant.id != pool.owner else None
    charge = charge_for(pool, offer, unit_key(pool.gpu_model, pool.sharing, req.mig_profile), gpu_count * req.node_count, excess, req.node_count)

    plan = Plan(
        pool=pool, offer=offer, binding=req.binding, gpu_count=gpu_count, node_count=req.node_count,
        mig_profile=req.mig_profile, start=start, end=end, duration_ms=duration_ms, spot=req.spot,
        lease_seconds=req.lease_seconds, resources=resources, charge=charge, whole_node=whole_node,
        excess=excess, hourly_usd=hourly(pool, gpu_count, req.node_count, excess),
        floor=resources.minus(excess),
        ssh_keys=req.ssh_keys or (), turnaround_ms=pool.policy.turnaround_ms if whole_node else 0,
    )
    _check_pool_can_hold(plan, profile)
    return plan


def whole_host(nodes: Sequence[Node], gpu_count: int) -> Share:
    """The most any node with gpu_count GPUs has (per resource): what a node binding of that size may book."""
    out = NO_SHARE
    for n in nodes:
        if n.gpu_count == gpu_count:
            out = out.max_with(n.capacity)
    return out


def _check_pool_can_hold(plan: Plan, profile: PoolProfile) -> None:
    key = (plan.gpu_count, plan.node_count, plan.mig_profile, plan.whole_node, plan.resources)
    found = profile.holds.get(key)
    if found is None:
        found = profile.holds[key] = _could_hold(plan, profile.nodes_by_size)
    holding, most, with_most = found
    if holding >= plan.node_count:
        return
    nodes = profile.nodes_by_size
    what = plan.pool.gpu_model + (f" {plan.mig_profile}" if plan.mig_profile else "")
    if plan.gpu_count > most:
        why = (f"its largest node has {most} {what} (the most one node can give): at most {with_most} x {most}"
               if most else f"none of its {len(nodes)} nodes has {what} to give")
    else:
        why = (f"{holding} of its {len(nodes)} nodes could hold {plan.gpu_count} with this share: at most "
               f"{holding} x {plan.gpu_count}" if holding else
               f"none of its {len(nodes)} nodes has the vCPU, memory or hugepages asked beside {plan.gpu_count} GPU(s)")
    raise DomainError(
        NO_CAPACITY,
        f"pool {plan.pool.id} can never hold {plan.node_count} x {plan.gpu_count} {what}: {why}",
        {
            "reason": "no_stock",
            "poolId": plan.pool.id,
            "nodesThatFit": holding,
            "maxGpuCountPerNode": most,
            "nodesWithMaxGpuCount": with_most,
        },
    )


def _could_hold(plan: Plan, nodes: Sequence[Node]) -> tuple[int, int, int]:
    """(how many nodes could ever hold one node's part of the plan, up to node_count; the most units one node has
    for it; how many nodes have that many)."""
    s, e = plan.window_for(0)
    ask = plan.ask(s, e)
    holding = 0
    for n in nodes:
        if could_ever_fit(n, ask):
            holding += 1
            if holding >= plan.node_count:
                return holding, 0, 0
    counts = [len(eligible_units(n, ask)) for n in nodes]
    most = max(counts, default=0)
    return holding, most, counts.count(most) if most else 0


def _attributes(tenant_id: str, pool_id: str, region: str, gpu_model: str, gpu_count: int, node_count: int,
                duration_ms: int, per_node: Share, binding: str, spot: bool) -> dict[str, Any]:
    return {
        "tenant": tenant_id,
        "poolId": pool_id,
        "region": region,
        "gpuModel": gpu_model,
        "gpuCount": gpu_count * node_count,
        "nodeCount": node_count,
        "durationHours": math.ceil(duration_ms / HOUR_MS),
        "vcpu": math.ceil(per_node.vcpu_milli * node_count / 1000),
        "memoryGiB": math.ceil((per_node.memory_mib + per_node.hugepages_1g * 1024) * node_count / 1024),
        "binding": binding,
        "spot": spot,
    }


def iam_attributes(plan: Plan, tenant_id: str) -> dict[str, Any]:
    """The draft's attributes as IAM sees them: totals over a gang, hours, vcpu and GiB rounded up."""
    duration = plan.duration_ms if plan.start is None else (plan.end or 0) - plan.start
    pool = plan.pool
    return _attributes(tenant_id, pool.id, pool.region, pool.gpu_model, plan.gpu_count, plan.node_count, duration or 0,
                       plan.resources, plan.binding, plan.spot)


def reservation_attributes(res: Reservation, duration_ms: int | None = None) -> dict[str, Any]:
    """A stored reservation's attributes; duration_ms overrides its length (an extension being decided)."""
    if duration_ms is None:
        duration_ms = res.duration_ms if res.start is None or res.end is None else res.end - res.start
    return _attributes(res.tenant_id, res.pool_id, res.region, res.gpu_model, res.gpu_count, res.node_count, duration_ms or 0,
                       res.resources, res.binding, res.spot)
