"""The node API's documents (docs/node-api.md): one msgspec definition each, used by the control plane and the agent.

Requests (what an agent sends) are strict: an unknown field, a wrong type or
a value out of bounds is refused, naming the field. Answers (what the control
plane sends) are read leniently about fields this side does not know, so a
newer control plane may add some, and strictly about the types of those it
reads. camelCase as on the wire. The inventory an agent registers and
heartbeats with is common.inventory.Inventory.
"""
from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from common.inventory import Hostname, Inventory

Id = Annotated[str, Meta(min_length=1, max_length=128)]
Message = Annotated[str, Meta(max_length=2000)]
Path = Annotated[str, Meta(max_length=4096)]
ResourceVersion = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
REPORT_MAX = 1000  # reports in one call
# The agent's host (/etc/machine-id) on every call with a node token: the control plane refuses the token from a host
# other than the one it was issued to (a state directory copied to another host, a cloned image).
MACHINE_ID_HEADER = "Berth-Machine-Id"
BINDING_KINDS = ("hold", "node", "kubernetes")
ReportStatus = Literal["bound", "unbound", "failed", "held", "cleaned", "waiting"]
REPORT_STATUSES: tuple[str, ...] = get_args(ReportStatus)  # what a heartbeat answer says this release takes
Pod = Annotated[str, Meta(min_length=3, max_length=507, pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$")]  # namespace/name


class Request(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A body an agent sends: decoded strictly by the control plane."""


class Answer(Struct, frozen=True):
    """A body the control plane sends: unknown fields are ignored by the agent, known ones type-checked."""


# -- register ---------------------------------------------------------------------------


# /etc/machine-id: 32 lowercase hex digits (machine-id(5)); "" from an agent that could not read one.
MachineId = Annotated[str, Meta(pattern="^([0-9a-f]{32})?$")]
AgentVersion = Annotated[str, Meta(max_length=64)]


class RegisterRequest(Request):
    hostname: Hostname
    inventory: Inventory
    agentVersion: AgentVersion = ""
    machineId: MachineId = ""


class RegisterAnswer(Answer):
    nodeId: str
    nodeToken: str
    poolId: str = ""
    heartbeatSeconds: float = 5.0
    graceSeconds: float = 30.0
    resourceVersion: ResourceVersion = 0


# -- heartbeat ------------------------------------------------------------------------------


class HeartbeatRequest(Request):
    """Alive; the inventory rides along only when it changed since the last one the control plane took, the
    agent's version only when it differs from the one the last answer named (an agent restarted or upgraded in place
    keeps its node token and does not register again; an older control plane, which names none, refuses it)."""

    inventory: Inventory | None = None
    agentVersion: AgentVersion = ""


class HeartbeatAnswer(Answer):
    """`reportStatuses`: the report statuses this control plane takes (a newer agent sends no other: an older
    control plane refuses a whole report call for one status it does not know)."""

    resourceVersion: ResourceVersion = 0
    graceSeconds: float | None = None
    reportStatuses: tuple[str, ...] = ()
    agentVersion: str | None = None  # the agent's version on record here (None: this control plane takes none)
    # The node's state as the control plane has it (ready, cordoned, draining, cleaning, maintenance): an
    # operator's clear after a cleaning that failed reaches the agent so ("" from a control plane that does not say)
    nodeState: str = ""


# -- watch -------------------------------------------------------------------------------------


class WatchRequest(Request):
    resourceVersion: ResourceVersion | None = None
    timeoutMs: Annotated[int, Meta(ge=0, le=30_000)] = 25_000


class BindingUnit(Answer):
    """One bookable device of the binding: a whole GPU, a MIG instance or a slot of a GPU."""

    unit: str
    gpuIndex: int
    uuid: str | None = None
    migProfile: str | None = None


class BindingShare(Answer):
    """The host resources booked on this node: millicpu, MiB of memory, 1 GiB hugepages."""

    vcpuMilli: int = 0
    memoryMiB: int = 0
    hugepages1Gi: int = 0


class Binding(Answer):
    """A reservation the control plane wants made on this node now (the whole set comes with each watch answer)."""

    reservationId: str
    kind: str
    tenantId: str
    principalId: str
    start: int
    end: int
    units: tuple[BindingUnit, ...] = ()
    share: BindingShare = BindingShare()
    numaNodes: tuple[int, ...] = ()
    resourceName: str = ""  # kubernetes: the extended resource the kubelet sees the units as
    released: bool = False  # kubernetes: released, devices withdrawn; report the pods holding them until none do
    stuck: bool = False  # kubernetes: carried on past its window because pods still hold the devices (taint the node)
    endingAt: int = 0  # when reservation.ending is due for this end (epoch ms); 0: the pool gives no warning
    ending: bool = False  # the control plane emitted reservation.ending for this end (an extension turns it off)
    # The control plane has not heard this node report the binding bound at this end (lost with an agent killed
    # before its report went out, or by a database restored to a copy from before it): a node holding it reports
    # `bound` again. False from a control plane that does not say.
    awaitingBound: bool = False
    # node bindings (tenant root, docs/node-binding.md): the tenant's OpenSSH public keys, the account they log in
    # to (the pool's policy.tenantRoot.user), and how the node is cleaned after the hand-back
    sshKeys: tuple[str, ...] = ()
    user: str = ""
    cleaning: str = ""  # inband | redfish


class WatchAnswer(Answer):
    resourceVersion: ResourceVersion  # bounded as the watch request takes it back: a bad one is a bad answer
    # required: an answer without it (a proxy's, a broken replica's) is no answer, never "nothing is wanted"
    bindings: tuple[Binding, ...]
    changed: bool = True
    nodeState: str = ""  # as on a heartbeat's answer, as it stands with these bindings ("": not said)


# -- report -------------------------------------------------------------------------------------


class SshAccess(Request):
    """How the tenant reaches a node binding's host: the endpoint, the account, and the host keys' SHA256
    fingerprints (read from the host) to check the first connection against."""

    host: Annotated[str, Meta(min_length=1, max_length=253)]
    port: Annotated[int, Meta(ge=1, le=65535)]
    user: Annotated[str, Meta(min_length=1, max_length=32)]
    hostKeys: Annotated[tuple[Annotated[str, Meta(max_length=100)], ...], Meta(max_length=16)] = ()


class CleanCheck(Request):
    """A node binding's in-band clean after its hand-back: ok when the node is as it was at the hand-over (the
    inventory recorded then equals the one discovered after cleaning); else each difference, said plainly."""

    ok: bool
    differences: Annotated[tuple[Message, ...], Meta(max_length=64)] = ()


class Report(Request):
    """What the agent made of one binding. `unenforced` names each part of the share this host could not enforce
    (the binding is still bound); `end` is the binding's end as the agent applied it (an extension is done when
    every bound node reports the new end); `oomKills` counts the processes the OOM killer ended in the binding's
    cgroup since it was made (a bound report is sent again when it grows); `message` says why a binding failed.
    For a released kubernetes binding, `held` names the pods (`holders`) that still hold its devices, and
    `unbound` is AllocationReleased: no pod holds them any more. `evicted` on a bound report names the pods the
    agent evicted because they held devices of an earlier, ended binding. A node binding's `bound` carries `ssh`;
    after its hand-back (`unbound`: keys removed, sessions ended) and an in-band clean, `cleaned` carries the
    check. `waiting`: a binding that has started here but cannot be made yet, because pods of an ended kubernetes
    binding still hold its devices (`holders`), with why they stay (`message`); sent only to a control plane whose
    heartbeat answer lists it."""

    reservationId: Id
    status: ReportStatus
    end: Annotated[int, Meta(ge=0, le=32503680000000)] | None = None
    cgroup: Path | None = None
    devices: Annotated[tuple[Path, ...], Meta(max_length=256)] = ()
    unenforced: Annotated[tuple[Message, ...], Meta(max_length=32)] = ()
    oomKills: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)] = 0
    holders: Annotated[tuple[Pod, ...], Meta(max_length=256)] = ()  # held, waiting: the pods holding the devices
    evicted: Annotated[tuple[Pod, ...], Meta(max_length=256)] = ()  # bound: pods evicted to free its devices
    ssh: SshAccess | None = None  # bound, node binding: how the tenant connects
    clean: CleanCheck | None = None  # cleaned, node binding (cleaning inband): the check after the hand-back
    message: Message | None = None


class ReportRequest(Request):
    reports: Annotated[tuple[Report, ...], Meta(max_length=REPORT_MAX)]


class Ignored(Answer):
    reservationId: str = ""
    reason: str = ""


class ReportAnswer(Answer):
    accepted: tuple[str, ...] = ()
    ignored: tuple[Ignored, ...] = ()


# -- errors ---------------------------------------------------------------------------------------


class ErrorBody(Answer):
    code: str = "UNKNOWN"
    message: str = ""
    details: dict = {}


class ErrorEnvelope(Answer):
    error: ErrorBody = ErrorBody()


_encoder = msgspec.json.Encoder()


def encode(doc: Struct) -> bytes:
    return _encoder.encode(doc)

