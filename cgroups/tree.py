"""The owner of one cgroup v2 subtree: create, limit, fill, freeze, kill, remove, list, check drift and repair.

A Subtree writes inside its root and nowhere else (above the root only when
the caller names an `enable_from` ancestor it may write, to switch
controllers on down the path). Each child is one share, named `<prefix><id>`
with a checked charset; beside it lives a record (see record.py) of the share
and device rules, so that `list()` after a restart rebuilds everything from
cgroupfs and the kernel alone, and `drift()` / `repair()` put back a limit or
a device program changed behind the subtree's back. Domain-free: a name and a
share, nothing about reservations.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

from . import bpf, host
from .bpf_program import build
from .cpu import CpuStat, apply_cpu, desired_cpu, stat_cpu
from .cpuset import CpusetStat, apply_cpuset, desired_cpuset, stat_cpuset
from .devices import DeviceRule, normalise
from .errors import (Busy, CgroupError, ControllerMissing, Exists, FileMissing, InvalidName, NotCgroup2, NotFound,
                     RecordCorrupt)
from .files import Drift, drift_values, has_file, parse_keyed, parse_list, parse_pids, read_file, write_file
from .hugetlb import HugetlbStat, apply_hugetlb, desired_hugetlb, features, stat_hugetlb
from .memory import MemoryStat, apply_memory, desired_memory, has_swap, stat_memory
from .record import DirRecords, Record, RecordStore, XattrRecords
from .share import CgroupShare, read_capacity

log = logging.getLogger(__name__)

ALL_CONTROLLERS = ("cpuset", "cpu", "memory", "hugetlb")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
POLL_SLICE_S = 0.001  # cgroup.events notifications are rate-limited (10 ms); re-read at least this often


class DirOps(Protocol):
    """How directories appear and go: the kernel's mkdir/rmdir, or a test's stand-in that fills a plain tree."""

    def mkdir(self, path: Path) -> None: ...
    def rmdir(self, path: Path) -> None: ...


class KernelDirs:
    def mkdir(self, path: Path) -> None:
        os.mkdir(path, 0o755)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)


@dataclass(frozen=True)
class Cgroup:
    """A child of the subtree as found: its share and rules (None when there is no usable record) and programs."""

    name: str
    path: Path
    share: CgroupShare | None
    rules: tuple[DeviceRule, ...] | None
    program_ids: tuple[int, ...] = ()
    problem: str | None = None  # why share is None: no record, or a corrupt one


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
    """One delegated root and the share cgroups below it."""

    def __init__(self, root: Path | str, *, controllers: Iterable[str] = ALL_CONTROLLERS, prefix: str = "rsv-",
                 state_dir: Path | str | None = None, enable_from: Path | str | None = None,
                 fake_tree: DirOps | None = None, proc: Path = Path("/proc"), sys: Path = Path("/sys")) -> None:
        """root: the delegated cgroup (created if missing). controllers: what to enforce (a subset of
        ALL_CONTROLLERS; leave out those the host cannot give). enable_from: an ancestor the subtree may
        also write, from which controllers are switched on down to root. fake_tree: a plain directory stands
        in for cgroupfs (tests only): no cgroup2 check and no device programs."""
        self.root = Path(root)
        self.controllers = tuple(c for c in ALL_CONTROLLERS if c in set(controllers))
        unknown = set(controllers) - set(ALL_CONTROLLERS)
        if unknown:
            raise ValueError(f"unknown controllers {sorted(unknown)}; known: {ALL_CONTROLLERS}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}", prefix):
            raise InvalidName(f"bad prefix {prefix!r}: letters, digits, '_', '.', '-', 32 at most")
        self.prefix = prefix
        self.enable_from = Path(enable_from) if enable_from is not None else None
        self.fake = fake_tree is not None
        self._dirs: DirOps = fake_tree or KernelDirs()
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._records: RecordStore | None = None
        self._proc, self._sys = proc, sys
        if not self.fake:
            probe = self.root
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            if not host.is_cgroup2(probe):
                raise NotCgroup2(self.root, host.describe_fs(probe))

    # -- set-up -------------------------------------------------------------

    def prepare(self) -> None:
        """Create the root if needed, switch the controllers on down to it, pick the record store. Idempotent."""
        if self._records is not None:
            return
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
        if self._state_dir is not None:
            self._records = DirRecords(self._state_dir)
        else:
            found = XattrRecords.probe(self.root)
            if found is None:
                raise CgroupError(f"{self.root} takes no trusted.* or user.* xattrs (Linux < 5.7?): construct the "
                                  "Subtree with state_dir= to keep recovery records in a directory", path=self.root)
            self._records = found

    def _mkdir(self, d: Path) -> None:
        """mkdir unless there; OSError becomes CgroupError with the path."""
        if d.is_dir():
            return
        try:
            self._dirs.mkdir(d)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CgroupError(f"mkdir {d}: [Errno {exc.errno}] {exc.strerror}", path=d, errno=exc.errno) from None

    def _enable(self, d: Path) -> None:
        if not self.controllers:
            return
        offered = set(parse_list(read_file(d, "cgroup.controllers")))
        for c in self.controllers:
            if c not in offered:
                raise ControllerMissing(c, self._hint(c, d), path=d / "cgroup.controllers")
        enabled = set(parse_list(read_file(d, "cgroup.subtree_control")))
        todo = [c for c in self.controllers if c not in enabled]
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
        if c in host.v1_controllers(self._proc):
            return (f"{c} is bound to a cgroup v1 hierarchy on this host (hybrid mode); boot with "
                    f"systemd.unified_cgroup_hierarchy=1 or cgroup_no_v1={c}, or build the Subtree without {c!r}")
        mount = host.cgroup2_mount(self._proc)
        if mount is not None and c not in parse_list(read_file(mount, "cgroup.controllers")):
            return f"the kernel offers no {c} controller ({mount}/cgroup.controllers lacks it)"
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
        self._check_name(name)
        return self.root / name

    def _existing(self, name: str) -> Path:
        path = self.path(name)
        if not path.is_dir():
            raise NotFound(f"no cgroup {name!r} in {self.root}", path=path)
        return path

    # -- limits and devices -------------------------------------------------

    def create(self, name: str, share: CgroupShare, rules: Iterable[DeviceRule] | None = None) -> Cgroup:
        """A new child with the share and (unless rules is None) a default-deny device program; Exists if there."""
        if self.path(name).exists():
            raise Exists(f"cgroup {name!r} already exists in {self.root}; apply() adopts it", path=self.path(name))
        return self.apply(name, share, rules)

    def apply(self, name: str, share: CgroupShare, rules: Iterable[DeviceRule] | None = None) -> Cgroup:
        """Make the child match the share and rules, creating it if needed; writes only what differs.

        Order: validate the share against the root's capacity (nothing is
        written for a share the host cannot give), mkdir, record, limits,
        device program. A crash part-way leaves a record that drift() and
        repair() complete.
        """
        self.prepare()
        path = self.path(name)
        share.check_fits(read_capacity(self.root, proc=self._proc, sys=self._sys, fields=share.asks()))
        rules_n = normalise(rules) if rules is not None else None
        if rules_n is not None and self.fake:
            raise CgroupError("device programs need a real cgroup2 directory, not a fake tree", path=path)
        insns = build(rules_n) if rules_n is not None else None
        self._mkdir(path)
        record = Record(name, share, rules_n)
        if self.records.read_raw(path) != record.encode():
            self.records.write(path, record)
        self._apply_limits(path, share)
        programs: tuple[int, ...] = ()
        if insns is not None:
            programs = (bpf.install(path, insns).id,)
        elif not self.fake:
            stale = bpf.attached(path)
            if stale:
                bpf.detach_ids(path, [p.id for p in stale])
        return Cgroup(name, path, share, rules_n, programs)

    def _apply_limits(self, path: Path, share: CgroupShare) -> list[str]:
        written: list[str] = []
        for c in self.controllers:
            written += {"cpuset": apply_cpuset, "cpu": apply_cpu, "memory": apply_memory,
                        "hugetlb": apply_hugetlb}[c](path, share)
        return written

    def _desired(self, path: Path, share: CgroupShare) -> dict[str, str]:
        out: dict[str, str] = {}
        if "cpuset" in self.controllers:
            out |= desired_cpuset(share)
        if "cpu" in self.controllers:
            out |= desired_cpu(share)
        if "memory" in self.controllers:
            out |= desired_memory(share, has_swap=has_swap(path))
        if "hugetlb" in self.controllers:
            out |= desired_hugetlb(share, **features(path))
        return out

    # -- processes ----------------------------------------------------------

    def move(self, name: str, pid: int) -> None:
        """Move a whole process (all its threads) into the child."""
        write_file(self._existing(name), "cgroup.procs", str(int(pid)))

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
        """SIGKILL every process of the child and its descendants (cgroup.kill, or the freeze-and-signal fallback)."""
        kill_cgroup(self._existing(name))

    def remove(self, name: str, timeout: float = 5.0) -> None:
        """Kill, wait until empty (bounded), remove the child and its record. Absent already: nothing to do."""
        path = self.path(name)
        if not path.exists():
            self.records.delete(path)
            return
        deadline = time.monotonic() + timeout
        kill_cgroup(path, timeout=timeout)
        if not wait_event(path, "populated", 0, max(0.0, deadline - time.monotonic())):
            raise Busy(f"{path} still has processes {timeout}s after cgroup.kill: {_procs(path, True)[:20]}",
                       path=path)
        below = sorted((Path(d) for d, _, _ in os.walk(path) if Path(d) != path), key=lambda p: -len(p.parts))
        for d in below + [path]:
            _rmdir(self._dirs, d, deadline)
        self.records.delete(path)

    # -- recovery -----------------------------------------------------------

    def list(self) -> list[Cgroup]:
        """Every child with the subtree's prefix, as found in cgroupfs (record, programs) after any restart."""
        self.prepare()
        out = []
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False) and entry.name.startswith(self.prefix) and \
                        NAME_RE.fullmatch(entry.name):
                    out.append(self._load(entry.name))
        return sorted(out, key=lambda c: c.name)

    def get(self, name: str) -> Cgroup:
        self._existing(name)
        return self._load(name)

    def _load(self, name: str) -> Cgroup:
        path = self.root / name
        programs = tuple(bpf.query_ids(path)) if not self.fake else ()
        try:
            record = self.records.read(path)
        except RecordCorrupt as exc:
            return Cgroup(name, path, None, None, programs, problem=str(exc))
        if record is None:
            return Cgroup(name, path, None, None, programs, problem="no record (created by someone else, or a crash "
                                                                    "between mkdir and the record)")
        return Cgroup(name, path, record.share, record.rules, programs)

    def drift(self, name: str) -> list[Drift]:
        """Where the kernel's state differs from the record: limit files, and the device program (exactly one,
        with the tag of the program the rules build)."""
        c = self.get(name)
        if c.share is None:
            return [Drift("record", "present", c.problem or "missing")]
        out = drift_values(c.path, self._desired(c.path, c.share))
        if self.fake:
            return out
        infos = bpf.attached(c.path)
        got = ", ".join(i.tag.hex() for i in infos) or "none"
        if c.rules is not None:
            want = bpf.expected_tag(build(c.rules))
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
        path = self._existing(name)
        events = parse_keyed(read_file(path, "cgroup.events"))

        def get(controller: str, fn):
            if controller not in self.controllers:
                return None
            try:
                return fn(path)
            except FileMissing:
                return None

        return CgroupStat(bool(events.get("populated")), bool(events.get("frozen")), tuple(_procs(path, False)),
                          get("cpu", stat_cpu), get("cpuset", stat_cpuset), get("memory", stat_memory),
                          get("hugetlb", stat_hugetlb))


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
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
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


def _rmdir(dirs: DirOps, d: Path, deadline: float) -> None:
    """rmdir, retried on EBUSY (a dying task can hold the cgroup a moment after populated 0)."""
    while True:
        try:
            dirs.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(f"rmdir {d}: [Errno {exc.errno}] {exc.strerror}", path=d, errno=exc.errno) from None
            time.sleep(0.001)
