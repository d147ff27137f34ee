"""The end of a tenant's hold on a node: the process baseline at the hand-over, and ending what came after it.

At the hand-over the agent records `baseline(uid)`: the (pid, starttime)
pairs of the tenant user's processes that already run (services of that
user; the starttime from /proc/PID/stat tells a reused pid from the
original). At the hand-back, after the keys are removed, `end_sessions`
SIGKILLs, in rounds until a scan finds nothing new, and then waits (bounded)
until each is gone:

1. `ssh-session`: every sshd per-connection process of the user (comm
   `sshd`, `sshd-session` or `sshd-auth`, title `sshd: USER [priv]`,
   `sshd: USER@pts/N`, `sshd-session: USER...`; never the listener) and
   every process below it (by ppid);
2. `new-process`: every process that belongs to the user and is not in the
   baseline. For a user other than root, a process belongs to it when its
   real or effective uid is the user's, or its cgroup lies in systemd's
   `user-UID.slice` (so what the user started through sudo in a login
   session goes too).

Never pid 1, never kernel threads, never a pid in `protect` (the agent
passes its own pid), nor anything below or above one: the agent, its
children and its ancestors survive whatever the tenant did.

Root is different. Every service of the host runs as uid 0, and a service
started or restarted after the hand-over is not in the baseline, so rule 2
by uid would kill the host. For uid 0, rule 2 therefore applies only to
processes whose cgroup (/proc/PID/cgroup) lies in `user-0.slice`, where
systemd (pam_systemd) puts root's login sessions. A root tenant can leave
that slice (`systemd-run`, a new unit, a daemon moved to another cgroup, a
kernel module, a cron job, a changed file): such processes and changes are
not found here, and are only guaranteed gone with `cleaning: redfish`,
where the control plane resets the node through its BMC. The same holds for
a process that is in uninterruptible sleep beyond the wait: it is reported
(SessionsNotEnded), not hidden.

Scans alone can miss a process that forks its successor and exits faster
than one scan reads /proc (a chain that re-forks every few milliseconds: the
one a scan lists is gone when it is read, its successor born after the
listing). So for a user other than root, the rounds end with a sweep:
`kill -KILL -1` run as that user, which the kernel delivers to every process
whose real or saved uid is the user's under the process table's lock (a
process being killed cannot fork), then the rounds scan once more. The sweep
cannot leave a process out, so it is made only when none of those is to be
spared (a baseline process still alive, a protected pid's family); root never
sweeps.

Every /proc read goes through a `proc: Path` parameter, so the selection
(`plan`) is tested on a hand-made tree; `end_sessions` signals only with the
real /proc of this process's pid namespace (it checks `proc/self`), and
uses pidfds so that a pid reused between the scan and the signal is never
hit.
"""
from __future__ import annotations

import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import structlog

log = structlog.get_logger("berth.agent.tenantroot")

PROC = Path("/proc")
PF_KTHREAD = 0x00200000  # include/linux/sched.h
SSH_SESSION = "ssh-session"
NEW_PROCESS = "new-process"
SSHD_COMMS = frozenset({"sshd", "sshd-session", "sshd-auth"})
_SSHD_TITLE = re.compile(r"(?:sshd|sshd-session|sshd-auth): ([^\s@/][^\s@]*)")
MAX_ROUNDS = 50


class SessionsError(Exception):
    """Sessions could not be ended as asked; the message says what to do."""


class SessionsNotEnded(SessionsError):
    """Processes were still there after SIGKILL and the bounded wait; `ended` and `survivors` say which."""

    def __init__(self, message: str, ended: list["Ended"], survivors: list["Ended"]) -> None:
        super().__init__(message)
        self.ended = ended
        self.survivors = survivors


@dataclass(frozen=True)
class Proc:
    """What /proc/PID says about one process."""

    pid: int
    ppid: int
    comm: str
    state: str
    flags: int
    starttime: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    title: str  # the command line, NULs as spaces: sshd's process title
    cgroups: tuple[str, ...]  # the paths of /proc/PID/cgroup, one per hierarchy

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD) or self.pid == 2 or self.ppid == 2

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")


@dataclass(frozen=True)
class Ended:
    """One process ended (or to end): pid, comm, the rule that chose it, its real uid and starttime."""

    pid: int
    comm: str
    rule: str
    uid: int
    starttime: int


# -- reading /proc ---------------------------------------------------------------------------------------------


