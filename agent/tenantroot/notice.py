"""A message to a tenant's login sessions on a node (`binding: node`), as wall(1) writes one: reservation.ending.

The terminals are found two ways, and both must agree that the terminal is
the user's: the pty of each of the user's sshd sessions (its process title,
`sshd: USER@pts/N`), and, for a user other than root, every /dev/pts entry
the user owns (sshd and login chown a session's pty to its user). Each is
written only when it is a character device owned by the user's uid at the
moment it is opened (O_NOCTTY, O_NONBLOCK: a stuck terminal never blocks the
agent, and the agent never takes one as its controlling terminal), so a
message never reaches another user's terminal.
"""
from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

import structlog

from agent.tenantroot.sessions import PROC, is_ssh_session_of, processes

log = structlog.get_logger("berth.agent.tenantroot")

PTS = Path("/dev/pts")
_PTY_OF_TITLE = re.compile(r"@pts/(\d+)\b")


def ending_message(reservation_id: str, end_iso: str, minutes_left: int) -> str:
    return (f"\r\n\a*** Berth: reservation {reservation_id} ends at {end_iso} (in {minutes_left} min). Save your "
            f"work: at the end your sessions and processes on this node are ended and the node is cleaned. Extend "
            f"with `berth reservations extend {reservation_id} --by 1h`. ***\r\n")


def terminals(user: str, uid: int, *, proc: Path = PROC, pts: Path = PTS) -> list[Path]:
    """The user's session terminals, by name (checked again when written)."""
    found: set[Path] = set()
    for p in processes(proc).values():
        if is_ssh_session_of(p, user):
            m = _PTY_OF_TITLE.search(p.title)
            if m:
                found.add(pts / m.group(1))
    if uid != 0:  # root owns every pty no one logged in to; only its sessions' own are its
        for entry in pts.iterdir() if pts.is_dir() else ():
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == uid:
                        found.add(entry)
                except OSError:
                    continue
    return sorted(found, key=lambda p: (len(p.name), p.name))


def tell(user: str, uid: int, text: str, *, proc: Path = PROC, pts: Path = PTS) -> list[Path]:
    """Write `text` to each of the user's session terminals; the ones written."""
    written = []
    for path in terminals(user, uid, proc=proc, pts=pts):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EIO, errno.ENXIO):
                log.warning("session message not written", tty=str(path), error=exc.strerror)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISCHR(st.st_mode) or st.st_uid != uid:
                continue
            os.write(fd, text.encode())
            written.append(path)
        except OSError as exc:  # EAGAIN: a terminal that does not drain is skipped, never waited for
            log.warning("session message not written", tty=str(path), error=exc.strerror)
        finally:
            os.close(fd)
    return written
