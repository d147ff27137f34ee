"""Device allow-list rules: the DeviceRule value, its normal form, and the rule sets for a GPU share.

A rule is (type, major, minor, access) as in cgroup v1's devices.allow:
type 'c' (char), 'b' (block) or 'a' (either); major/minor a number or None
for any; access a subset of 'r', 'w', 'm' (mknod). The program built from the
rules denies everything they do not allow.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import CgroupError, InvalidRule

KINDS = ("a", "b", "c")
ACCESS = "rwm"
MAX_MAJOR = (1 << 12) - 1  # MAJOR() is 12 bits in the kernel's dev_t
MAX_MINOR = (1 << 20) - 1

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
NVIDIA_MODESET_MINOR = 254


@dataclass(frozen=True)
class DeviceRule:
    kind: str
    major: int | None
    minor: int | None
    access: frozenset[str]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRule(f"device type must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "access", frozenset(self.access))
        if not self.access or not self.access <= set(ACCESS):
            raise InvalidRule(f"device access must be a non-empty subset of 'rwm', got {''.join(sorted(self.access))!r}")
        for name, top in (("major", MAX_MAJOR), ("minor", MAX_MINOR)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top):
                raise InvalidRule(f"device {name} must be within [0, {top}] or None (any), got {v!r}")

    def __str__(self) -> str:
        def num(v: int | None) -> str:
            return "*" if v is None else str(v)

        return f"{self.kind} {num(self.major)}:{num(self.minor)} {''.join(a for a in ACCESS if a in self.access)}"

    @classmethod
    def parse(cls, text: str) -> DeviceRule:
        """'c 195:0 rw', 'c 136:* rw', 'a *:* m'."""
        m = re.fullmatch(r"\s*([abc])\s+(\*|\d+):(\*|\d+)\s+([rwm]+)\s*", text)
        if not m:
            raise InvalidRule(f"device rule must look like 'c 195:0 rw', got {text!r}")
        kind, major, minor, access = m.groups()
        return cls(kind, None if major == "*" else int(major), None if minor == "*" else int(minor),
                   frozenset(access))

    def covers(self, other: DeviceRule) -> bool:
        """Whether this rule allows everything `other` allows (same or wider device, superset of access)."""
        return (self.kind in ("a", other.kind) and self.major in (None, other.major)
                and self.minor in (None, other.minor) and other.access <= self.access)

    def sort_key(self) -> tuple:
        return (KINDS.index(self.kind), -1 if self.major is None else self.major,
                -1 if self.minor is None else self.minor)


def rule(kind: str, major: int | None, minor: int | None, access: str) -> DeviceRule:
    return DeviceRule(kind, major, minor, frozenset(access))


def normalise(rules: Iterable[DeviceRule]) -> tuple[DeviceRule, ...]:
    """One rule per device, accesses merged, rules that a broader one covers dropped, in a stable order.

    The same set of rules in any order gives the same tuple, hence the same
    program and the same program tag.
    """
    rules = tuple(rules)
    for r in rules:
        if not isinstance(r, DeviceRule):
            raise InvalidRule(f"not a DeviceRule: {r!r}")
    return _normalise(frozenset(rules))


@functools.lru_cache(maxsize=1024)
def _normalise(rules: frozenset[DeviceRule]) -> tuple[DeviceRule, ...]:
    merged: dict[tuple, set[str]] = {}
    for r in rules:
        merged.setdefault((r.kind, r.major, r.minor), set()).update(r.access)
    candidates = [DeviceRule(k, ma, mi, frozenset(acc)) for (k, ma, mi), acc in merged.items()]
    kept = [r for r in candidates if not any(o != r and o.covers(r) for o in candidates)]
    return tuple(sorted(kept, key=DeviceRule.sort_key))


def harmless_rules() -> tuple[DeviceRule, ...]:
    """The nodes every process expects: null, zero, full, random, urandom, tty, ptmx and the pts."""
    return (
        rule("c", 1, 3, "rw"),    # /dev/null
        rule("c", 1, 5, "rw"),    # /dev/zero
        rule("c", 1, 7, "rw"),    # /dev/full
        rule("c", 1, 8, "rw"),    # /dev/random
        rule("c", 1, 9, "rw"),    # /dev/urandom
        rule("c", 5, 0, "rw"),    # /dev/tty
        rule("c", 5, 2, "rw"),    # /dev/ptmx
        rule("c", 136, None, "rw"),  # /dev/pts/*
    )


def read_proc_devices(proc: Path = Path("/proc")) -> dict[str, int]:
    """Character device majors by driver name, from /proc/devices."""
    out: dict[str, int] = {}
    in_char = False
    for line in (Path(proc) / "devices").read_text().splitlines():
        if line.startswith("Character devices:"):
            in_char = True
            continue
        if line.startswith("Block devices:"):
            in_char = False
            continue
        parts = line.split(None, 1)
        if in_char and len(parts) == 2 and parts[0].isdigit():
            out.setdefault(parts[1].strip(), int(parts[0]))
    return out


def nvidia_rules(gpu_minors: Iterable[int], mig_cap_minors: Iterable[int] = (), modeset: bool = False, *,
                 proc: Path = Path("/proc")) -> tuple[DeviceRule, ...]:
    """The nodes a share of these GPUs needs.

    /dev/nvidiaN (195:N) for each GPU minor, /dev/nvidiactl (195:255),
    /dev/nvidia-uvm and /dev/nvidia-uvm-tools (their major is dynamic: read
    from /proc/devices, minors 0 and 1), /dev/nvidia-modeset (195:254) when
    asked, and for MIG the /dev/nvidia-caps/nvidia-capN minors of the share's
    GPU and compute instances (read-only, as the driver creates them).
    """
    majors = read_proc_devices(proc)
    out = [rule("c", NVIDIA_MAJOR, m, "rw") for m in gpu_minors]
    out.append(rule("c", NVIDIA_MAJOR, NVIDIACTL_MINOR, "rw"))
    if modeset:
        out.append(rule("c", NVIDIA_MAJOR, NVIDIA_MODESET_MINOR, "rw"))
    uvm = majors.get("nvidia-uvm")
    if uvm is None:
        raise CgroupError(
            f"nvidia-uvm is not in {proc}/devices: its major is assigned when the module loads; load it "
            "(modprobe nvidia-uvm, or nvidia-modprobe -u -c=0) before building the rules, or CUDA will be denied"
        )
    out += [rule("c", uvm, 0, "rw"), rule("c", uvm, 1, "rw")]
    caps = list(mig_cap_minors)
    if caps:
        caps_major = majors.get("nvidia-caps")
        if caps_major is None:
            raise CgroupError(f"nvidia-caps is not in {proc}/devices, but MIG capability minors {caps} were asked for")
        out += [rule("c", caps_major, m, "r") for m in caps]
    return tuple(out)