def read_stat(proc: Path, pid: int) -> tuple[str, str, int, int, int] | None:
    """(comm, state, ppid, flags, starttime) from /proc/PID/stat; None once the process is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    left, right = text.find("("), text.rfind(")")
    fields = text[right + 2:].split()
    # after "pid (comm)": state ppid pgrp session tty_nr tpgid flags ... starttime is field 22 of the whole line
    return text[left + 1:right], fields[0], int(fields[1]), int(fields[6]), int(fields[19])


def read_uids(proc: Path, pid: int) -> tuple[int, ...] | None:
    """The Uid: line of /proc/PID/status (real, effective, saved, filesystem); None once gone."""
    try:
        for line in (proc / str(pid) / "status").read_text(errors="replace").splitlines():
            if line.startswith("Uid:"):
                return tuple(int(v) for v in line.split()[1:5])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def read_title(proc: Path, pid: int) -> str:
    """/proc/PID/cmdline with its NULs as spaces (empty for kernel threads and zombies)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", errors="replace").strip()


def read_cgroups(proc: Path, pid: int) -> tuple[str, ...]:
    """The cgroup path of each line of /proc/PID/cgroup (`0::/user.slice/...`, `1:name=systemd:/...`)."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text(errors="replace").splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return ()
    return tuple(line.split(":", 2)[2] for line in lines if line.count(":") >= 2)


def read_process(proc: Path, pid: int) -> Proc | None:
    stat = read_stat(proc, pid)
    uids = read_uids(proc, pid)
    if stat is None or uids is None:
        return None
    comm, state, ppid, flags, starttime = stat
    return Proc(pid=pid, ppid=ppid, comm=comm, state=state, flags=flags, starttime=starttime, uids=uids,
                title=read_title(proc, pid), cgroups=read_cgroups(proc, pid))


def processes(proc: Path = PROC) -> dict[int, Proc]:
    """Every process /proc lists now, by pid (ones that vanish while read are left out)."""
    out = {}
    for entry in os.listdir(proc):
        if entry.isdigit():
            p = read_process(proc, int(entry))
            if p is not None:
                out[p.pid] = p
    return out


# -- choosing --------------------------------------------------------------------------------------------------


def in_user_slice(p: Proc, uid: int) -> bool:
    """Whether a cgroup of the process lies in systemd's `user-UID.slice` (the user's login sessions)."""
    slice_name = f"user-{uid}.slice"
    return any(slice_name in path.split("/") for path in p.cgroups)


def belongs(p: Proc, uid: int) -> bool:
    """Whether rule 2 (and the baseline) counts the process as the user's (root: only in user-0.slice)."""
    if uid == 0:
        return in_user_slice(p, 0)
    return p.uids[0] == uid or p.uids[1] == uid or in_user_slice(p, uid)


def is_ssh_session_of(p: Proc, user: str) -> bool:
    """An sshd per-connection process of the user (not the listener): `sshd: USER [priv]`, `sshd: USER@pts/0`."""
    if p.comm not in SSHD_COMMS or "[listener]" in p.title:
        return False
    m = _SSHD_TITLE.match(p.title)
    return m is not None and m.group(1) == user


def baseline(uid: int, *, proc: Path = PROC) -> frozenset[tuple[int, int]]:
    """(pid, starttime) of each live process that belongs to the user now: what the hand-back leaves alone."""
    return frozenset((p.pid, p.starttime) for p in processes(proc).values()
                     if not p.kernel_thread and not p.dead and belongs(p, uid))


