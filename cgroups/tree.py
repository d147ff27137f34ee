"""The owner of one cgroup subtree: create, limit, fill, freeze, kill, remove, list, check drift and repair.

The root is a cgroup2 directory. On a hybrid host, each controller the
subtree enforces that is bound to a cgroup v1 hierarchy (cpu, cpuset,
memory, hugetlb, and devices for the v1 device lists) gets a root of its own
in that hierarchy (`v1_roots`, see layout.v1_roots_for), and every child
exists with the same name in each of them; a process is joined to all. A
Subtree writes inside its roots and nowhere else (above the cgroup2 root
only when the caller names an `enable_from` ancestor it may write, to switch
controllers on down the path). Each child is one share, named
`<prefix><id>` with a checked charset; beside its cgroup2 directory lives a
record (record.py) of the share and device rules, kept once, so that
`list()` after a restart rebuilds everything from cgroupfs and the kernel
alone, and `drift()` / `repair()` put back a limit (in any hierarchy) or a
device program changed behind the subtree's back. The kernel-facing
operations that a test replaces are in the `kernel` object it is given
(kernel.py). Domain-free: a name and a share, nothing about reservations.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import select
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from .bpf_program import build
from .cpu import CpuStat
from .cpuset import CpusetStat
from .devices import DeviceRule, normalise
from .enforce import V1, V2
from .errors import (Busy, CgroupError, ControllerMissing, Exists, FileMissing, InvalidName, NotFound, RecordCorrupt)
from .files import Drift, drift_values, has_file, parse_keyed, parse_list, parse_pids, read_file, write_file
from .hugetlb import HugetlbStat
from .kernel import Kernel, LinuxKernel
from .layout import Layout, Place, probe_layout, v1_roots_for
from .memory import MemoryStat
from .record import DirRecords, Record, RecordStore, XattrRecords
from .share import CgroupShare, read_capacity
from .v1 import cpuset as cpuset_v1
from .v1 import devices as devices_v1

log = logging.getLogger(__name__)

ALL_CONTROLLERS = ("cpuset", "cpu", "memory", "hugetlb")
V1_ORDER = ("cpuset", "cpu", "memory", "hugetlb", "devices")  # cpuset first: a v1 cpuset refuses tasks until filled
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
POLL_SLICE_S = 0.001  # cgroup.events notifications are rate-limited (10 ms); re-read at least this often


@dataclass(frozen=True)
class Cgroup:
    """A child of the subtree as found: its share and rules (None when there is no usable record), programs, and
    its directories in the v1 hierarchies (controller -> directory, those that exist)."""

    name: str
    path: Path
    share: CgroupShare | None
    rules: tuple[DeviceRule, ...] | None
    program_ids: tuple[int, ...] = ()
    problem: str | None = None  # why share is None: no record, or a corrupt one
    parts: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class CgroupStat:
    populated: bool
    frozen: bool
    procs: tuple[int, ...]
    cpu: CpuStat | None
    cpuset: CpusetStat | None
    memory: MemoryStat | None
    hugetlb: HugetlbStat | None


class Subtree:
    """One delegated cgroup2 root (and its counterparts in the v1 hierarchies) and the share cgroups below it."""

    def __init__(self, root: Path | str, *, controllers: Iterable[str] = ALL_CONTROLLERS, prefix: str = "rsv-",
                 state_dir: Path | str | None = None, enable_from: Path | str | None = None,
                 kernel: Kernel | None = None, layout: Layout | None = None,
                 v1_roots: Mapping[str, Path | str] | None = None, anchor_pid: int | None = None,
                 proc: Path = Path("/proc"), sys: Path = Path("/sys")) -> None:
        """root: the delegated cgroup2 directory (created if missing). controllers: what to enforce (a subset of
        ALL_CONTROLLERS), each where the host has it: on cgroup2, or on its v1 hierarchy. enable_from: an
        ancestor the subtree may also write, from which controllers are switched on down to root. kernel: the
        kernel-facing operations (LinuxKernel; tests pass a stand-in). layout: where each controller lives
        (probed from proc when None). v1_roots: the subtree's root per v1 controller, where the default (the
        same place relative to anchor_pid's cgroups, see layout.v1_path_for) is not wanted. anchor_pid: whose
        cgroups anchor that default (this process). Writes nothing."""
        self.root = Path(root)
        unknown = set(controllers) - set(ALL_CONTROLLERS)
        if unknown:
            raise ValueError(f"unknown controllers {sorted(unknown)}; known: {ALL_CONTROLLERS}")
        self.controllers = tuple(c for c in ALL_CONTROLLERS if c in set(controllers))
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}", prefix):
            raise InvalidName(f"bad prefix {prefix!r}: letters, digits, '_', '.', '-', 32 at most")
        self.prefix = prefix
        self.enable_from = Path(enable_from) if enable_from is not None else None
        self.kernel: Kernel = kernel or LinuxKernel()
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._records: RecordStore | None = None
        self._proc, self._sys = proc, sys
        self.kernel.check_cgroup2(self.root)
        self.layout = layout or probe_layout(proc)
        self.v1_roots = self._find_v1_roots(dict(v1_roots or {}), anchor_pid)

    def _find_v1_roots(self, explicit: dict[str, Path | str], anchor_pid: int | None) -> dict[str, Path]:
        used = [c for c in V1_ORDER if (c in self.controllers or c == "devices") and self.layout.place(c) == "v1"]
        stray = set(explicit) - set(used)
        if stray:
            raise ValueError(f"v1_roots names {sorted(stray)}, which this subtree does not enforce on a cgroup v1 "
                             f"hierarchy here ({self.layout.summary()})")
        computed = v1_roots_for(self.layout, self.root, tuple(c for c in used if c not in explicit),
                                proc=self._proc, pid=anchor_pid or "self")
        roots = {c: Path(explicit[c]) if c in explicit else computed[c] for c in used}
        for d in roots.values():
            self.kernel.check_cgroup1(d)
        return roots

    @property
    def places(self) -> dict[str, Place]:
        """Where each enforced controller (and 'devices') is enforced: 'v2' or 'v1'. Absent ones are left out."""
        return {c: p for c in (*self.controllers, "devices") if (p := self.layout.place(c)) is not None}

    def _place(self, controller: str) -> Place:
        place = self.layout.place(controller)
        if place is None:
            raise ControllerMissing(controller, self.layout.why_absent(controller))
        return place

    # -- set-up -------------------------------------------------------------

    def prepare(self) -> None:
        """Create the roots if needed, switch the controllers on down to the cgroup2 root, fill new v1 cpusets,
        pick the record store. Idempotent."""
        if self._records is not None:
            return
        for c in self.controllers:
            self._place(c)
        top = self.enable_from or self.root
        try:
            rel = self.root.relative_to(top)
        except ValueError:
            raise CgroupError(f"enable_from {top} is not an ancestor of {self.root}", path=top) from None
        chain = [top]
        for part in rel.parts:
            chain.append(chain[-1] / part)
        for d in chain:
            self._mkdir(d)
            self._enable(d)
        for c, root in self.v1_roots.items():
            self._make_v1_root(c, root)
        if self._state_dir is not None:
            self._records = DirRecords(self._state_dir)
        else:
            found = XattrRecords.probe(self.root)
            if found is None:
                raise CgroupError(f"{self.root} takes no trusted.* or user.* xattrs (Linux < 5.7?): construct the "
                                  "Subtree with state_dir= to keep recovery records in a directory", path=self.root)
            self._records = found

    def _make_v1_root(self, controller: str, root: Path) -> None:
        """mkdir -p of a v1 root, from its nearest existing ancestor; a cpuset directory made is filled at once."""
        made = []
        d = root
        while not d.is_dir() and d != d.parent:
            made.append(d)
            d = d.parent
        for d in reversed(made):
            self._mkdir(d)
            if controller == "cpuset":
                cpuset_v1.fill_from_parent(d)
        if controller == "cpuset" and not made and cpuset_v1.is_empty(root):
            cpuset_v1.fill_from_parent(root)  # a root left empty by a crash right after its mkdir

    def _mkdir(self, d: Path) -> None:
        """mkdir unless there; OSError becomes CgroupError with the path."""
        if d.is_dir():
            return
        try:
            self.kernel.mkdir(d)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CgroupError(f"mkdir {d}: [Errno {exc.errno}] {exc.strerror}", path=d, errno=exc.errno) from None

    def _enable(self, d: Path) -> None:
        wanted = [c for c in self.controllers if self.layout.place(c) == "v2"]
        if not wanted:
            return
        offered = set(parse_list(read_file(d, "cgroup.controllers")))
        for c in wanted:
            if c not in offered:
                raise ControllerMissing(c, self._hint(c, d), path=d / "cgroup.controllers")
        enabled = set(parse_list(read_file(d, "cgroup.subtree_control")))
        todo = [c for c in wanted if c not in enabled]
        if not todo:
            return
        try:
            write_file(d, "cgroup.subtree_control", " ".join(f"+{c}" for c in todo))
        except CgroupError as exc:
            if exc.errno == errno.EBUSY:
                raise CgroupError(f"{exc}: {d} holds processes of its own and cgroup v2 allows controllers only "
                                  "above leaves; move them into a leaf cgroup first", path=d, errno=exc.errno) from None
            raise

    def _hint(self, c: str, d: Path) -> str:
        if c == "hugetlb":
            return (f"systemd does not delegate hugetlb (it is not one of its controllers); the operator enables it "
                    f"on every cgroup above {d}, from the cgroup2 root down: `echo +hugetlb > <dir>/"
                    "cgroup.subtree_control` for each (e.g. ExecStartPre= of the agent's unit), or passes "
                    "enable_from= naming the highest cgroup the agent may write")
        return (f"{c} is not delegated to {d}: set Delegate=yes (or Delegate={c}) on the agent's systemd unit, or "
                f"enable it in {d.parent}/cgroup.subtree_control")

    @property
    def records(self) -> RecordStore:
        self.prepare()
        assert self._records is not None
        return self._records

    def name_for(self, key: str) -> str:
        """The cgroup name for a key (e.g. a reservation id): prefix + key, checked."""
        name = self.prefix + key
        self._check_name(name)
        return name

    def _check_name(self, name: str) -> None:
        if not name.startswith(self.prefix) or len(name) == len(self.prefix) or not NAME_RE.fullmatch(name):
            raise InvalidName(f"cgroup name {name!r} must start with {self.prefix!r} and use only letters, digits, "
                              "'_', '.', '-' (128 at most)")

    def path(self, name: str) -> Path:
        """The child's cgroup2 directory."""
        self._check_name(name)
        return self.root / name

    def _existing(self, name: str) -> Path:
        path = self.path(name)
        if not path.is_dir():
            raise NotFound(f"no cgroup {name!r} in {self.root}", path=path)
        return path

    def parts(self, name: str) -> dict[str, Path]:
        """The child's directories in the v1 hierarchies, controller -> directory, those that exist."""
        self._check_name(name)
        return {c: root / name for c, root in self.v1_roots.items() if (root / name).is_dir()}

    def _part(self, controller: str, name: str) -> Path:
        return self.v1_roots[controller] / name

    def procs_paths(self, name: str) -> list[Path]:
        """Every cgroup.procs file of the child, cgroup2's first: what a process writes its pid to, in this order,
        to join the child in every hierarchy (what `berth exec` does as root before it execs)."""
        paths = [self._existing(name)] + list(dict.fromkeys(self.parts(name).values()))
        return [d / "cgroup.procs" for d in paths]

    # -- limits and devices -------------------------------------------------

    def create(self, name: str, share: CgroupShare, rules: Iterable[DeviceRule] | None = None) -> Cgroup:
        """A new child with the share and (unless rules is None) a default-deny device filter; Exists if there."""
        if self.path(name).exists():
            raise Exists(f"cgroup {name!r} already exists in {self.root}; apply() adopts it", path=self.path(name))
        return self.apply(name, share, rules)

    def apply(self, name: str, share: CgroupShare, rules: Iterable[DeviceRule] | None = None) -> Cgroup:
        """Make the child match the share and rules in every hierarchy, creating it if needed; writes only what
        differs.

        Order: refuse what the host cannot give or enforce (nothing is written
        then), mkdir in cgroup2, record, mkdir in each v1 hierarchy, limits,
        v1 device list, device program. A crash part-way leaves a record that
        drift() and repair() complete.
        """
        self.prepare()
        path = self.path(name)
        for c in self.controllers:
            if self._place(c) == "v1":
                V1[c].check(share)
        share.check_fits(read_capacity(self.root, proc=self._proc, sys=self._sys, fields=share.asks(),
                                       dirs=self.v1_roots))
        rules_n = normalise(rules) if rules is not None else None
        insns = build(rules_n) if rules_n is not None else None
        self._mkdir(path)
        record = Record(name, share, rules_n)
        if self.records.read_raw(path) != record.encode():
            self.records.write(path, record)
        for c in self.v1_roots:
            if c != "devices" or rules_n is not None:
                self._mkdir(self._part(c, name))
        self._apply_limits(name, share)
        if "devices" in self.v1_roots and self._part("devices", name).is_dir():
            devices_v1.apply_devices(self._part("devices", name), rules_n)
        programs: tuple[int, ...] = ()
        if insns is not None:
            programs = (self.kernel.install_program(path, insns),)
        else:
            stale = self.kernel.program_ids(path)
            if stale:
                self.kernel.detach_programs(path, stale)
        return Cgroup(name, path, share, rules_n, programs, parts=self.parts(name))

    def _dir_of(self, controller: str, name: str) -> tuple[Path, Place]:
        place = self._place(controller)
        return (self.root / name if place == "v2" else self._part(controller, name)), place

    def _apply_limits(self, name: str, share: CgroupShare) -> list[str]:
        written: list[str] = []
        for c in self.controllers:
            d, place = self._dir_of(c, name)
            written += (V2 if place == "v2" else V1)[c].apply(d, share)
        return written

    # -- processes ----------------------------------------------------------

    def move(self, name: str, pid: int) -> None:
        """Move a whole process (all its threads) into the child, in every hierarchy: cgroup2 first (the device
        program and cgroup.kill then cover it), then each v1 one."""
        for procs in self.procs_paths(name):
            write_file(procs.parent, procs.name, str(int(pid)))

    def procs(self, name: str, recursive: bool = False) -> list[int]:
        path = self._existing(name)
        return _procs(path, recursive)

    def freeze(self, name: str, timeout: float = 2.0) -> None:
        path = self._existing(name)
        write_file(path, "cgroup.freeze", "1")
        if not wait_event(path, "frozen", 1, timeout):
            raise Busy(f"{path} did not report frozen within {timeout}s", path=path)

    def thaw(self, name: str, timeout: float = 2.0) -> None:
        path = self._existing(name)
        write_file(path, "cgroup.freeze", "0")
        if not wait_event(path, "frozen", 0, timeout):
            raise Busy(f"{path} did not report thawed within {timeout}s", path=path)

    def kill(self, name: str) -> None:
        """SIGKILL every process of the child and its descendants: cgroup.kill (or the freeze-and-signal
        fallback) on the cgroup2 directory, which holds every process joined by move(); then any process found
        only in a v1 part (joined there by someone else)."""
        kill_cgroup(self._existing(name))
        for d in dict.fromkeys(self.parts(name).values()):
            _signal_pids(_procs(d, recursive=True))

    def remove(self, name: str, timeout: float = 5.0) -> None:
        """Kill, wait until empty (bounded), remove the child from every hierarchy (v1 first, cgroup2 and its
        record last, so a failure part-way leaves it listed) and its record. Absent already: nothing to do."""
        path = self.path(name)
        parts = list(dict.fromkeys(self.parts(name).values()))
        if not path.exists() and not parts:
            self.records.delete(path)
            return
        deadline = time.monotonic() + timeout
        if path.exists():
            kill_cgroup(path, timeout=timeout)
            if not wait_event(path, "populated", 0, max(0.0, deadline - time.monotonic())):
                raise Busy(f"{path} still has processes {timeout}s after cgroup.kill: {_procs(path, True)[:20]}",
                           path=path)
        for d in parts:
            _empty(d, deadline)
            _rmtree(self.kernel, d, deadline)
        if path.exists():
            _rmtree(self.kernel, path, deadline)
        self.records.delete(path)

    def remove_roots(self) -> None:
        """rmdir the subtree's roots in every hierarchy (they must hold no children): for tests and benches that
        made a subtree of their own. Levels above a root are the caller's."""
        deadline = time.monotonic() + 5.0
        for d in [*dict.fromkeys(self.v1_roots.values()), self.root]:
            if d.is_dir():
                _rmdir(self.kernel, d, deadline)

    # -- recovery -----------------------------------------------------------

    def list(self) -> list[Cgroup]:
        """Every child with the subtree's prefix, as found in cgroupfs (record, programs, v1 parts) after any
        restart; one found only in v1 hierarchies is listed with a problem, for the caller to remove."""
        self.prepare()
        names = _children(self.root, self.prefix)
        out = [self._load(n) for n in names]
        v1_only = {n for root in self.v1_roots.values() for n in _children(root, self.prefix)} - set(names)
        for n in sorted(v1_only):
            parts = self.parts(n)
            out.append(Cgroup(n, self.root / n, None, None, (), parts=parts,
                              problem=f"only in cgroup v1 hierarchies ({', '.join(map(str, parts.values()))}): no "
                                      "cgroup2 directory, no record"))
        return sorted(out, key=lambda c: c.name)

    def get(self, name: str) -> Cgroup:
        self._existing(name)
        return self._load(name)

    def _load(self, name: str) -> Cgroup:
        path = self.root / name
        programs = tuple(self.kernel.program_ids(path))
        parts = self.parts(name)
        try:
            record = self.records.read(path)
        except RecordCorrupt as exc:
            return Cgroup(name, path, None, None, programs, problem=str(exc), parts=parts)
        if record is None:
            return Cgroup(name, path, None, None, programs, parts=parts,
                          problem="no record (created by someone else, or a crash between mkdir and the record)")
        return Cgroup(name, path, record.share, record.rules, programs, parts=parts)

    def drift(self, name: str) -> list[Drift]:
        """Where the kernel's state differs from the record: limit files in every hierarchy, a v1 part that is
        missing, the v1 device list, and the device program (exactly one, with the tag the rules build)."""
        c = self.get(name)
        if c.share is None:
            return [Drift("record", "present", c.problem or "missing")]
        out: list[Drift] = []
        for ctrl in self.controllers:
            d, place = self._dir_of(ctrl, name)
            if not d.is_dir():
                out.append(Drift(f"{ctrl} cgroup", str(d), "missing"))
                continue
            out += drift_values(d, (V2 if place == "v2" else V1)[ctrl].desired(d, c.share))
        if "devices" in self.v1_roots:
            d = self._part("devices", name)
            if d.is_dir():
                out += devices_v1.drift_devices(d, c.rules)
            elif c.rules is not None:
                out.append(Drift("devices cgroup", str(d), "missing"))
        infos = self.kernel.programs(c.path)
        got = ", ".join(i.tag.hex() for i in infos) or "none"
        if c.rules is not None:
            want = self.kernel.expected_tag(build(c.rules))
            if [i.tag for i in infos] != [want]:
                out.append(Drift("devices", f"1 program, tag {want.hex()}", f"{len(infos)} program(s): {got}"))
        elif infos:
            out.append(Drift("devices", "no program", f"{len(infos)} program(s): {got}"))
        return out

    def repair(self, name: str) -> list[Drift]:
        """Put back what drift() finds, from the record; returns what was wrong."""
        found = self.drift(name)
        if not found:
            return []
        c = self.get(name)
        if c.share is None:
            raise CgroupError(f"cannot repair {name!r}: {c.problem}; remove it or apply a share", path=c.path)
        self.apply(name, c.share, c.rules)
        return found

    def stat(self, name: str) -> CgroupStat:
        """Usage and limits in one shape for both layouts (v1 figures where a controller is on v1)."""
        path = self._existing(name)
        events = parse_keyed(read_file(path, "cgroup.events"))

        def get(controller: str):
            if controller not in self.controllers:
                return None
            d, place = self._dir_of(controller, name)
            try:
                return (V2 if place == "v2" else V1)[controller].stat(d, path)
            except FileMissing:
                return None

        return CgroupStat(bool(events.get("populated")), bool(events.get("frozen")), tuple(_procs(path, False)),
                          get("cpu"), get("cpuset"), get("memory"), get("hugetlb"))


