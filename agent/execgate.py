"""Who may run work in a reservation, as whom, and the agent's socket that starts it there for callers other than
root.

The rule (`ExecPolicy`), decided per call on the caller's kernel-reported
credentials:

- root (uid 0) may use any reservation bound on this node;
- a uid given with `--exec-allow-uid UID` may use any of them;
- a member (primary or supplementary group) of a group given with
  `--exec-allow-group NAME|GID` may use any of them;
- a tenant's workload user (`--exec-tenant-user TENANT=USER[:GROUP]`), and a
  uid given with `--exec-tenant-uid TENANT=UID`, may use that tenant's
  reservations only;
- nobody else.

Whoever asks, the workload runs as the tenant's workload user (confined:
agent/confine.py); a tenant without one cannot run work here, and says how
to add one. Root inside a reservation (`berth exec --as-root`, root callers
only) needs `--exec-allow-root`. The agent writes the policy to
`<state-dir>/exec-policy.json`, where `berth exec` run as root reads it.

Entering a cgroup needs write access to cgroup.procs, which only root has, so
a caller other than root connects to the agent's unix socket
(`<state-dir>/exec.sock`, mode 0666) and sends one JSON line,
`{"reservationId": ..., "argv": [...], "env": {...}, "cwd": ...}`, with its
stdin, stdout and stderr attached (SCM_RIGHTS). The agent reads the caller's
pid, uid and groups from the kernel (SO_PEERCRED and /proc/<pid>/status,
which the caller cannot forge), applies the rule, and starts the confining
launcher with those three descriptors. Answers, one JSON line each:
`{"ok": true, "cgroup": ..., "pid": N, "user": ...}` then `{"exit": CODE}`
(128+N for a signal; with `"ended": true` when the reservation was no longer
bound once the command had ended: the agent stopped it at the end), or `{"ok": false, "code": "NOT_BOUND"|"ACCESS_DENIED"|
"FAILED"|"INVALID_INPUT", "message": ...}`. While it runs the caller may send
`{"signal": N}` (forwarded to the workload's process group); a caller that
goes away sends SIGHUP, as a closed terminal does.
"""
from __future__ import annotations

import asyncio
import grp
import json
import os
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import structlog

from agent import lifetime
from agent.checkpoint import write_atomic
from agent.confine import WorkloadUser, spec

log = structlog.get_logger("berth.agent.exec")

EXEC_POLICY_FILE = "exec-policy.json"
MAX_REQUEST = 1 << 20  # argv and environment of one call
FORWARDED_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                               signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT})


class NoWorkloadUser(Exception):
    """The tenant has no workload user on this node (so no work of it may run here)."""


