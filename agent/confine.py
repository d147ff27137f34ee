"""How a workload enters a reservation: its cgroup in every hierarchy, a cgroup namespace of its own, and the
tenant's unprivileged user with no_new_privs and no capabilities; then exec.

The order is the point. While still root: write the pid into each cgroup.procs
(only root may), check the move, unshare the cgroup namespace (so it is
rooted at the reservation's cgroup and /proc/self/cgroup shows `/`), empty
the capability bounding set and the ambient set (dropping needs CAP_SETPCAP,
which goes with root). Then the supplementary groups, the gid, the uid (a
change of every uid away from 0 clears the permitted and effective sets), and
no_new_privs last, so no setuid binary or file capability gives back what was
dropped. A workload left that way cannot write its pid anywhere (every
cgroup.procs is root's, mode 0644), cannot open a device its reservation's
device program refuses, and cannot change any cgroup file.

`berth exec` run as root does this in its own process (agent/exec.py); for any
other caller the agent's exec socket starts this module as a launcher
(`python -m agent.confine FD`, the spec as JSON on pipe FD) with the caller's
stdin, stdout and stderr (agent/execgate.py). Root asked for (`--as-root`,
where the node allows it) joins the cgroups and the namespace and keeps root:
it is not confined, and the callers say so.
"""
from __future__ import annotations

import ctypes
import grp
import json
import os
import pwd
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cgroups import host

CLONE_NEWCGROUP = 0x02000000
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

EXIT_MOVE, EXIT_CANNOT_RUN, EXIT_NOT_FOUND = 5, 126, 127


class ConfineError(Exception):
    """A step of entering the reservation failed; the workload was not started."""


@dataclass(frozen=True)
class WorkloadUser:
    """The unprivileged identity a tenant's workloads run as on this node."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    name: str = ""
    home: str = "/"

    @classmethod
    def parse(cls, text: str) -> "WorkloadUser":
        """`USER[:GROUP]`, each a name or a number. A number with no passwd entry is used as it is (its gid the
        same number unless GROUP is given). Root is refused: a tenant's workloads never run as uid or gid 0."""
        user_text, _, group_text = text.partition(":")
        if not user_text:
            raise ValueError(f"{text!r}: expected USER or USER:GROUP (names or numbers)")
        entry = _passwd(user_text)
        if entry is not None:
            uid, gid, name, home = entry.pw_uid, entry.pw_gid, entry.pw_name, entry.pw_dir or "/"
        elif user_text.isdigit():
            uid, gid, name, home = int(user_text), int(user_text), "", "/"
        else:
            raise ValueError(f"{text!r}: no such user {user_text!r}")
        if group_text:
            gid = _gid(group_text)
        if uid == 0 or gid == 0:
            raise ValueError(f"{text!r}: a tenant's workload user must not be root (uid and gid other than 0); "
                             "root inside a reservation is --exec-allow-root with `berth exec --as-root`")
        groups = tuple(sorted(set(os.getgrouplist(name, gid)) - {0})) if name else (gid,)
        return cls(uid, gid, groups or (gid,), name, home)

    def to_wire(self) -> dict:
        return {**asdict(self), "groups": list(self.groups)}

    @classmethod
    def from_wire(cls, doc: Mapping) -> "WorkloadUser":
        return cls(int(doc["uid"]), int(doc["gid"]), tuple(int(g) for g in doc.get("groups", ())),
                   str(doc.get("name", "")), str(doc.get("home", "/")))

    def describe(self) -> str:
        return f"{self.name} (uid {self.uid})" if self.name else f"uid {self.uid}"


def _passwd(text: str):
    try:
        return pwd.getpwuid(int(text)) if text.isdigit() else pwd.getpwnam(text)
    except KeyError:
        return None


def _gid(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no such group {text!r}") from None


# -- the steps --------------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise ConfineError(f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0, arg3: int = 0) -> int:
    return _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(arg3), ctypes.c_ulong(0),
                       ctypes.c_ulong(0))


def join(procs: Sequence[Path | str]) -> None:
    """Write this process into each cgroup.procs (cgroup2's first, then the v1 hierarchies')."""
    for path in procs:
        try:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            raise ConfineError(f"joining {Path(path).parent}: {exc.strerror}") from None


def own_cgroup() -> str:
    """This process's cgroup2 path as /proc/self/cgroup gives it (relative to its cgroup namespace)."""
    try:
        return host.own_cgroup2()
    except Exception as exc:  # CgroupError: no cgroup2 line
        raise ConfineError(str(exc)) from None


def new_cgroup_namespace() -> None:
    """A cgroup namespace rooted where this process now is; afterwards its cgroup reads `/`."""
    _check(_libc.unshare(ctypes.c_int(CLONE_NEWCGROUP)), "unshare(CLONE_NEWCGROUP)")
    if own_cgroup() != "/":
        raise ConfineError(f"after unshare(CLONE_NEWCGROUP) the cgroup reads {own_cgroup()}, not /")


