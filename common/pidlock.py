"""One process at a time on a thing: an exclusive flock on a file that holds the holder's pid (the agent's state
directory, a SQLite database a control plane serves). The lock dies with its process; the file stays, since
removing it would let a second holder lock a new file while the first still holds the old one."""
from __future__ import annotations

import fcntl
import os


class Held(Exception):
    """Another process holds the lock; `holder` is its pid as it wrote it ("unknown" if it wrote none)."""

    def __init__(self, path: str, holder: str):
        super().__init__(f"{path} is locked by pid {holder}")
        self.holder = holder


def hold(path: str | os.PathLike) -> int:
    """The descriptor of `path` (made 0600 if missing), locked for this process, with its pid written in; closing
    the descriptor releases it. Held if another process has it; OSError if the file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise Held(str(path), holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