@dataclass(frozen=True)
class ExecPolicy:
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    tenant_uids: Mapping[str, frozenset[int]] = field(default_factory=dict)
    tenant_users: Mapping[str, WorkloadUser] = field(default_factory=dict)
    allow_root: bool = False

    @classmethod
    def from_options(cls, uids: list[str] | None = None, groups: list[str] | None = None,
                     tenant_uids: list[str] | None = None, tenant_users: list[str] | None = None,
                     allow_root: bool = False) -> "ExecPolicy":
        """From the agent's flags; a bad value is ValueError naming the flag and the value."""
        allow_uids = frozenset(_uid(u) for u in (uids or []))
        gids = set()
        for g in groups or []:
            if g.isdigit():
                gids.add(int(g))
            else:
                try:
                    gids.add(grp.getgrnam(g).gr_gid)
                except KeyError:
                    raise ValueError(f"--exec-allow-group {g}: no such group") from None
        per_tenant: dict[str, set[int]] = {}
        for item in tenant_uids or []:
            tenant, sep, uid = item.partition("=")
            if not sep or not tenant:
                raise ValueError(f"--exec-tenant-uid {item!r}: expected TENANT=UID")
            per_tenant.setdefault(tenant, set()).add(_uid(uid))
        users: dict[str, WorkloadUser] = {}
        for item in tenant_users or []:
            tenant, sep, user = item.partition("=")
            if not sep or not tenant:
                raise ValueError(f"--exec-tenant-user {item!r}: expected TENANT=USER or TENANT=USER:GROUP")
            if tenant in users:
                raise ValueError(f"--exec-tenant-user {item!r}: tenant {tenant!r} is given twice")
            try:
                users[tenant] = WorkloadUser.parse(user)
            except ValueError as exc:
                raise ValueError(f"--exec-tenant-user {exc}") from None
        return cls(allow_uids, frozenset(gids), {t: frozenset(u) for t, u in per_tenant.items()}, users,
                   bool(allow_root))

    def refusal(self, uid: int, gids: set[int], tenant_id: str) -> str | None:
        """None when (uid, gids) may start work in a reservation of tenant_id; otherwise why not."""
        if uid == 0 or uid in self.allow_uids or gids & self.allow_gids:
            return None
        own = self.tenant_users.get(tenant_id)
        if uid in self.tenant_uids.get(tenant_id, frozenset()) or (own is not None and own.uid == uid):
            return None
        return (f"uid {uid} may not run work in reservations of tenant {tenant_id!r} on this node; allowed are root, "
                "the agent's --exec-allow-uid and --exec-allow-group, the tenant's --exec-tenant-user and "
                f"--exec-tenant-uid {tenant_id}=UID")

    def workload_user(self, tenant_id: str) -> WorkloadUser:
        """The user the tenant's work runs as here; NoWorkloadUser (saying how to map one) if it has none."""
        user = self.tenant_users.get(tenant_id)
        if user is None:
            raise NoWorkloadUser(
                f"tenant {tenant_id!r} has no workload user on this node, so none of its work may run here: the "
                f"operator maps one with the agent's --exec-tenant-user {tenant_id}=USER (in BERTH_AGENT_OPTS, "
                "/etc/berth/agent.env; see docs/agent.md, \"berth exec\")")
        return user

    def to_wire(self) -> dict:
        return {"allowUids": sorted(self.allow_uids), "allowGids": sorted(self.allow_gids),
                "tenantUids": {t: sorted(u) for t, u in sorted(self.tenant_uids.items())},
                "tenantUsers": {t: u.to_wire() for t, u in sorted(self.tenant_users.items())},
                "allowRoot": self.allow_root}

    @classmethod
    def from_wire(cls, doc: Mapping) -> "ExecPolicy":
        return cls(frozenset(doc.get("allowUids", ())), frozenset(doc.get("allowGids", ())),
                   {t: frozenset(u) for t, u in doc.get("tenantUids", {}).items()},
                   {t: WorkloadUser.from_wire(u) for t, u in doc.get("tenantUsers", {}).items()},
                   bool(doc.get("allowRoot", False)))

    def write(self, state_dir: Path) -> Path:
        """Write the policy where `berth exec` run as root reads it (atomically; mode 0644, it holds no secret)."""
        path = Path(state_dir) / EXEC_POLICY_FILE
        write_atomic(path, (json.dumps(self.to_wire(), indent=2) + "\n").encode(), mode=0o644)  # no .tmp left
        return path

    @classmethod
    def read(cls, state_dir: Path) -> "ExecPolicy | None":
        """The policy the agent last wrote in state_dir; None if it never did."""
        try:
            return cls.from_wire(json.loads((Path(state_dir) / EXEC_POLICY_FILE).read_text()))
        except FileNotFoundError:
            return None


def _uid(text: str) -> int:
    try:
        uid = int(text)
    except ValueError:
        import pwd

        try:
            return pwd.getpwnam(text).pw_uid
        except KeyError:
            raise ValueError(f"uid {text!r}: not a number and no such user") from None
    if uid < 0:
        raise ValueError(f"uid {text!r} is negative")
    return uid


def groups_of(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """The real and effective gid and supplementary groups of a process (/proc/<pid>/status)."""
    out: set[int] = set()
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("Gid:"):
            out.update(int(x) for x in line.split()[1:3])
        elif line.startswith("Groups:"):
            out.update(int(x) for x in line.split()[1:])
    return out


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket, as the kernel recorded at connect()."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", data)