def _family(table: dict[int, Proc], roots: Iterable[int]) -> set[int]:
    """The roots, every process below them and every process above them."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out: set[int] = set()
    for root in roots:
        stack = [root]
        while stack:
            pid = stack.pop()
            if pid not in out:
                out.add(pid)
                stack.extend(children.get(pid, ()))
        up = table.get(root)
        while up is not None and up.ppid not in out and up.ppid > 0:
            out.add(up.ppid)
            up = table.get(up.ppid)
    return out


def plan(user: str, uid: int, baseline: frozenset[tuple[int, int]], *, protect: set[int],
         proc: Path = PROC) -> list[Ended]:
    """What end_sessions would end now, by pid, with the rule that chose each (reads /proc, signals nothing)."""
    table = processes(proc)
    spared = _family(table, protect) | {0, 1, 2}
    chosen: dict[int, str] = {}
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    for p in table.values():
        if is_ssh_session_of(p, user):
            stack = [p.pid]
            while stack:
                pid = stack.pop()
                if pid not in chosen:
                    chosen[pid] = SSH_SESSION
                    stack.extend(children.get(pid, ()))
    for p in table.values():
        if p.pid not in chosen and belongs(p, uid) and (p.pid, p.starttime) not in baseline:
            chosen[p.pid] = NEW_PROCESS
    out = []
    for pid in sorted(chosen):
        p = table[pid]
        if pid in spared or p.kernel_thread or p.dead:
            continue
        out.append(Ended(pid=pid, comm=p.comm, rule=chosen[pid], uid=p.uids[0], starttime=p.starttime))
    return out


# -- ending ----------------------------------------------------------------------------------------------------


def _is_own_procfs(proc: Path) -> bool:
    try:
        return os.readlink(proc / "self") == str(os.getpid())
    except OSError:
        return False


def _open_and_kill(proc: Path, target: Ended) -> int | None:
    """A pidfd of the target after SIGKILL, or None when it is already gone (or its pid now names another)."""
    try:
        fd = os.pidfd_open(target.pid)
    except ProcessLookupError:
        return None
    try:
        stat = read_stat(proc, target.pid)
        if stat is None or stat[4] != target.starttime:
            os.close(fd)
            return None
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sweep_spares_all(uid: int, baseline: frozenset[tuple[int, int]], protect: set[int], proc: Path) -> bool:
    """May the sweep run: would kill(-1) as uid hit no process the hand-back must spare? It hits every process
    whose real or saved uid is uid (the kernel's rule for a signal), and cannot leave any out: so none of those
    may be in the baseline, nor in the protected pids' family (an operator's session as the pool's user, from
    which the agent was started)."""
    table = processes(proc)
    spared = _family(table, protect) | {1}
    return not any((p.pid in spared or (p.pid, p.starttime) in baseline) and uid in (p.uids[0], p.uids[2])
                   for p in table.values() if not p.dead and not p.kernel_thread)


def sweep(uid: int) -> None:
    """SIGKILL every process of uid at once: kill(-1) run as uid (real, effective and saved), which the kernel
    delivers to every process that uid may signal under the process table's lock, so none forks meanwhile."""
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = uid
    kill = shutil.which("kill") or "/bin/kill"
    try:
        subprocess.run([kill, "-KILL", "-1"], user=uid, group=gid, extra_groups=[], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False,
                       close_fds=True, cwd="/")
    except (OSError, subprocess.SubprocessError) as exc:  # the scans' rounds still ran: said, not fatal
        log.warning("tenant_sessions.sweep_failed", uid=uid, error=str(exc))


def end_sessions(user: str, baseline: frozenset[tuple[int, int]], *, protect: set[int], proc: Path = PROC,
                 uid: int | None = None, timeout_s: float = 10.0) -> list[Ended]:
    """SIGKILL the user's ssh sessions (rule 1) and what was started after the baseline (rule 2), wait until
    each is gone (at most timeout_s), and return what was ended; SessionsNotEnded if some are still there."""
    if not _is_own_procfs(proc):
        raise SessionsError(f"{proc} is not this process's /proc: end_sessions signals real processes by pid; "
                            "use plan() to see what it would end in another tree")
    if uid is None:
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            raise SessionsError(f"there is no user {user!r} on this node: its sessions cannot be looked up "
                                "(was the account removed before the hand-back?)") from None
    deadline = time.monotonic() + timeout_s
    signalled: dict[tuple[int, int], Ended] = {}
    waiting: dict[int, Ended] = {}  # pidfd -> target

    def rounds() -> None:
        for _ in range(MAX_ROUNDS):
            fresh = [t for t in plan(user, uid, baseline, protect=protect, proc=proc)
                     if (t.pid, t.starttime) not in signalled]
            if not fresh or time.monotonic() > deadline:
                return
            for target in fresh:
                signalled[(target.pid, target.starttime)] = target
                fd = _open_and_kill(proc, target)
                if fd is not None:  # None: it went (or its pid was reused) before the signal
                    waiting[fd] = target

    try:
        rounds()
        if uid != 0 and _sweep_spares_all(uid, baseline, protect, proc):  # the sweep no fork escapes, and scans
            sweep(uid)
            rounds()
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        pending = set(waiting)
        while pending:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            for fd, _ in poller.poll(left_ms):
                pending.discard(fd)
                poller.unregister(fd)
        survivors = sorted((waiting[fd] for fd in pending), key=lambda t: t.pid)
    finally:
        for fd in waiting:
            os.close(fd)
    ended = sorted((t for t in waiting.values() if t not in survivors), key=lambda t: t.pid)
    log.info("tenant_sessions.ended", user=user, uid=uid, count=len(ended),
             processes=[f"{t.pid}:{t.comm}:{t.rule}" for t in ended])
    if survivors:
        names = ", ".join(f"{t.pid} ({t.comm}, {t.rule})" for t in survivors)
        log.error("tenant_sessions.survivors", user=user, uid=uid, processes=names)
        raise SessionsNotEnded(
            f"{len(survivors)} process(es) of {user} were still there {timeout_s:g}s after SIGKILL: {names}; they "
            "may be in uninterruptible sleep (state D): keep the node out of the pool and reset it "
            "(cleaning: redfish, or a reboot)", ended, survivors)
    return ended
