"""The node API's documents (docs/node-api.md), one msgspec definition each, camelCase as on the wire.

Answers from the control plane are decoded leniently about fields this agent
does not know (a newer control plane may add some) but strictly about the
types of those it reads. Requests are built from these same Structs.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct


class _In(Struct, frozen=True):
    """An answer: unknown fields are ignored, known ones are type-checked."""


class _Out(Struct, frozen=True, omit_defaults=True):
    """A request body."""


# -- register -------------------------------------------------------------------


class RegisterRequest(_Out):
    hostname: str
    inventory: dict[str, Any]
    agentVersion: str


class RegisterAnswer(_In):
    nodeId: str
    nodeToken: str
    poolId: str = ""
    heartbeatSeconds: float = 5.0
    graceSeconds: float = 30.0
    resourceVersion: int = 0


# -- heartbeat ------------------------------------------------------------------


class GpuHealth(_Out):
    uuid: str
    healthy: bool
    xid: int | None = None


class Health(_Out):
    gpus: list[GpuHealth] = []


class HeartbeatRequest(_Out):
    health: Health
    inventory: dict[str, Any] | None = None


class HeartbeatAnswer(_In):
    nodeId: str = ""
    resourceVersion: int = 0
    graceSeconds: float | None = None
    serverTime: int | None = None


# -- watch ----------------------------------------------------------------------


class WatchRequest(_Out):
    resourceVersion: int
    timeoutMs: int


class BindingUnit(_In):
    unit: str = ""
    gpuIndex: int | None = None
    uuid: str | None = None
    migProfile: str | None = None


class BindingShare(_In):
    vcpuMilli: int | None = None
    memoryMiB: int | None = None
    hugepages1g: int = 0


class Binding(_In):
    reservationId: str
    kind: str = "hold"
    tenantId: str = ""
    principalId: str = ""
    start: int | None = None
    end: int | None = None
    units: list[BindingUnit] = []
    share: BindingShare = BindingShare()
    numaNodes: list[int] = []


class WatchAnswer(_In):
    resourceVersion: int
    changed: bool = True
    bindings: list[Binding] = []


# -- report ---------------------------------------------------------------------


class Report(_Out):
    reservationId: str
    status: Literal["bound", "unbound", "failed"]
    cgroup: str | None = None
    devices: list[str] | None = None
    message: str | None = None


class ReportRequest(_Out):
    reports: list[Report]


class Ignored(_In):
    reservationId: str = ""
    reason: str = ""


class ReportAnswer(_In):
    accepted: list[str] = []
    ignored: list[Ignored] = []


# -- errors ---------------------------------------------------------------------


class ErrorBody(_In):
    code: str = "UNKNOWN"
    message: str = ""
    details: dict[str, Any] = {}


class ErrorEnvelope(_In):
    error: ErrorBody = ErrorBody()


def encode(doc: Struct) -> bytes:
    return msgspec.json.encode(doc)
