"""cgroup v1 devices: a reservation's device rules as devices.allow exceptions over a default deny.

What the kernel does with these files (checked on the hybrid test host,
Linux 6.18; see docs/cgroups.md):

- `devices.deny` "a" clears the list and makes the cgroup default-deny
  (refused with EINVAL while the cgroup has children); each `devices.allow`
  line then adds one exception, `c 195:0 rw`.
- Only the first character is read for type 'a': "a 7:* rw" written to
  devices.allow opens EVERY device. So a rule of type 'a' with a number is
  written as its 'c' and its 'b' half (`v1_rules`).
- Accesses of the same (type, major, minor) are merged; a narrower rule that
  a wider one covers is kept as written. `normalise` already drops those, so
  the list reads back as exactly the rules.
- A deny line removes accesses from the entry with exactly that type,
  major and minor.

A change is applied as denies first, then allows, so no moment is more open
than the old or the new list. `devices.list` is what is compared for drift.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from ..devices import ACCESS, DeviceRule, normalise
from ..files import Drift
from . import spy

CONTROLLER = "devices"
LIST = "devices.list"
ALLOW_ALL = DeviceRule("a", None, None, frozenset(ACCESS))


def v1_rules(rules: Iterable[DeviceRule]) -> tuple[DeviceRule, ...]:
    """The rules as the v1 list holds them: type 'a' split into 'c' and 'b', normalised."""
    out: list[DeviceRule] = []
    for r in rules:
        out += [dataclasses.replace(r, kind="c"), dataclasses.replace(r, kind="b")] if r.kind == "a" else [r]
    return normalise(out)


def _rule(entry: spy.DeviceAccess) -> DeviceRule:
    def num(v: object) -> int | None:
        return None if v == "*" else int(v)  # type: ignore[call-overload]

    return DeviceRule(entry.dev_type, num(entry.major), num(entry.minor), frozenset(entry.access_string))


def _entry(kind: str, major: int | None, minor: int | None, access: frozenset[str]) -> spy.DeviceAccess:
    return spy.DeviceAccess(kind, major, minor, "".join(a for a in ACCESS if a in access))


def read_list(dir: Path) -> tuple[DeviceRule, ...]:
    """devices.list as rules ('a *:* rwm': this cgroup allows everything)."""
    return tuple(_rule(e) for e in spy.Devices(dir).list)


def apply_devices(dir: Path, rules: Iterable[DeviceRule] | None) -> list[str]:
    """Make devices.list hold exactly the rules (None: allow everything); returns [LIST] when it was changed."""
    if rules is None:
        return allow_all(dir)
    want = v1_rules(rules)
    have = read_list(dir)
    if set(have) == set(want):
        return []
    ctl = spy.Devices(dir)
    if any(r.kind == "a" for r in have):  # allow-all behaviour: a new cgroup below an open parent
        ctl.deny = spy.DeviceAccess("a")
        have = ()
    current = {(r.kind, r.major, r.minor): r.access for r in have}
    wanted = {(r.kind, r.major, r.minor): r.access for r in want}
    for key, access in current.items():
        extra = access - wanted.get(key, frozenset())
        if extra:
            ctl.deny = _entry(*key, extra)
    for key, access in wanted.items():
        missing = access - current.get(key, frozenset())
        if missing:
            ctl.allow = _entry(*key, missing)
    return [LIST]


def allow_all(dir: Path) -> list[str]:
    """Back to allowing every device (a reservation whose rules were dropped); needs an open parent."""
    if read_list(dir) == (ALLOW_ALL,):
        return []
    spy.Devices(dir).allow = spy.DeviceAccess("a")
    return [LIST]


def drift_devices(dir: Path, rules: Iterable[DeviceRule] | None) -> list[Drift]:
    want = v1_rules(rules) if rules is not None else (ALLOW_ALL,)
    got = read_list(dir)
    if set(got) == set(want):
        return []
    return [Drift(LIST, "; ".join(map(str, want)), "; ".join(map(str, got)) or "nothing allowed")]
