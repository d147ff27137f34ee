"""Who may run work in a reservation's cgroup, and the agent's socket that moves a permitted caller there.

The rule (`ExecPolicy`), decided per call on the caller's kernel-reported
credentials:

- root (uid 0) may use any reservation bound on this node;
- a uid given with `--exec-allow-uid UID` may use any of them;
- a member (primary or supplementary group) of a group given with
  `--exec-allow-group NAME|GID` may use any of them;
- a uid given with `--exec-tenant-uid TENANT=UID` may use that tenant's
  reservations only;
- nobody else.

Moving a process into a cgroup needs write access to cgroup.procs there and
at the common ancestor, which only root has. So a non-root `berth exec`
connects to the agent's unix socket (`<state-dir>/exec.sock`, mode 0666); the
agent reads the caller's pid, uid and groups from the kernel (SO_PEERCRED and
/proc/<pid>/status, which the caller cannot forge), applies the rule, and
writes the pid into the reservation's cgroup.procs. The caller then checks
/proc/self/cgroup and execs its command. One JSON line each way:
`{"reservationId": "rsv_..."}` -> `{"ok": true, "cgroup": "/sys/fs/cgroup/..."}` or
`{"ok": false, "code": "NOT_BOUND"|"ACCESS_DENIED"|"FAILED"|"INVALID_INPUT", "message": "..."}`.
"""
from __future__ import annotations

import asyncio
import grp
import json
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import structlog

log = structlog.get_logger("berth.agent.exec")


@dataclass(frozen=True)
class ExecPolicy:
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    tenant_uids: Mapping[str, frozenset[int]] = field(default_factory=dict)

    @classmethod
    def from_options(cls, uids: list[str] | None = None, groups: list[str] | None = None,
                     tenant_uids: list[str] | None = None) -> "ExecPolicy":
        """From the agent's flags; a bad value is ValueError naming it."""
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
        return cls(allow_uids, frozenset(gids), {t: frozenset(u) for t, u in per_tenant.items()})

    def refusal(self, uid: int, gids: set[int], tenant_id: str) -> str | None:
        """None when (uid, gids) may use a reservation of tenant_id; otherwise why not."""
        if uid == 0 or uid in self.allow_uids or gids & self.allow_gids:
            return None
        if uid in self.tenant_uids.get(tenant_id, frozenset()):
            return None
        return (f"uid {uid} may not run work in reservations of tenant {tenant_id!r} on this node; allowed are root, "
                "the agent's --exec-allow-uid and --exec-allow-group, and --exec-tenant-uid "
                f"{tenant_id}=UID")

    def to_wire(self) -> dict:
        return {"allowUids": sorted(self.allow_uids), "allowGids": sorted(self.allow_gids),
                "tenantUids": {t: sorted(u) for t, u in sorted(self.tenant_uids.items())}}


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


@dataclass(frozen=True)
class Target:
    """A reservation bound here, as the gate needs it."""

    tenant_id: str
    name: str  # the cgroup name (rsv-<id>)
    path: Path


class ExecGate:
    """The agent's exec socket: move a permitted caller into a bound reservation's cgroup."""

    def __init__(self, path: Path, policy: ExecPolicy, lookup: Callable[[str], Target | None],
                 move: Callable[[str, int], None], proc: Path = Path("/proc")) -> None:
        self.path = Path(path)
        self.policy = policy
        self.lookup = lookup
        self.move = move
        self.proc = proc
        self.log = log  # the runtime binds node_id
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o666)  # anyone may ask; the policy decides on the kernel's credentials

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            answer = await asyncio.to_thread(self.decide, line, writer.get_extra_info("socket"))
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def decide(self, line: bytes, sock: socket.socket) -> dict:
        pid, uid, _gid = peer_credentials(sock)
        try:
            rid = json.loads(line)["reservationId"]
            if not isinstance(rid, str) or not rid:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return {"ok": False, "code": "INVALID_INPUT", "message": 'expected {"reservationId": "..."}'}
        elog = self.log.bind(reservation_id=rid, pid=pid, uid=uid)
        target = self.lookup(rid)
        if target is None:
            return {"ok": False, "code": "NOT_BOUND", "message": f"reservation {rid} is not bound on this node"}
        try:
            gids = groups_of(pid, self.proc)
        except OSError:
            return {"ok": False, "code": "FAILED", "message": f"cannot read the credentials of pid {pid}"}
        why = self.policy.refusal(uid, gids, target.tenant_id)
        if why:
            elog.warning("exec refused", reason=why)
            return {"ok": False, "code": "ACCESS_DENIED", "message": why}
        try:
            self.move(target.name, pid)
        except Exception as exc:  # the cgroup went away meanwhile, or the kernel refused
            elog.error("exec move failed", error=str(exc))
            return {"ok": False, "code": "FAILED", "message": f"moving pid {pid} into {target.path}: {exc}"}
        elog.info("exec admitted", cgroup=str(target.path))
        return {"ok": True, "cgroup": str(target.path)}
