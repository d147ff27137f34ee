"""`berth exec [--as-root] RESERVATION -- COMMAND...`: run a command inside a reservation on this node, confined.

The reservation must be bound here: the agent's checkpoint in --state-dir
lists it as completed (for this boot) and its cgroup exists below the cgroup
root with the agent's record. The command runs in that cgroup (every
hierarchy), so it gets exactly the reservation's share and device allow-list
and everything it forks stays there (killed when the reservation ends); in
its own cgroup namespace (its /proc/self/cgroup reads `/`); and as the
tenant's workload user from the node's exec policy, with no_new_privs and no
capabilities (agent/confine.py), so it can neither leave the cgroup nor
change any cgroup file nor open a device its reservation does not hold.

Run as root, this process reads the checkpoint and the policy the agent wrote
(`<state-dir>/exec-policy.json`), confines itself and execs the command: that
works while the agent is down. Any other caller asks the agent over its exec
socket, which applies the policy on the caller's kernel credentials and
starts the command with the caller's stdin, stdout and stderr; this process
forwards its signals and exits with the command's status
(agent/execgate.py).

`--as-root` (root callers only, and only where the agent runs with
`--exec-allow-root`) keeps root inside the reservation: root is not confined,
and this says so on stderr.

Exit status: the command's own (128+N when signal N ended it); 2 bad usage;
3 not bound here; 4 not allowed; 5 entering the reservation failed; 126 /
127 the command cannot be run / is not found.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path

from agent import confine, lifetime
from agent.checkpoint import DEFAULT_STATE_DIR, EXEC_SOCKET, Checkpoint, CheckpointError, read_boot_id
from agent.execgate import FORWARDED_SIGNALS, ExecPolicy, NoWorkloadUser, ended_note, not_bound
from cgroups.record import XattrRecords

EXIT_USAGE, EXIT_NOT_BOUND, EXIT_DENIED, EXIT_MOVE = 2, 3, 4, 5

ROOT_WARNING = ("berth exec: WARNING: --as-root: the command runs as root inside reservation {rid}, and root is NOT "
                "confined: it can leave the reservation's cgroup, open any device and change any cgroup on this node "
                "(allowed here by the agent's --exec-allow-root)")


class ExecRefused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="berth exec", description="Run a command inside a reservation on this node, "
                                "confined to its CPU, memory and hugepage share and its devices, as the tenant's "
                                "workload user.",
                                usage="berth exec [--state-dir DIR] [--cgroup-root PATH] [--as-root] RESERVATION -- "
                                      "COMMAND...")
    p.add_argument("--state-dir", default=os.environ.get("BERTH_AGENT_STATE_DIR", DEFAULT_STATE_DIR),
                   help=f"the agent's state directory (default {DEFAULT_STATE_DIR})")
    p.add_argument("--cgroup-root", help="the agent's cgroup root (default: the one its checkpoint names)")
    p.add_argument("--as-root", action="store_true",
                   help="run as root inside the reservation (NOT confined; root callers only, and only where the "
                        "agent runs with --exec-allow-root)")
    p.add_argument("reservation")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise ExecRefused(EXIT_USAGE, "berth exec: put the command after `--`: berth exec RESERVATION -- COMMAND...")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def bound_binding(reservation: str, state_dir: Path, cgroup_root: str | None) -> tuple[str, list[Path]]:
    """(tenant, every cgroup.procs to join, cgroup2's first) of a reservation bound on this node, checked against
    the checkpoint and cgroupfs (root only)."""
    try:
        data = Checkpoint.read(state_dir / "checkpoint.json")
    except CheckpointError as exc:
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: {exc}") from None
    except PermissionError:
        raise ExecRefused(EXIT_DENIED, f"berth exec: cannot read {state_dir}/checkpoint.json") from None
    if data is None:
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: no agent checkpoint in {state_dir}: nothing is bound here "
                                          "(is --state-dir the agent's?)")
    if data.bootId != read_boot_id():
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: the checkpoint in {state_dir} is from an earlier boot: "
                                          "nothing is bound yet")
    entry = data.bindings.get(reservation)
    if entry is None or entry.state != "completed":
        state = "not known" if entry is None else entry.state
        raise ExecRefused(EXIT_NOT_BOUND, "berth exec: " + not_bound(reservation, f" ({state} in {state_dir})"))
    if entry.kind == "kubernetes":
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: reservation {reservation} is a kubernetes binding: the kubelet "
                                          "gives its devices to pods (request its resource in a pod spec), not to "
                                          "berth exec")
    # The binder recorded where it made the cgroup; --cgroup-root only relocates that (the same name below it).
    path = Path(entry.cgroup) if cgroup_root is None else Path(cgroup_root) / Path(entry.cgroup).name
    if not path.is_dir():
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: reservation {reservation}: its cgroup {path} does not exist")
    if not any(XattrRecords(a).read_raw(path) for a in ("trusted.berth.record", "user.berth.record")) and \
            not (state_dir / "records" / f"{path.name}.json").exists():
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: {path} carries no agent record: not a binding of this agent")
    parts = [Path(p) for p in entry.parts if Path(p).is_dir()]
    return entry.tenantId, [d / "cgroup.procs" for d in [path, *parts]]


def workload_user(policy: ExecPolicy | None, tenant: str, as_root: bool, state_dir: Path,
                  reservation: str) -> confine.WorkloadUser | None:
    """Whom the command runs as (None: root, asked for and allowed); ExecRefused otherwise."""
    if policy is None:
        raise ExecRefused(EXIT_DENIED, f"berth exec: no exec policy in {state_dir} (the agent writes "
                                       f"{state_dir}/exec-policy.json when it starts): start the agent first")
    if as_root:
        if not policy.allow_root:
            raise ExecRefused(EXIT_DENIED, "berth exec: --as-root is not allowed on this node: the agent runs "
                                           "without --exec-allow-root. Run without --as-root to use the tenant's "
                                           "workload user")
        print(ROOT_WARNING.format(rid=reservation), file=sys.stderr)
        return None
    try:
        return policy.workload_user(tenant)
    except NoWorkloadUser as exc:
        raise ExecRefused(EXIT_DENIED, f"berth exec: {exc}") from None


# -- callers other than root: through the agent -----------------------------------------------------------------


def _read_line(s: socket.socket, buf: bytearray) -> dict | None:
    while b"\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            return None
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def through_agent(reservation: str, sock_path: Path, command: list[str]) -> int:
    """Ask the agent to start the command in the reservation with this process's stdio; relay signals; return
    the command's exit status."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(15)
        s.connect(str(sock_path))
        request = json.dumps({"reservationId": reservation, "argv": command, "env": dict(os.environ),
                              "cwd": os.getcwd()}).encode() + b"\n"
        sent = socket.send_fds(s, [request], [0, 1, 2])
        if sent < len(request):
            s.sendall(request[sent:])
        buf = bytearray()
        answer = _read_line(s, buf)
    except OSError as exc:
        raise ExecRefused(EXIT_MOVE, f"berth exec: cannot reach the agent at {sock_path}: {exc.strerror or exc} "
                                     "(only root can enter a reservation without it)") from None
    except ValueError:
        answer = None
    if answer is None:
        raise ExecRefused(EXIT_MOVE, f"berth exec: the agent gave no answer on {sock_path}")
    if not answer.get("ok"):
        code = {"NOT_BOUND": EXIT_NOT_BOUND, "ACCESS_DENIED": EXIT_DENIED}.get(answer.get("code"), EXIT_MOVE)
        raise ExecRefused(code, f"berth exec: {answer.get('message')}")

    def forward(signum, _frame) -> None:
        try:
            s.sendall(json.dumps({"signal": signum}).encode() + b"\n")
        except OSError:
            pass

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    s.settimeout(None)
    while True:
        try:
            done = _read_line(s, buf)
        except InterruptedError:  # pragma: no cover - PEP 475 retries recv itself
            continue
        except (OSError, ValueError):
            done = None
        if done is None:
            print(f"berth exec: the agent closed the connection while the command ran (pid {answer.get('pid')}); it "
                  "keeps running in the reservation until it ends or the reservation does; its exit status is "
                  "unknown", file=sys.stderr)
            return EXIT_MOVE
        if "exit" in done:
            if done.get("ended"):
                print(ended_note(reservation, int(done["exit"])), file=sys.stderr)
            return int(done["exit"])


def _stdio_open() -> None:
    """A caller started with a standard descriptor closed (cron, `<&-`) gets /dev/null in its place, so that no
    socket or file this process opens takes fd 0, 1 or 2 and becomes the command's stdin or output."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one, unless a lower is free too
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # os.open's are not: root's path execs the command with it
        if getattr(sys, name) is None:  # Python found it closed at start-up and left sys.<name> None
            setattr(sys, name, open(fd, mode, closefd=False))


def main(argv: list[str] | None = None) -> int:
    _stdio_open()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv and ("-h" in argv or "--help" in argv):
        _parser().print_help()
        return 0
    try:
        opts, command = split_argv(argv)
        try:
            args = _parser().parse_args(opts)
        except SystemExit as exc:  # argparse printed why
            return EXIT_USAGE if exc.code else 0
        if not command:
            raise ExecRefused(EXIT_USAGE, "berth exec: no command after `--`")
        state_dir = Path(args.state_dir)
        if os.geteuid() != 0:
            if args.as_root:
                raise ExecRefused(EXIT_DENIED, "berth exec: --as-root: only root may ask for root inside a "
                                               "reservation")
            return through_agent(args.reservation, state_dir / EXEC_SOCKET, command)
        cwd = os.getcwd()
        tenant, procs = bound_binding(args.reservation, state_dir, args.cgroup_root)
        user = workload_user(ExecPolicy.read(state_dir), tenant, args.as_root, state_dir, args.reservation)
        try:
            confine.enter(procs, user)
        except confine.ConfineError as exc:
            raise ExecRefused(EXIT_MOVE, f"berth exec: {exc}") from None
    except ExecRefused as exc:
        print(str(exc), file=sys.stderr)
        return exc.code
    sys.stdout.flush()
    return confine.run(command, {**os.environ, **lifetime.environment(state_dir, args.reservation)}, cwd, user)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
