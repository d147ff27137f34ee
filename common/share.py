"""The per-GPU share: the host CPU and memory that ride along with one whole GPU.

One definition, used by the control plane when it books a whole-GPU request
without explicit resources and by the agent when it reports what its host can
give. Units are integral so that no float rounding can make two sides differ:
vcpu in thousandths (millicpu), memory in MiB.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, slots=True)
class Share:
    """Host resources per node: millicpu, MiB of memory and 1 GiB hugepages."""

    vcpu_milli: int = 0
    memory_mib: int = 0
    hugepages_1g: int = 0

    def scaled(self, n: int) -> "Share":
        return Share(self.vcpu_milli * n, self.memory_mib * n, self.hugepages_1g * n)

    def max_with(self, other: "Share") -> "Share":
        return Share(
            max(self.vcpu_milli, other.vcpu_milli),
            max(self.memory_mib, other.memory_mib),
            max(self.hugepages_1g, other.hugepages_1g),
        )

    def minus(self, other: "Share") -> "Share":
        """What this share has above `other`, never negative."""
        return Share(
            max(0, self.vcpu_milli - other.vcpu_milli),
            max(0, self.memory_mib - other.memory_mib),
            max(0, self.hugepages_1g - other.hugepages_1g),
        )

    def fits_in(self, other: "Share") -> bool:
        return (
            self.vcpu_milli <= other.vcpu_milli
            and self.memory_mib <= other.memory_mib
            and self.hugepages_1g <= other.hugepages_1g
        )

    @property
    def empty(self) -> bool:
        return not (self.vcpu_milli or self.memory_mib or self.hugepages_1g)

    def to_wire(self) -> dict:
        return {
            "vcpu": self.vcpu_milli / 1000,
            "memoryGiB": self.memory_mib / 1024,
            "hugepages1Gi": self.hugepages_1g,
        }


NO_SHARE = Share()


def host_share_per_gpu(allocatable_vcpu_milli: int, allocatable_memory_mib: int, bookable_gpus: int) -> Share | None:
    """What one GPU of this host carries: allocatable CPUs and memory divided by its bookable GPUs.

    Rounded down, so that every GPU of the host can carry its share at once.
    None when the host has no bookable GPU or reports no CPU or memory row.
    """
    if bookable_gpus <= 0 or allocatable_vcpu_milli <= 0 or allocatable_memory_mib <= 0:
        return None
    return Share(allocatable_vcpu_milli // bookable_gpus, allocatable_memory_mib // bookable_gpus)


def pool_share_per_gpu(hosts: Iterable[Share | None], policy_per_gpu: Share | None = None) -> Share:
    """The pool's per-GPU share: the policy's where set, else the smallest any GPU host can give.

    A pool whose hosts report no CPU or memory rows books no share.
    """
    if policy_per_gpu is not None:
        return policy_per_gpu
    shares = [h for h in hosts if h is not None]
    if not shares:
        return NO_SHARE
    return Share(min(s.vcpu_milli for s in shares), min(s.memory_mib for s in shares))
