"""Quota: what a reservation is charged, the limits it is checked against, and the ledger of held charges.

Quota is held, not metered: a reservation's charge counts from admission
until it is terminal, whatever its window. Keys and units:

- `gpu:<class>` whole GPUs, `gpu:<class>:<profile>` MIG instances,
  `gpu:<class>:slot` GPU slots (counts, totals over a gang);
- `vcpu_milli` and `memory_mib` for host resources booked above the per-GPU
  share (1 GiB hugepages count as memory);
- `offer:<pool>:vcpu_milli` / `offer:<pool>:memory_mib` where the tenant's
  offer of that pool names the resource: the offer's limit applies instead
  of the tenant's row.

A missing limit grants 0.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

from controlplane.domain.errors import QUOTA_EXCEEDED, DomainError
from controlplane.domain.model import Offer, Pool, Tenant
from common.share import Share

WIRE_NAMES = {"vcpu_milli": ("vcpu", 1000), "memory_mib": ("memoryGiB", 1024)}


def unit_key(gpu_model: str, sharing: str, mig_profile: str | None) -> str:
    if sharing == "mig":
        return f"gpu:{gpu_model}:{mig_profile}"
    if sharing == "slots":
        return f"gpu:{gpu_model}:slot"
    return f"gpu:{gpu_model}"


def charge_for(pool: Pool, offer: Offer | None, unit: str, units_total: int, excess_per_node: Share, node_count: int) -> dict[str, int]:
    charge = {unit: units_total}
    vcpu = excess_per_node.vcpu_milli * node_count
    memory = (excess_per_node.memory_mib + excess_per_node.hugepages_1g * 1024) * node_count
    for resource, amount in (("vcpu_milli", vcpu), ("memory_mib", memory)):
        if amount:
            key = f"offer:{pool.id}:{resource}" if offer is not None and resource in offer.quota else resource
            charge[key] = charge.get(key, 0) + amount
    return charge


def limit_of(tenant: Tenant, pools: Mapping[str, Pool], key: str) -> int:
    if key.startswith("offer:"):
        _, pool_id, resource = key.split(":", 2)
        pool = pools.get(pool_id)
        offer = pool.offer_for(tenant.id) if pool else None
        return offer.quota.get(resource, 0) if offer else 0
    return tenant.quota.get(key, 0)


def limits_of(tenant: Tenant, pools: Mapping[str, Pool]) -> dict[str, int]:
    """Every limit the tenant's charges are checked against: its own rows, and each offer's to it (what
    limit_of reads, all at once); a key not here has the limit 0."""
    limits = dict(tenant.quota)
    for pool in pools.values():
        offer = pool.offer_for(tenant.id)
        for resource, amount in (offer.quota.items() if offer is not None else ()):
            limits[f"offer:{pool.id}:{resource}"] = amount
    return limits


def wire_amount(key: str, amount: int) -> float | int:
    """A quota amount in the wire's units (vcpu, GiB, counts)."""
    resource = key.rsplit(":", 1)[-1]
    if resource in WIRE_NAMES:
        return amount / WIRE_NAMES[resource][1]
    return amount


def wire_key(key: str) -> str:
    for internal, (wire, _) in WIRE_NAMES.items():
        if key.endswith(internal):
            return key[: -len(internal)] + wire
    return key


class QuotaLedger:
    """The charges held by each tenant's live reservations."""

    def __init__(self) -> None:
        self.used: dict[str, Counter] = {}

    def usage(self, tenant_id: str) -> Counter:
        used = self.used.get(tenant_id)
        if used is None:  # (not setdefault: that would build a Counter at every call, twice per create)
            used = self.used[tenant_id] = Counter()
        return used

    def check(self, tenant: Tenant, pools: Mapping[str, Pool], charge: Mapping[str, int],
              included: Mapping[str, int] | None = None) -> None:
        """QUOTA_EXCEEDED naming the first resource the charge does not fit. `included`: of each host resource
        (vcpu_milli, memory_mib), what the request books within the GPUs' per-GPU share (not charged), so the
        message states what was booked and which part counts."""
        used = self.usage(tenant.id)
        for key, amount in charge.items():
            limit = limit_of(tenant, pools, key)
            if used[key] + amount > limit:
                left = f"{wire_amount(key, max(0, limit - used[key]))} of {wire_amount(key, limit)} left"
                within = (included or {}).get(key.rsplit(":", 1)[-1], 0)
                if within:
                    what = (f"{wire_amount(key, within + amount)} booked, of which {wire_amount(key, within)} come "
                            f"with the GPUs' per-GPU share and {wire_amount(key, amount)} above it count against "
                            "quota")
                else:
                    what = f"{wire_amount(key, amount)} asked"
                raise DomainError(
                    QUOTA_EXCEEDED,
                    f"{wire_key(key)}: {what}; {left}",
                    {
                        "resource": wire_key(key),
                        "limit": wire_amount(key, limit),
                        "used": wire_amount(key, used[key]),
                        "requested": wire_amount(key, amount),
                        "withinShare": wire_amount(key, within),
                    },
                )

    def hold(self, tenant_id: str, charge: Mapping[str, int]) -> None:
        self.usage(tenant_id).update(charge)

    def refund(self, tenant_id: str, charge: Mapping[str, int]) -> None:
        used = self.usage(tenant_id)
        used.subtract(charge)
        for key in [k for k, v in used.items() if v == 0]:
            del used[key]
