"""The package's own errors: every OSError from cgroupfs or bpf(2) becomes one of these at one boundary.

Each error carries what an operator needs to act on it: the path and the value
for a file write, the controller and the host setting for a missing
controller, the field and both numbers for a share the host cannot give.
"""
from __future__ import annotations

import errno as _errno
import os
from pathlib import Path


class CgroupError(Exception):
    """Anything that went wrong at the cgroup or bpf boundary."""

    def __init__(self, message: str, *, path: Path | str | None = None, value: str | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.value = value
        self.errno = errno


class FileMissing(CgroupError):
    """An interface file (or the cgroup itself) does not exist: the controller is off or the kernel is older."""


class NotCgroup2(CgroupError):
    """The root is not on a cgroup2 filesystem (v1 hierarchies are used beside a cgroup2 root, never instead)."""

    def __init__(self, path: Path | str, found: str) -> None:
        super().__init__(
            f"{path} is not on a cgroup v2 filesystem (found {found}); a subtree's root is a cgroup2 directory "
            "(on a hybrid host the controllers bound to cgroup v1 get a directory of the same name in their own "
            "hierarchy beside it): mount cgroup2 (a unified or hybrid host) and point the root below it",
            path=path,
        )
        self.found = found


class ControllerMissing(CgroupError):
    """A controller the subtree must enforce is not available where it is needed."""

    def __init__(self, controller: str, hint: str, *, path: Path | str | None = None) -> None:
        super().__init__(f"cgroup controller {controller!r} is not available: {hint}", path=path)
        self.controller = controller
        self.hint = hint


class NotEnforceable(CgroupError):
    """A share field this host's layout has no file for (memory.high where memory is a cgroup v1 controller)."""

    def __init__(self, field: str, hint: str, *, path: Path | str | None = None) -> None:
        super().__init__(f"share field {field} cannot be enforced here: {hint}", path=path)
        self.field = field
        self.hint = hint


class InvalidShare(CgroupError, ValueError):
    """A share that is malformed in itself (negative, wrong type, high above max)."""


class ShareTooLarge(CgroupError):
    """A well-formed share that the host, or the parent cgroup, cannot give."""

    def __init__(self, field: str, asked: object, available: object, *, path: Path | str | None = None) -> None:
        super().__init__(f"share field {field}: asked {asked}, available {available}", path=path)
        self.field = field
        self.asked = asked
        self.available = available


class InvalidRule(CgroupError, ValueError):
    """A device rule that cannot be expressed (unknown type, access, or a number out of range)."""


class InvalidName(CgroupError, ValueError):
    """A cgroup name outside the allowed charset or without the subtree's prefix."""


class NotFound(CgroupError):
    """The named cgroup does not exist in the subtree."""


class Busy(CgroupError):
    """A cgroup did not become empty, or removable, within the time allowed."""


class BpfError(CgroupError):
    """A bpf(2) command failed; for a load, the verifier's log is attached."""

    def __init__(self, op: str, err: int, *, log: str = "", path: Path | str | None = None) -> None:
        detail = f"bpf({op}) failed: [Errno {err}] {_errno.errorcode.get(err, '?')} {os.strerror(err)}"
        if log:
            detail += f"\nverifier log:\n{log}"
        super().__init__(detail, path=path, errno=err)
        self.op = op
        self.log = log


class RecordCorrupt(CgroupError):
    """A recovery record exists but cannot be trusted (bad checksum, unknown version, unparsable)."""


class Exists(CgroupError):
    """create() found the cgroup already there (apply() adopts it instead)."""
