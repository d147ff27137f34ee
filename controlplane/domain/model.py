"""The control plane's plain data: tenants, principals, pools, offers, nodes, reservations, operations.

Catalog objects (tenants, pools, nodes) are frozen and replaced whole when an
operator changes them; a Reservation is mutable and changed only through the
state machine (states.py) inside one store transaction.

Units inside the domain are integral: time in epoch ms, vcpu in millicpu,
memory in MiB (see share.py). The wire converts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Mapping

from common.inventory import Inventory
from common.share import NO_SHARE, Share
from controlplane.domain.ids import operation_id

SHARING_MODES = ("exclusive", "mig", "slots")
BINDINGS = ("hold", "node", "kubernetes")
PLACERS = ("calendar", "pool-lease")
CLEANING_MODES = ("inband", "redfish")  # how a node binding's node is cleaned after its hand-back
PRINCIPAL_KINDS = ("user", "agent", "operator")  # an operator acts on the fleet (/api/admin/), not in a tenant
SCOPES = ("read", "manage")


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    # Quota limits in internal units: "gpu:<class>[:<profile>|:slot]" counts,
    # "vcpu_milli" millicpu, "memory_mib" MiB. A missing row grants 0.
    quota: Mapping[str, int] = field(default_factory=dict)
    budget_usd: Decimal | None = None
    # What the bootstrap last declared: a budget set since (the admin API) stays until the file declares another
    declared_budget_usd: Decimal | None = None


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    tenant_id: str
    kind: str = "user"
    delegated_by: str | None = None
    scope: str = "manage"  # manage: every method; read: get, list, quote and reads of operations, usage, pools


@dataclass(frozen=True, slots=True)
class Offer:
    """A pool offered to a tenant other than its owner."""

    tenant_id: str
    budget_check: bool = False
    # Limits for the excess above the per-GPU share booked in this pool, same
    # units as Tenant.quota ("vcpu_milli", "memory_mib"); a named resource is
    # charged here instead of the tenant's row.
    quota: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    tenant_root: bool = False
    # policy.tenantRoot as an object (docs/node-binding.md): the account node bindings log in to, how a node is
    # cleaned after the hand-back, how long the calendar keeps it for that (unbilled), and for redfish the one-time
    # boot source of the reset ("" none)
    root_user: str = "root"
    cleaning: str = "inband"
    turnaround_ms: int = 30 * 60_000
    boot_override: str = ""
    kubernetes: bool = False
    kubernetes_cluster: str = ""
    kubernetes_resource: str = ""  # the extended resource its nodes' kubelets see the GPUs as (berth.dev/gpu)
    per_gpu: Share | None = None
    placer: str = "calendar"
    budget_check: bool = False
    slots_per_gpu: int = 4
    ending_warning_ms: int = 30 * 60_000  # reservation.ending this long before a booking's end (0: none)


@dataclass(frozen=True, slots=True)
class Pool:
    id: str
    owner: str
    region: str
    gpu_model: str
    sharing: str = "exclusive"
    price_per_gpu_hour: Decimal = Decimal(0)
    archived: bool = False
    policy: PoolPolicy = PoolPolicy()
    offers: Mapping[str, Offer] = field(default_factory=dict)
    # Optional prices of host resources booked above the per-GPU share.
    price_per_vcpu_hour: Decimal = Decimal(0)
    price_per_gib_hour: Decimal = Decimal(0)

    def offer_for(self, tenant_id: str) -> Offer | None:
        return self.offers.get(tenant_id)

    def visible_to(self, tenant_id: str) -> bool:
        return not self.archived and (self.owner == tenant_id or tenant_id in self.offers)


@dataclass(frozen=True, slots=True)
class Unit:
    """One bookable device of a node: a whole GPU, a MIG instance or a slot of a GPU."""

    id: str
    gpu_index: int
    numa_node: int | None = None
    mig_profile: str | None = None
    uuid: str | None = None
    minor: int | None = None  # /dev/nvidiaN of its GPU, from the agent's inventory
    cap_minors: tuple[int, ...] = ()  # /dev/nvidia-caps minors of a MIG instance (gpu instance, compute instance)


@dataclass(frozen=True, slots=True)
class BmcRef:
    """Where a node's BMC is and the file its credentials are in (controlplane/bmc.py); never leaves the control
    plane."""

    redfish_url: str
    system_id: str
    credentials_file: str
    ca_file: str | None = None  # the CA bundle that signed an https BMC's certificate (None: the system's)


@dataclass(frozen=True, slots=True)
class Cleaning:
    """A node taken back from a node binding, being cleaned (node state `cleaning`) until `deadline`."""

    reservation_id: str
    mode: str  # inband: the agent reports `cleaned`; redfish: reset through the BMC, back with a new boot
    since: int
    deadline: int  # past it the node goes to maintenance
    before: str = "ready"  # the state it returns to when clean (an operator's cordon outlives the cleaning)
    boot_id: str = ""  # the boot the node was in at the hand-back (redfish: it must come back in another)
    inventory: Inventory | None = None  # recorded at the hand-over (redfish: it must come back equal)
    reset: str = ""  # redfish: the reset the BMC accepted ("" not yet)


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    pool_id: str
    hostname: str
    units: tuple[Unit, ...]
    gpu_count: int
    capacity: Share = NO_SHARE  # allocatable vcpu, memory, hugepages
    declared: bool = True  # from the bootstrap file; False once an agent owns it
    schedulable: bool = True  # False while the node is lost (its agent silent past the grace)
    machine_id: str = ""  # the registering host's /etc/machine-id: only it may take the node over once lost
    identity_released: bool = False  # an operator let the next registration take the node, from any host
    state: str = "ready"  # as operators (and cleaning) set it: ready | cordoned | draining | cleaning | maintenance
    state_reason: str = ""  # why the node is in its state, when the platform put it there (maintenance)
    bmc: BmcRef | None = None  # from the bootstrap file: for cleaning redfish
    inventory: Inventory | None = None  # the last inventory its agent sent (recorded at a node binding's hand-over)
    cleaning: Cleaning | None = None  # while the node is being cleaned after a node binding
    # (GPU uuid, the name of its units) for every GPU of the last inventory, units or not (nodes.gpu_names)
    gpu_names: tuple[tuple[str, str], ...] = ()

    @property
    def placeable(self) -> bool:
        """Whether placement may put new bookings here: heard from (not lost) and ready (domain/node_states.py)."""
        return self.schedulable and self.state == "ready"


@dataclass(slots=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str
    last_transition_time: int


@dataclass(slots=True)
class Hold:
    """A released kubernetes reservation whose devices pods may still hold (the seed's release hold): its bookings
    stay, and nothing else books those devices, until every node reports that no pod holds them."""

    since: int  # released at (billing goes on, as held time, until the hold ends within the window)
    nodes: list[str]  # the nodes that have not yet reported AllocationReleased
    holders: dict[str, list[str]] = field(default_factory=dict)  # node -> the pods (namespace/name) last reported
    until: int = 0  # the bookings' end now: the window's end, then each 5-minute carry-on step
    carried_from: int | None = None  # the window's end, once the bookings are carried on past it (unbilled)


@dataclass(slots=True)
class Placement:
    """The units a reservation holds on one node."""

    node_id: str
    units: list[str]


@dataclass(slots=True)
class Bound:
    """What a node's agent reported bound for a reservation."""

    node_id: str
    at: int
    cgroup: str | None = None
    devices: list[str] = field(default_factory=list)
    end: int | None = None  # the window's end as the node applied it
    oom_kills: int = 0  # processes the node's OOM killer ended in the reservation's cgroup, as last reported
    ssh: SshEndpoint | None = None  # node binding: how the tenant connects
    inventory: Inventory | None = None  # node binding: the node's inventory at the hand-over, to clean back to
    failed: str | None = None  # the node's report since it bound was `failed` (its message), until it binds again


@dataclass(frozen=True, slots=True)
class SshEndpoint:
    """How a node binding's tenant reaches its node, as the agent reported it."""

    host: str
    port: int
    user: str
    host_keys: tuple[str, ...] = ()  # SHA256 fingerprints


@dataclass(slots=True)
class Failure:
    code: str
    actor: str  # customer | provider | platform
    message: str
    next: str


@dataclass(slots=True)
class Operation:
    id: str
    kind: str  # create | release | cancel | extend (a gang's are answered as a cluster's: schemas.operation_kind)
    reservation_id: str
    tenant_id: str
    status: str  # running | succeeded | failed | cancelled
    created_at: int
    updated_at: int
    failure: Failure | None = None


@dataclass(slots=True)
class Confirmation:
    """A delegating user's approval asked for an agent's refused create (after OpenID CIBA)."""

    id: str
    tenant_id: str
    reservation_id: str
    agent_id: str
    user_id: str
    status: str  # pending | approved | denied | expired
    created_at: int
    expires_at: int
    message: str
    asked: dict
    decided_at: int | None = None


@dataclass(slots=True)
class PendingChange:
    """An extension being decided: the end asked for, and since when (a stale one is abandoned)."""

    until: int
    since: int


@dataclass(slots=True)
class Reservation:
    id: str
    tenant_id: str
    principal_id: str
    idempotency_key: str
    fingerprint: str
    pool_id: str
    region: str
    state: str
    binding: str
    gpu_model: str
    sharing: str
    gpu_count: int
    node_count: int
    created_at: int
    updated_at: int
    mig_profile: str | None = None
    start: int | None = None  # the window; for an as-soon-as-possible request, set when placed
    end: int | None = None
    duration_ms: int | None = None  # set for as-soon-as-possible requests
    spot: bool = False
    lease_seconds: int | None = None
    lease_deadline: int | None = None
    resources: Share = NO_SHARE  # booked per node
    charge: dict[str, int] = field(default_factory=dict)  # quota held while not terminal
    placements: list[Placement] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    decision: str | None = None  # None (undecided draft) | allow | deny
    operation_id: str | None = None  # the current operation (the latest mutation's)
    operations: list[Operation] = field(default_factory=list)  # oldest first; the create's is the first
    reason: str | None = None
    ended_at: int | None = None  # when it became released or cancelled (`end` stays the window it was booked for)
    pending_change: PendingChange | None = None  # the reservation's authz row while an extend is decided
    extensions: int = 0
    confirmation_id: str | None = None
    hourly_usd: Decimal = Decimal(0)  # the price fixed at creation, for every hour billed
    bound: list[Bound] = field(default_factory=list)  # per node, once its agent reported the devices bound
    billing_start: int | None = None  # confirmed readiness (active)
    billing_end: int | None = None  # confirmed release
    hold: Hold | None = None  # a kubernetes release waiting for the pods to let go of the devices
    held_from: int | None = None  # when billing became held time (usage shows it apart); kept after the hold
    ending_warning_ms: int = 0  # the pool's endingWarningMinutes when it was created
    ending_warned: int | None = None  # the end that reservation.ending was emitted for (an extension re-arms it)
    # node bindings: the tenant's keys (canonical lines), and the pool's tenantRoot as it was at creation
    ssh_keys: list[str] = field(default_factory=list)
    login_user: str = ""
    cleaning: str = ""
    turnaround_ms: int = 0  # the calendar keeps each node this long past the window (or a release), unbilled
    seq: int = 0  # creation order in the store; list pages on it

    @property
    def asap(self) -> bool:
        return self.duration_ms is not None

    def operation(self, op_id: str | None = None) -> Operation | None:
        """The operation with this id (default: the current one)."""
        op_id = op_id or self.operation_id
        return next((op for op in self.operations if op.id == op_id), None)

    def create_operation(self) -> Operation | None:
        return self.operations[0] if self.operations and self.operations[0].kind == "create" else None

    def add_operation(self, kind: str, status: str, now: int) -> Operation:
        """A new operation of this reservation, now its current one."""
        op = Operation(operation_id(self.id, len(self.operations)), kind, self.id, self.tenant_id, status, now, now)
        self.operations.append(op)
        self.operation_id = op.id
        return op

    def set_condition(self, type_: str, status: str, reason: str, message: str, now: int) -> None:
        for cond in self.conditions:
            if cond.type == type_:
                if (cond.status, cond.reason, cond.message) != (status, reason, message):
                    if cond.status != status:
                        cond.last_transition_time = now
                    cond.status, cond.reason, cond.message = status, reason, message
                return
        self.conditions.append(Condition(type_, status, reason, message, now))

    def clear_condition(self, type_: str) -> None:
        self.conditions = [c for c in self.conditions if c.type != type_]
