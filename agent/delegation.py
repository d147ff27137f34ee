"""Where the agent and its workloads live in cgroupfs, so that restarting the agent never touches tenant work.

Two layouts (`resolve`):

- **Given root** (`--cgroup-root PATH`): workloads are `PATH/rsv-*`. When PATH
  lies below the agent's own cgroup (the cgroup systemd delegated to its unit,
  or one a test made), that own cgroup is the agent's delegated subtree: the
  agent moves itself (and anything else there) into the leaf `<own>/agent`, so
  the own cgroup may pass controllers down (cgroup v2 allows controllers only
  above leaves), and switches controllers on from there (`enable_from`).
- **Under systemd, no root given**: the agent keeps itself in the leaf `<unit>/agent` of its own delegated unit
  cgroup, and workloads go in a separate delegated scope,
  `berth.slice/berth-workloads.scope/workloads/rsv-*`, which the agent starts
  once per boot with `systemd-run --scope -p Delegate=yes` around a tiny keeper
  (`sleep infinity` in the leaf `keeper`). A scope is never restarted, so
  `systemctl restart berth-agent` (which kills the agent's unit cgroup) and
  `systemctl daemon-reload` (which re-applies unit settings to unit cgroups
  but never reaches into a delegated subtree) leave it alone. This is also
  why the workloads are not below the agent's own unit cgroup by default:
  systemd before v254 (no `DelegateSubgroup=`) starts a restarted service's
  main process in the unit's top cgroup, which fails (219/CGROUP, systemd
  issue #24064) while that cgroup passes controllers to populated children.

The agent writes only in its own delegated cgroup (to leave it for a leaf),
in the workloads scope, and, where the operator says so with
`--cgroup-enable-from`, the `cgroup.subtree_control` of the cgroups from there
down (hugetlb, which systemd does not delegate).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from agent.errors import AgentError
from cgroups import host
from cgroups.files import parse_pids, read_file, write_file

AGENT_LEAF = "agent"
WORKLOADS = "workloads"
SCOPE_SLICE = "berth.slice"
SCOPE_UNIT = "berth-workloads.scope"
KEEPER_LEAF = "keeper"
KEEPER_SH = ('d="$1$(sed -n "s/^0:://p" /proc/self/cgroup)"; mkdir -p "$d/keeper" && '
             'echo $$ > "$d/keeper/cgroup.procs" && exec sleep infinity')


class LayoutError(AgentError):
    """The cgroup layout cannot be set up; the message says which setting to change."""


@dataclass(frozen=True)
class Layout:
    mount: Path  # where cgroup2 is mounted
    own: Path  # the agent's own cgroup directory at start
    root: Path  # the workloads subtree (rsv-* below it)
    enable_from: Path | None  # the highest cgroup whose subtree_control the agent may write
    leaf: Path | None  # where the agent moves itself, when its own cgroup is delegated to it
    scope: Path | None = None  # the workloads scope, in the systemd layout

    def to_wire(self) -> dict:
        return {k: (str(v) if v is not None else None) for k, v in self.__dict__.items()}


def under_systemd(env: Mapping[str, str] | None = None) -> bool:
    """Started by systemd as a service (INVOCATION_ID is set for every unit it runs) on a systemd host."""
    env = os.environ if env is None else env
    return bool(env.get("INVOCATION_ID")) and Path("/run/systemd/system").is_dir()


def _below(path: Path, top: Path) -> bool:
    try:
        path.relative_to(top)
        return path != top
    except ValueError:
        return False


def resolve(cgroup_root: str | None, enable_from: str | None = None, *, proc: Path = Path("/proc"),
            systemd: bool | None = None) -> Layout:
    mount = host.cgroup2_mount(proc)
    if mount is None:
        raise LayoutError("cgroup2 is not mounted on this host; the agent enforces shares with cgroup v2 only "
                          "(a unified host mounts it at /sys/fs/cgroup, a hybrid one at /sys/fs/cgroup/unified)")
    own = mount / host.own_cgroup2(proc).lstrip("/")
    scope = None
    if cgroup_root:
        root = Path(cgroup_root)
        if not _below(root, mount):
            raise LayoutError(f"--cgroup-root {root} is not below the cgroup2 mount {mount}")
    elif under_systemd() if systemd is None else systemd:
        scope = mount / SCOPE_SLICE / SCOPE_UNIT
        root = scope / WORKLOADS
    elif own != mount:
        root = own / WORKLOADS
    else:
        raise LayoutError(f"give --cgroup-root: this agent runs in the cgroup2 root ({mount}), which it does not "
                          "own; point it at a cgroup below one delegated to it")
    delegated_own = own != mount and _below(root, own)
    top = Path(enable_from) if enable_from else (own if delegated_own else scope)
    if enable_from and not (top == mount or _below(top, mount)):
        raise LayoutError(f"--cgroup-enable-from {top} is not on the cgroup2 hierarchy, which this host mounts at "
                          f"{mount}: give {mount} or a cgroup below it (on a hybrid host, /sys/fs/cgroup holds the v1 "
                          "hierarchies, whose controllers need no enabling)")
    if top is not None and not (top == root or _below(root, top)):
        raise LayoutError(f"--cgroup-enable-from {top} is not an ancestor of the cgroup root {root}")
    # Under systemd the unit's own cgroup is delegated too (Delegate=yes): the agent keeps itself in a leaf of it,
    # so the unit's top stays empty (systemd's .control subgroup, and any layout change, stay possible).
    leaf = own / AGENT_LEAF if delegated_own or (scope is not None and own != mount) else None
    return Layout(mount, own, root, top, leaf, scope)


def claim(root: Path, proc: Path = Path("/proc")) -> int:
    """Hold the cgroup root for this agent's life: an flock on its directory, which the kernel drops when the process
    ends (close-on-exec, so no workload keeps it). A second agent given the same --cgroup-root with a state directory
    of its own took every reservation cgroup there for a leftover and removed it, killing the first's workloads.
    Returns the descriptor to keep open."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _flock_holder(os.fstat(fd), proc)
        os.close(fd)
        raise LayoutError(f"--cgroup-root {root} is in use by another agent"
                          + (f" (pid {holder})" if holder else "")
                          + ": give each agent on a host a --cgroup-root and a --state-dir of its own") from None
    return fd