# -- free functions over one cgroup directory ------------------------------


def controllers_of(dir: Path | str) -> frozenset[str]:
    """The controllers a cgroup's children can be given (its cgroup.controllers): what an agent may enforce."""
    return frozenset(parse_list(read_file(Path(dir), "cgroup.controllers")))


def _procs(path: Path, recursive: bool) -> list[int]:
    if not recursive:
        return parse_pids(read_file(path, "cgroup.procs"))
    out: list[int] = []
    for d, _, _ in os.walk(path):
        try:
            out += parse_pids(read_file(Path(d), "cgroup.procs"))
        except FileMissing:
            continue  # removed while walking
    return out


def wait_event(path: Path, key: str, value: int, timeout: float) -> bool:
    """Wait until cgroup.events says key == value. poll(2) wakes on the kernel's notification; since those
    are rate-limited (at most one per 10 ms), the file is also re-read every POLL_SLICE_S at first."""
    start = time.monotonic()
    deadline = start + timeout
    try:
        fd = os.open(path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return key == "populated" and value == 0 and not path.exists()
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        while True:
            if parse_keyed(os.pread(fd, 4096, 0).decode()).get(key) == value:
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            slice_s = POLL_SLICE_S if now - start < 0.05 else 0.01
            poller.poll(max(1, round(min(deadline - now, slice_s) * 1000)))
    finally:
        os.close(fd)


def kill_cgroup(path: Path, timeout: float = 5.0) -> None:
    """SIGKILL everything in path and below: cgroup.kill (Linux 5.14+), else freeze, signal each pid, thaw."""
    if has_file(path, "cgroup.kill"):
        write_file(path, "cgroup.kill", "1")
        return
    signal_cgroup(path, timeout=timeout)


def signal_cgroup(path: Path, sig: int = signal.SIGKILL, timeout: float = 5.0) -> None:
    """The fallback where the kernel lacks cgroup.kill: with the cgroup frozen no process can fork, so one
    pass over cgroup.procs (recursively) reaches every process; fatal signals reach frozen tasks. Repeats
    until empty or timeout, for kernels without the freezer."""
    can_freeze = has_file(path, "cgroup.freeze")
    if can_freeze:
        write_file(path, "cgroup.freeze", "1")
        wait_event(path, "frozen", 1, min(timeout, 1.0))
    deadline = time.monotonic() + timeout
    try:
        while True:
            pids = _procs(path, recursive=True)
            if not pids:
                return
            _signal_pids(pids, sig)
            if sig != signal.SIGKILL or time.monotonic() > deadline:
                return
            if wait_event(path, "populated", 0, 0.05):
                return
    finally:
        if can_freeze and path.exists():
            try:
                write_file(path, "cgroup.freeze", "0")
            except FileMissing:
                pass


def _children(root: Path, prefix: str) -> list[str]:
    """Names of the directories below root with the prefix and a valid name (none when root is missing)."""
    if not root.is_dir():
        return []
    with os.scandir(root) as it:
        return sorted(e.name for e in it if e.is_dir(follow_symlinks=False) and e.name.startswith(prefix)
                      and NAME_RE.fullmatch(e.name))


def _signal_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _empty(d: Path, deadline: float) -> None:
    """SIGKILL what is still in a v1 part (a process joined there alone), until it is empty or the deadline."""
    while pids := _procs(d, recursive=True):
        if time.monotonic() > deadline:
            raise Busy(f"{d} still has processes: {pids[:20]}", path=d)
        _signal_pids(pids)
        time.sleep(POLL_SLICE_S)


def _rmtree(kernel: Kernel, path: Path, deadline: float) -> None:
    """rmdir path and any directories below it, bottom-up."""
    below = sorted((Path(d) for d, _, _ in os.walk(path) if Path(d) != path), key=lambda p: -len(p.parts))
    for d in below + [path]:
        _rmdir(kernel, d, deadline)


def _rmdir(kernel: Kernel, d: Path, deadline: float) -> None:
    """rmdir, retried on EBUSY (a dying task can hold the cgroup a moment after populated 0)."""
    while True:
        try:
            kernel.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(f"rmdir {d}: [Errno {exc.errno}] {exc.strerror}", path=d, errno=exc.errno) from None
            time.sleep(0.001)