def exit_code(returncode: int) -> int:
    """A wait status as a shell gives it: the exit status, or 128 + the signal that ended it."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass(frozen=True)
class Target:
    """A reservation bound here, as the gate needs it."""

    tenant_id: str
    name: str  # the cgroup name (rsv-<id>)
    path: Path
    procs: tuple[Path, ...] = ()  # every cgroup.procs to write, cgroup2's first

    def procs_or_default(self) -> tuple[Path, ...]:
        return self.procs or (self.path / "cgroup.procs",)


@dataclass
class Call:
    """One caller's request, read off the socket with the descriptors it sent."""

    pid: int
    uid: int
    doc: dict
    fds: list[int]

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def read_call(conn: socket.socket, timeout_s: float = 5.0) -> Call:
    """The first line and the three descriptors (blocking, with a timeout). Refused on a malformed request."""
    pid, uid, _ = peer_credentials(conn)
    conn.settimeout(timeout_s)
    buf, fds = b"", []
    try:
        while not buf.endswith(b"\n"):
            data, got, _flags, _ = socket.recv_fds(conn, 65536, 3)
            fds += got
            if not data:
                break
            buf += data
            if len(buf) > MAX_REQUEST:
                raise Refused("INVALID_INPUT", f"the request is longer than {MAX_REQUEST} bytes (argv and environment)")
        call = Call(pid, uid, {}, fds)
        try:
            doc = json.loads(buf)
        except ValueError:
            raise Refused("INVALID_INPUT", 'expected one JSON line: {"reservationId": ..., "argv": [...], ...}') \
                from None
        _check_call(doc, fds)
        call.doc = doc
        return call
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _check_call(doc, fds: list[int]) -> None:
    if not isinstance(doc, dict):
        raise Refused("INVALID_INPUT", "the request must be a JSON object")
    rid, argv, env, cwd = doc.get("reservationId"), doc.get("argv"), doc.get("env", {}), doc.get("cwd")
    if not isinstance(rid, str) or not rid:
        raise Refused("INVALID_INPUT", "reservationId: a non-empty string is required")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise Refused("INVALID_INPUT", "argv: a non-empty list of strings is required")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) and "=" not in k
                                            and "\0" not in k + v for k, v in env.items()):
        raise Refused("INVALID_INPUT", "env: an object of strings is required")
    if cwd is not None and not isinstance(cwd, str):
        raise Refused("INVALID_INPUT", "cwd: a string is required")
    if len(fds) != 3:
        raise Refused("INVALID_INPUT", f"stdin, stdout and stderr must come with the request (got {len(fds)} "
                                       "descriptors)")