def _flock_holder(st: os.stat_result, proc: Path) -> int | None:
    """The pid holding an flock on the file `st` is of, from /proc/locks (None if not found there)."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = (proc / "locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            return int(fields[4]) if fields[4].isdigit() else None
    return None


def enter_leaf(layout: Layout) -> list[int]:
    """Move every process of the agent's own (delegated) cgroup into its leaf; returns the pids moved."""
    if layout.leaf is None:
        return []
    layout.leaf.mkdir(exist_ok=True)
    moved = []
    for pid in parse_pids(read_file(layout.own, "cgroup.procs")):
        try:
            write_file(layout.leaf, "cgroup.procs", str(pid))
            moved.append(pid)
        except Exception:
            if pid == os.getpid():
                raise
    return moved


def scope_command(mount: Path) -> list[str]:
    """The systemd-run line that starts the workloads scope around its keeper."""
    return ["systemd-run", "--scope", "--quiet", f"--unit={SCOPE_UNIT}", f"--slice={SCOPE_SLICE}",
            "--property=Delegate=yes", "--description=Berth tenant workloads (outlive agent restarts)",
            "/bin/sh", "-c", KEEPER_SH, "berth-keeper", str(mount)]


def ensure_scope(layout: Layout, timeout_s: float = 10.0) -> bool:
    """Start the workloads scope unless it exists; True when this call started it."""
    if layout.scope is None or layout.scope.is_dir():
        return False
    if shutil.which("systemd-run") is None:
        raise LayoutError("systemd-run is not installed: cannot start the workloads scope; give --cgroup-root")
    proc = subprocess.Popen(scope_command(layout.mount), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    keeper = layout.scope / KEEPER_LEAF
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if keeper.is_dir() and parse_pids(read_file(keeper, "cgroup.procs")):
            return True
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise LayoutError(f"systemd-run could not start {SCOPE_UNIT} (exit {proc.returncode}): {err}")
        time.sleep(0.02)
    raise LayoutError(f"{SCOPE_UNIT} did not come up within {timeout_s}s (no keeper in {keeper})")
