"""Reading kernel files under /proc and /sys: the one place where OSError becomes HostReadError.

Every reader in the agent goes through `read_text` (a file that must exist)
or `read_optional` (a file whose absence means an older kernel or a missing
feature: default value and a debug log naming the feature). The kernel's
cpulist format ("0-3,8,10-11") is parsed here (cgroups.files writes it).
"""
from __future__ import annotations

import os
from typing import TypeVar

import structlog

from agent.errors import HostReadError

log = structlog.get_logger(__name__)

T = TypeVar("T")


def read_text(path: str) -> str:
    """The file's text, stripped; HostReadError (with the path) if it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError as exc:
        raise HostReadError(path, exc.strerror or str(exc)) from exc


def read_optional(path: str, default: T, feature: str) -> str | T:
    """The file's text, or `default` with a debug log naming the kernel feature when the file is absent."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except FileNotFoundError:
        log.debug("kernel file absent", path=path, feature=feature)
        return default
    except OSError as exc:
        raise HostReadError(path, exc.strerror or str(exc)) from exc


def read_int(path: str) -> int:
    text = read_text(path)
    try:
        return int(text)
    except ValueError:
        raise HostReadError(path, f"expected an integer, found {text[:40]!r}") from None


def list_dir(path: str) -> list[str]:
    """The names in a directory, sorted; [] when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise HostReadError(path, exc.strerror or str(exc)) from exc


def parse_cpulist(text: str, path: str = "cpulist") -> tuple[int, ...]:
    """The kernel's list format ("0-3,8,10-11", "" for none) as a sorted tuple of CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                first, last = int(lo), int(hi)
                if last < first:
                    raise ValueError(part)
                cpus.update(range(first, last + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise HostReadError(path, f"not a cpulist: {text[:60]!r}") from None
    return tuple(sorted(cpus))

