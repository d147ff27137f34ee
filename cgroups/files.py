"""The one reader/writer pair for cgroup interface files, and the parsers of their formats.

Every byte the package reads from or writes to cgroupfs goes through
`read_file` / `write_file`. Both refuse a name with a slash (a file name is
never a path), and both turn OSError into the package's errors here, once,
with the path and the value in the message. The parsers below them are plain
functions over text.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from common import hostfacts

from .errors import CgroupError, FileMissing

MAX = "max"


def _check_name(dir: Path, name: str) -> Path:
    if not name or "/" in name or name in (".", ".."):
        raise CgroupError(f"refusing interface file name {name!r}: a name, not a path", path=Path(dir) / str(name))
    return Path(dir) / name


def _translate(exc: OSError, action: str, path: Path, value: str | None) -> CgroupError:
    what = f"{action} {path}" + (f" value {value!r}" if value is not None else "")
    kind = FileMissing if exc.errno == errno.ENOENT else CgroupError
    return kind(f"{what}: [Errno {exc.errno}] {exc.strerror}", path=path, value=value, errno=exc.errno)


def write_file(dir: Path | str, name: str, value: str) -> None:
    """Write value to dir/name in one write(2), as cgroupfs wants; the file must exist."""
    path = _check_name(Path(dir), name)
    # An empty write(2) never reaches the kernel's handler; a lone newline does (and clears, e.g. cpuset.cpus).
    data = value.encode() or b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)  # O_TRUNC: as `echo >` does
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _translate(exc, "writing", path, value) from None


def read_file(dir: Path | str, name: str) -> str:
    """Read dir/name whole, without its trailing newline."""
    path = _check_name(Path(dir), name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _translate(exc, "reading", path, None) from None
    return b"".join(chunks).decode().rstrip("\n")


def has_file(dir: Path | str, name: str) -> bool:
    """Whether the interface file exists (a controller is on, or the kernel has the feature)."""
    return _check_name(Path(dir), name).exists()


# -- parsers ---------------------------------------------------------------


def parse_max(text: str) -> int | None:
    """'max' is no limit (None); anything else is a decimal integer."""
    text = text.strip()
    if text == MAX:
        return None
    try:
        return int(text)
    except ValueError:
        raise CgroupError(f"expected an integer or 'max', got {text!r}") from None


def format_max(value: int | None) -> str:
    return MAX if value is None else str(value)


def parse_keyed(text: str) -> dict[str, int]:
    """A flat keyed file ('key value' per line: memory.events, cgroup.events, cpu.stat)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def parse_list(text: str) -> list[str]:
    """A space separated list (cgroup.controllers, cgroup.subtree_control)."""
    return text.split()


def parse_pids(text: str) -> list[int]:
    """cgroup.procs / cgroup.threads: one pid per line."""
    return [int(line) for line in text.split()]


def parse_cpulist(text: str) -> frozenset[int]:
    """The kernel's list format, '0-3,8,10-11'; empty means none (the one parser is common.hostfacts')."""
    try:
        return frozenset(hostfacts.parse_cpulist(text))
    except hostfacts.HostReadError:
        raise CgroupError(f"bad cpu/node list {text!r}") from None


format_cpulist = hostfacts.format_cpulist


# -- desired values, applied and compared ----------------------------------


@dataclass(frozen=True)
class Drift:
    """One interface file (or 'devices', or 'record') whose value differs from what the share says."""

    what: str
    want: str
    got: str


def apply_values(dir: Path | str, desired: dict[str, str]) -> list[str]:
    """Write each file whose current value differs; returns the names written (empty: nothing changed)."""
    written = []
    for name, value in desired.items():
        if read_file(dir, name) != value:
            write_file(dir, name, value)
            written.append(name)
    return written


def drift_values(dir: Path | str, desired: dict[str, str]) -> list[Drift]:
    """The files whose value is not the desired one; a missing file reads as '<missing>'."""
    out = []
    for name, value in desired.items():
        try:
            current = read_file(dir, name)
        except FileMissing:
            current = "<missing>"
        if current != value:
            out.append(Drift(name, value, current))
    return out
