"""`berth exec RESERVATION -- COMMAND...`: run a command inside a reservation's cgroup on this node.

The reservation must be bound here: the agent's checkpoint in --state-dir
lists it as completed (for this boot) and its cgroup exists below the
cgroup root with the agent's record. Then this process moves itself into
that cgroup and execs the command, so the workload runs with exactly the
reservation's share and device allow-list, and everything it forks stays
there (killed when the reservation is released).

As root the move is a write to the cgroup's cgroup.procs, and works while the
agent is down. Any other caller asks the agent over its exec socket, which
applies the exec policy on the caller's kernel credentials
(agent/execgate.py). Exit status: the command's own; 2 bad usage; 3 not bound
here; 4 not allowed; 5 the move failed; 126 / 127 the command cannot be run /
is not found.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from agent.checkpoint import DEFAULT_STATE_DIR, EXEC_SOCKET, Checkpoint, CheckpointError, read_boot_id
from cgroups import host
from cgroups.record import XattrRecords

EXIT_USAGE, EXIT_NOT_BOUND, EXIT_DENIED, EXIT_MOVE = 2, 3, 4, 5


class ExecRefused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="berth exec", description="Run a command inside a reservation's cgroup on "
                                "this node (its CPU, memory and hugepage share and its device allow-list).",
                                usage="berth exec [--state-dir DIR] [--cgroup-root PATH] RESERVATION -- COMMAND...")
    p.add_argument("--state-dir", default=os.environ.get("BERTH_AGENT_STATE_DIR", DEFAULT_STATE_DIR),
                   help=f"the agent's state directory (default {DEFAULT_STATE_DIR})")
    p.add_argument("--cgroup-root", help="the agent's cgroup root (default: the one its checkpoint names)")
    p.add_argument("reservation")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise ExecRefused(EXIT_USAGE, "berth exec: put the command after `--`: berth exec RESERVATION -- COMMAND...")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def bound_cgroup(reservation: str, state_dir: Path, cgroup_root: str | None) -> Path:
    """The cgroup of a reservation bound on this node, checked against the checkpoint and cgroupfs (root only)."""
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
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: reservation {reservation} is not bound on this node "
                                          f"({state} in {state_dir})")
    # The binder recorded where it made the cgroup; --cgroup-root only relocates that (the same name below it).
    path = Path(entry.cgroup) if cgroup_root is None else Path(cgroup_root) / Path(entry.cgroup).name
    if not path.is_dir():
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: reservation {reservation}: its cgroup {path} does not exist")
    if not any(XattrRecords(a).read_raw(path) for a in ("trusted.berth.record", "user.berth.record")) and \
            not (state_dir / "records" / f"{path.name}.json").exists():
        raise ExecRefused(EXIT_NOT_BOUND, f"berth exec: {path} carries no agent record: not a binding of this agent")
    return path


def move_self(path: Path) -> None:
    try:
        with open(path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        raise ExecRefused(EXIT_MOVE, f"berth exec: moving into {path}: {exc.strerror}") from None


def ask_agent(reservation: str, sock_path: Path) -> Path:
    """Ask the agent to move this process into the reservation's cgroup (for callers other than root)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(15)
            s.connect(str(sock_path))
            s.sendall(json.dumps({"reservationId": reservation}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
    except OSError as exc:
        raise ExecRefused(EXIT_MOVE, f"berth exec: cannot reach the agent at {sock_path}: {exc.strerror or exc} "
                                     "(only root can enter a cgroup without it)") from None
    try:
        answer = json.loads(buf)
    except ValueError:
        raise ExecRefused(EXIT_MOVE, f"berth exec: the agent gave no answer on {sock_path}") from None
    if not answer.get("ok"):
        code = {"NOT_BOUND": EXIT_NOT_BOUND, "ACCESS_DENIED": EXIT_DENIED}.get(answer.get("code"), EXIT_MOVE)
        raise ExecRefused(code, f"berth exec: {answer.get('message')}")
    return Path(answer["cgroup"])


def check_inside(path: Path) -> None:
    mount = host.cgroup2_mount()
    mine = host.own_cgroup2()
    if mount is not None and (mount / mine.lstrip("/")) != path:
        raise ExecRefused(EXIT_MOVE, f"berth exec: after the move this process is in {mount / mine.lstrip('/')}, "
                                     f"not {path}")


def main(argv: list[str] | None = None) -> int:
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
        if os.geteuid() == 0:
            path = bound_cgroup(args.reservation, state_dir, args.cgroup_root)
            move_self(path)
        else:
            path = ask_agent(args.reservation, state_dir / EXEC_SOCKET)
        check_inside(path)
    except ExecRefused as exc:
        print(str(exc), file=sys.stderr)
        return exc.code
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(f"berth exec: {command[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError as exc:
        print(f"berth exec: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 126
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