def drop_to(user: WorkloadUser) -> None:
    """Give up root for good: no bounding or ambient capabilities, the user's groups, gid and uid, no_new_privs."""
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        _check(_prctl(PR_CAPBSET_DROP, cap), f"dropping capability {cap} from the bounding set")
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clearing the ambient capabilities")
    try:
        os.setgroups(list(user.groups))
        os.setresgid(user.gid, user.gid, user.gid)
        os.setresuid(user.uid, user.uid, user.uid)
    except OSError as exc:
        raise ConfineError(f"becoming {user.describe()}: {exc.strerror}") from None
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")
    status = capabilities()
    if any(status[k] for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")) or status["NoNewPrivs"] != 1:
        raise ConfineError(f"capabilities left after dropping root: {status}")


def capabilities(pid: int | str = "self") -> dict[str, int]:
    """CapInh, CapPrm, CapEff, CapBnd, CapAmb (as integers) and NoNewPrivs from /proc/PID/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.startswith("Cap"):
            out[key] = int(value.strip(), 16)
        elif key == "NoNewPrivs":
            out[key] = int(value.strip())
    return out


def environment(env: Mapping[str, str], user: WorkloadUser | None) -> dict[str, str]:
    """The caller's environment, with HOME, USER and LOGNAME of the workload's user."""
    out = dict(env)
    if user is not None:
        out["HOME"] = user.home
        out["USER"] = out["LOGNAME"] = user.name or str(user.uid)
    return out


def ordinary_oom_score() -> None:
    """The OOM score of a process started from a login, 0: a workload started through the agent's socket inherited
    the agent's, which its unit protects (OOMScoreAdjust=-900), and a host short of memory killed sshd before it.
    Raising it is always allowed; where the caller's was higher and lowering it is not (no CAP_SYS_RESOURCE), it
    stays higher: less protected, never more."""
    try:
        Path("/proc/self/oom_score_adj").write_text("0")
    except OSError:
        pass


def enter(procs: Sequence[Path | str], user: WorkloadUser | None) -> None:
    """All the steps up to exec: the ordinary OOM score, join, check, namespace, and (user given) drop root.
    ConfineError on failure."""
    ordinary_oom_score()
    join(procs)
    expected = Path(procs[0]).parent
    mount = host.cgroup2_mount()
    here = (mount / own_cgroup().lstrip("/")) if mount is not None else None
    if here != expected:
        raise ConfineError(f"after joining, this process is in {here}, not {expected}")
    new_cgroup_namespace()
    if user is not None:
        drop_to(user)


def run(argv: Sequence[str], env: Mapping[str, str], cwd: str | None, user: WorkloadUser | None,
        err=None) -> int:
    """chdir (the caller's directory, else the user's home, else /) and exec; returns only when exec failed."""
    err = err or sys.stderr
    for d in ([cwd] if cwd else []) + [user.home if user else "/", "/"]:
        try:
            os.chdir(d)
            break
        except OSError:
            continue
    if cwd and os.getcwd() != cwd:
        print(f"berth exec: {cwd} is not reachable as {user.describe() if user else 'root'}; "
              f"running in {os.getcwd()}", file=err)
    err.flush()
    env = environment(env, user)
    # Searched as the user (a PATH entry it cannot enter is skipped, as a shell does, instead of EACCES).
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if program is None:
        print(f"berth exec: {argv[0]}: command not found", file=err)
        return EXIT_NOT_FOUND
    try:
        os.execve(program, list(argv), env)
    except FileNotFoundError:
        print(f"berth exec: {argv[0]}: command not found", file=err)
        return EXIT_NOT_FOUND
    except PermissionError as exc:
        print(f"berth exec: {argv[0]}: {exc.strerror}", file=err)
        return EXIT_CANNOT_RUN
    except OSError as exc:
        print(f"berth exec: {argv[0]}: {exc.strerror}", file=err)
        return EXIT_CANNOT_RUN
    return 0  # pragma: no cover - exec does not return


# -- the launcher the agent starts for callers other than root ------------------------------------------------


def spec(procs: Sequence[Path | str], user: WorkloadUser | None, argv: Sequence[str], env: Mapping[str, str],
         cwd: str | None) -> bytes:
    return json.dumps({"procs": [str(p) for p in procs], "user": user.to_wire() if user else None,
                       "argv": list(argv), "env": dict(env), "cwd": cwd}).encode()


def launch(fd: int) -> int:
    """Read the spec from fd, enter, exec. Errors go to stderr (the caller's) with the exit status of berth exec."""
    with os.fdopen(fd, "rb") as f:
        doc = json.loads(f.read())
    user = WorkloadUser.from_wire(doc["user"]) if doc.get("user") else None
    try:
        enter(doc["procs"], user)
    except ConfineError as exc:
        print(f"berth exec: {exc}", file=sys.stderr)
        return EXIT_MOVE
    return run(doc["argv"], doc["env"], doc.get("cwd"), user)


if __name__ == "__main__":  # pragma: no cover - run by the agent as a separate process
    sys.exit(launch(int(sys.argv[1])))