class ExecGate:
    """The agent's exec socket: start a permitted caller's command, confined, in a bound reservation."""

    def __init__(self, path: Path, policy: ExecPolicy, lookup: Callable[[str], Target | None],
                 proc: Path = Path("/proc"), python: str = sys.executable) -> None:
        self.path = Path(path)
        self.policy = policy
        self.lookup = lookup
        self.proc = proc
        self.python = python
        self.log = log  # the runtime binds node_id
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._sessions: set[asyncio.Task] = set()

    async def start(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o666)  # anyone may ask; the policy decides on the kernel's credentials
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.ensure_future(self._accept())

    async def stop(self) -> None:
        """Stop answering. Workloads already started keep running in their reservations; their callers see the
        connection close without an exit status."""
        tasks = [t for t in (self._accepting, *self._sessions) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: say so once a second at most, keep serving
                self.log.warning("exec socket accept failed", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            task = asyncio.ensure_future(self._session(conn))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    async def _session(self, conn: socket.socket) -> None:
        try:
            try:
                call = await asyncio.to_thread(read_call, conn)
            except Refused as exc:
                await self._send(conn, {"ok": False, "code": exc.code, "message": str(exc)})
                return
            except (OSError, TimeoutError):
                return
            conn.setblocking(False)
            try:
                target, user = await asyncio.to_thread(self.decide, call)
                started = await self._launch(call, target, user)
            except Refused as exc:
                await self._send(conn, {"ok": False, "code": exc.code, "message": str(exc)})
                return
            finally:
                call.close_fds()
            await self._relay(conn, started, call, target, user)
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()

    def decide(self, call: Call) -> tuple[Target, WorkloadUser]:
        """The target and the user the workload runs as; Refused with the reason."""
        rid = call.doc["reservationId"]
        target = self.lookup(rid)
        if target is None:
            raise Refused("NOT_BOUND", not_bound(rid))
        try:
            gids = groups_of(call.pid, self.proc)
        except OSError:
            raise Refused("FAILED", f"cannot read the credentials of pid {call.pid}") from None
        why = self.policy.refusal(call.uid, gids, target.tenant_id)
        if why:
            self.log.warning("exec refused", reservation_id=rid, pid=call.pid, uid=call.uid, reason=why)
            # the operator's line names the tenant; the caller, who may not use the reservation, does not learn it
            raise Refused("ACCESS_DENIED", f"uid {call.uid} may not run work in reservation {rid} on this node; the "
                                           "node's operator allows it with the agent's --exec-allow-uid or "
                                           "--exec-allow-group, or --exec-tenant-user / --exec-tenant-uid for the "
                                           "reservation's tenant")
        try:
            return target, self.policy.workload_user(target.tenant_id)
        except NoWorkloadUser as exc:
            self.log.warning("exec refused", reservation_id=rid, pid=call.pid, uid=call.uid, reason=str(exc))
            raise Refused("ACCESS_DENIED", str(exc)) from None

    async def _launch(self, call: Call, target: Target, user: WorkloadUser) -> asyncio.subprocess.Process:
        r, w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "agent.confine", str(r), stdin=call.fds[0], stdout=call.fds[1],
                stderr=call.fds[2], pass_fds=(r,), start_new_session=True, cwd="/", env=_launcher_env())
        except OSError as exc:
            os.close(r)
            os.close(w)
            raise Refused("FAILED", f"starting the launcher: {exc}") from None
        os.close(r)
        with os.fdopen(w, "wb") as f:
            env = {**call.doc.get("env", {}), **lifetime.environment(self.path.parent, call.doc["reservationId"])}
            f.write(spec(target.procs_or_default(), user, call.doc["argv"], env, call.doc.get("cwd")))
        self.log.info("exec started", reservation_id=call.doc["reservationId"], caller_uid=call.uid,
                      pid=proc.pid, user=user.describe(), cgroup=str(target.path))
        return proc

    async def _relay(self, conn: socket.socket, proc: asyncio.subprocess.Process, call: Call, target: Target,
                     user: WorkloadUser) -> None:
        """Tell the caller it started; forward its signals; tell it the exit status."""
        loop = asyncio.get_running_loop()
        await self._send(conn, {"ok": True, "cgroup": str(target.path), "pid": proc.pid, "user": user.describe()})
        waiting = asyncio.ensure_future(proc.wait())
        buf = b""
        caller_gone = False
        try:
            while not waiting.done() and not caller_gone:
                reading = asyncio.ensure_future(loop.sock_recv(conn, 4096))
                await asyncio.wait({waiting, reading}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    reading.cancel()
                    await asyncio.gather(reading, return_exceptions=True)
                    break
                try:
                    data = reading.result()
                except OSError:
                    data = b""
                if not data:
                    caller_gone = True
                    _signal_group(proc.pid, signal.SIGHUP)
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    _forward(proc.pid, line)
            rc = await waiting
        except asyncio.CancelledError:
            waiting.cancel()
            raise
        code = exit_code(rc)
        # killed by a signal with the reservation unbound (or being unbound): its end stopped it
        ended = code >= 128 and self.lookup(call.doc["reservationId"]) is None
        self.log.info("exec ended", reservation_id=call.doc["reservationId"], pid=proc.pid, exit=code,
                      caller_gone=caller_gone, reservation_ended=ended)
        if not caller_gone:
            await self._send(conn, {"exit": code, **({"ended": True} if ended else {})})

    async def _send(self, conn: socket.socket, doc: dict) -> None:
        data = json.dumps(doc).encode() + b"\n"
        if conn.gettimeout() != 0.0:
            conn.setblocking(False)
        await asyncio.get_running_loop().sock_sendall(conn, data)


def not_bound(rid: str, detail: str = "") -> str:
    """Why a reservation cannot be entered here, and where to look: the same words from the socket and as root."""
    return (f"reservation {rid} is not bound on this node{detail}: it may not have started yet, be placed on another "
            f"node, or have ended; see its state, window and nodes: berth reservations get {rid}")


def ended_note(rid: str, code: int) -> str:
    """What `berth exec` says when the reservation ended under the command: not an OOM kill or a stray signal."""
    return (f"berth exec: reservation {rid} ended while the command ran (its window ended, it was released, or its "
            f"node was given up): the agent stopped every process in it (exit {code})")


def _launcher_env() -> dict[str, str]:
    """The agent's environment, with the directory this package is imported from first on the path (the launcher
    starts in /, and the agent may run from a checkout)."""
    here = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


def _forward(pid: int, line: bytes) -> None:
    try:
        sig = int(json.loads(line)["signal"])
    except (ValueError, KeyError, TypeError):
        return
    if sig in FORWARDED_SIGNALS:
        _signal_group(pid, sig)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
