"""The client's answer types: the API's JSON decoded into typed, frozen msgspec Structs.

Unknown extra fields are ignored, so a newer server does not break an older
client; money is Decimal, never float. docs/python-client.md lists them.
"""
from __future__ import annotations

from decimal import Decimal
from typing import Any, TypeVar

import msgspec
from msgspec import Struct, field

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class Resources(Struct, kw_only=True, frozen=True):
    vcpu: float | None = None
    memory_gib: float | None = field(default=None, name="memoryGiB")
    hugepages_1gi: int | None = field(default=None, name="hugepages1Gi")


class Placement(Struct, rename="camel", kw_only=True, frozen=True):
    node_id: str
    devices: list[str] = []


class Condition(Struct, rename="camel", kw_only=True, frozen=True):
    type: str
    status: str
    reason: str | None = None
    message: str | None = None
    last_transition_time: int | None = None


class Failure(Struct, kw_only=True, frozen=True):
    """Why an operation failed or was cancelled; `actor` is customer, provider or platform."""

    code: str
    actor: str
    message: str = ""
    next: str | None = None


class Operation(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    kind: str
    status: str  # running, succeeded, failed, cancelled
    reservation_id: str
    created_at: int
    updated_at: int
    error_message: str | None = None  # when failed or cancelled: e.g. provider_rejected:no_capacity, node_lost
    failure: Failure | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class SshLogin(Struct, rename="camel", kw_only=True, frozen=True):
    """Where a node binding's tenant logs in, and the host keys' fingerprints to check the first connection by."""

    host: str
    port: int = 22
    user: str = "root"
    host_keys: list[str] = []


class Bound(Struct, rename="camel", kw_only=True, frozen=True):
    """What one node reported bound: when, the cgroup it made, the device nodes it opened; for a node binding,
    where to log in."""

    node_id: str
    at: int | None = None
    cgroup: str | None = None
    devices: list[str] = []
    ssh: SshLogin | None = None


class Reservation(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    tenant_id: str
    principal_id: str
    pool_id: str
    state: str
    gpu_model: str
    region: str | None = None
    binding: str = "hold"
    sharing: str | None = None
    mig_profile: str | None = None
    gpu_count: int | None = None
    node_count: int = 1
    start: int | None = None
    end: int | None = None
    duration_hours: float | None = None
    spot: bool = False
    lease_seconds: int | None = None
    lease_deadline: int | None = None
    resources: Resources = Resources()
    placements: list[Placement] = []
    conditions: list[Condition] = []
    bound: list[Bound] = []
    operation: Operation | None = None
    hourly_usd: Decimal | None = None
    idempotency_key: str | None = None
    created_at: int | None = None
    updated_at: int | None = None
    ended_at: int | None = None  # when it became released or cancelled
    reason: str | None = None


class ExtendResult(Struct, rename="camel", kw_only=True, frozen=True):
    reservation: Reservation
    extended: bool
    available_until: int | None = None
    reason: str | None = None  # not extended: "already-reached" (it already ends at or after) or "no-room"


class ReservationPage(Struct, rename="camel", kw_only=True, frozen=True):
    reservations: list[Reservation]
    next_cursor: str | None = None


class Alternative(Struct, rename="camel", kw_only=True, frozen=True):
    """Another pool offered to the tenant that could hold the request, at its running price."""

    pool_id: str
    region: str | None = None
    total_running_usd_per_hour: Decimal | None = None
    earliest_start: int | None = None


class Quote(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    created_at: int
    expires_at: int
    pool_id: str
    gpu_model: str
    total_running_usd_per_hour: Decimal
    total_usd: Decimal
    currency: str = "USD"
    region: str | None = None
    gpu_count: int | None = None
    node_count: int = 1
    resources: Resources = Resources()
    window_hours: float | None = None
    earliest_start: int | None = None
    fits_now: bool = False
    preempts_spot: int = 0  # spot reservations a create sent now would preempt
    confirmation: QuoteConfirmation | None = None  # whether the create would wait for a person, and whom
    alternatives: list[Alternative] = []
    priced: dict[str, Any] = {}


class QuoteConfirmation(Struct, kw_only=True, frozen=True):
    required: bool = False
    approver: str | None = None


class OperationWait(Struct, kw_only=True, frozen=True):
    operation: Operation
    done: bool


class UsageLine(Struct, rename="camel", kw_only=True, frozen=True):
    """What one reservation billed on one UTC day, prorated to the second."""

    reservation_id: str
    pool_id: str
    day: str
    start: int = field(name="from")
    end: int = field(name="to")
    seconds: int
    hourly_usd: Decimal
    amount_usd: Decimal
    running: bool = False
    held: bool = False  # after a kubernetes release, while pods still held the devices


class ReservationTotal(Struct, rename="camel", kw_only=True, frozen=True):
    reservation_id: str
    total_usd: Decimal


class Usage(Struct, rename="camel", kw_only=True, frozen=True):
    lines: list[UsageLine]
    page_total_usd: Decimal
    total_usd: Decimal
    by_reservation: list[ReservationTotal] = []
    next_cursor: str | None = None


class Event(Struct, rename="camel", kw_only=True, frozen=True):
    seq: int
    type: str
    at: int
    reservation_id: str | None = None
    data: dict[str, Any] = {}


class EventPage(Struct, rename="camel", kw_only=True, frozen=True):
    events: list[Event]
    next_cursor: int | None = None


class Confirmation(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    status: str  # pending, approved, denied, expired
    reservation_id: str | None = None
    agent_id: str | None = None
    approver: str | None = None
    created_at: int | None = None
    expires_at: int | None = None
    message: str = ""
    asked: dict[str, Any] = {}
    decided_at: int | None = None
    interval: int | None = None


class NodeBooking(Struct, rename="camel", kw_only=True, frozen=True):
    """One reservation's hold on a node, as the admin API shows it (`current`: it covers the server's now)."""

    reservation_id: str
    tenant_id: str
    state: str
    start: int
    end: int
    binding: str = "hold"
    spot: bool = False
    carried_on: bool = False
    devices: list[str] = []
    gpus: list[int] = []
    current: bool = False


class NodeInventory(Struct, rename="camel", kw_only=True, frozen=True):
    gpus: int = 0
    gpu_indices: list[int] = []
    units: int = 0
    mig_profiles: dict[str, int] = {}
    vcpu: float = 0
    memory_gib: float = field(default=0, name="memoryGiB")
    hugepages_1gi: int = field(default=0, name="hugepages1Gi")


class NodeCondition(Struct, kw_only=True, frozen=True):
    """One of Berth's node conditions (Kubernetes style): KubernetesReleaseStuck names the released `reservations`
    whose pods still hold the node's devices."""

    type: str
    status: str
    reason: str | None = None
    message: str | None = None
    reservations: list[str] = []


class AdminNode(Struct, rename="camel", kw_only=True, frozen=True):
    """A node as the admin API shows it: `state` is what it reads as now (lost wins), `admin_state` what operators
    set, `state_reason` why, when the platform put it there; release-identity answers only the first five fields
    (the others keep their defaults here: the CLI's --json prints the answer as it came)."""

    id: str
    pool_id: str
    hostname: str
    machine_id: str = ""
    identity_released: bool = False
    state: str | None = None
    admin_state: str | None = None
    state_reason: str = ""
    lost: bool = False
    placeable: bool = True
    conditions: list[NodeCondition] = []
    declared: bool = False
    agent_version: str | None = None
    last_heartbeat: str | None = None  # ISO 8601 UTC
    heartbeat_age_seconds: float | None = None
    inventory: NodeInventory = NodeInventory()
    drained: bool = False
    bookings: list[NodeBooking] = []


class MovedReservation(Struct, rename="camel", kw_only=True, frozen=True):
    reservation_id: str
    tenant_id: str
    from_nodes: list[str] = []
    nodes: list[str] = []


class NodeAction(Struct, rename="camel", kw_only=True, frozen=True):
    """The answer to cordon, uncordon, drain and clear: the node after it, whether anything changed, and what a
    drain moved (or sent back to pending)."""

    node: AdminNode
    changed: bool
    moved: list[MovedReservation] = []
    pending: list[str] = []


class DeviceCount(Struct, kw_only=True, frozen=True):
    total: int = 0
    booked: int = 0
    free: int = 0


class AdminPool(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    owner: str
    region: str
    gpu_model: str
    sharing: str = "exclusive"
    price_per_gpu_hour_usd: Decimal | None = None
    archived: bool = False
    placer: str = "calendar"
    nodes: dict[str, int] = {}
    gpus: DeviceCount = DeviceCount()
    units: DeviceCount = DeviceCount()
    pending: int = 0


class AdminTenant(Struct, rename="camel", kw_only=True, frozen=True):
    id: str
    quota: dict[str, float] = {}
    used: dict[str, float] = {}
    budget_usd: Decimal | None = None
    spent_usd: Decimal = Decimal(0)
    committed_usd: Decimal = Decimal(0)
    reservations: dict[str, int] = {}


class FreeStep(Struct, kw_only=True, frozen=True):
    at: int
    units: int


class OfferedPool(Struct, rename="camel", kw_only=True, frozen=True):
    """A pool the tenant owns or is offered, with its free devices over the window asked (steps: `units` free from
    `at` until the next step)."""

    id: str
    region: str
    gpu_model: str
    sharing: str = "exclusive"
    owned: bool = False
    bindings: list[str] = []  # the binding kinds this tenant may ask for here
    mig_profiles: list[MigProfileCount] | None = None  # a mig pool's instances by profile
    slots_per_gpu: int | None = None  # a slots pool
    price_per_gpu_hour_usd: Decimal | None = None
    per_gpu: dict[str, float] | None = None  # what a whole GPU brings of its host: vcpu, memoryGiB, hugepages1Gi
    nodes: int = 0
    node_sizes: list[NodeSize] = []
    units: int = 0
    free_now: int = 0
    next_change: FreeStep | None = None
    free: list[FreeStep] = []
    tenant_root: TenantRoot | None = None  # node bindings: the login account, the cleaning, the turnaround


class TenantRoot(Struct, rename="camel", kw_only=True, frozen=True):
    user: str = "root"
    cleaning: str = "inband"
    turnaround_minutes: int = 30


class MigProfileCount(Struct, kw_only=True, frozen=True):
    profile: str
    units: int


class NodeSize(Struct, kw_only=True, frozen=True):
    gpus: int
    nodes: int


class Whoami(Struct, rename="camel", kw_only=True, frozen=True):
    """Who a token speaks for."""

    id: str
    tenant_id: str
    kind: str  # user or agent
    scope: str  # manage or read
    delegated_by: str | None = None


T = TypeVar("T")


def decode(doc: Any, type_: type[T]) -> T:
    """An answer's JSON (already parsed) as the typed result; BadAnswer when it does not fit."""
    from berth.client.errors import BadAnswer

    try:
        return msgspec.convert(doc, type_)
    except msgspec.ValidationError as exc:
        raise BadAnswer("BAD_ANSWER", f"the server's answer does not read as {type_.__name__}: {exc}",
                        {"answer": doc}, None) from None


