"""A small tmpfs of a test's own, to fill or make read-only: mounted below the test's temporary directory (root
only; the test is skipped otherwise) and unmounted after."""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def small_fs(under: Path, size: str, mode: str = "0755") -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = under / "fs"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def fill(point: Path) -> None:
    """Write a file `filler` in point until the file system is full (unbuffered: nothing is left to flush)."""
    fd = os.open(point / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
