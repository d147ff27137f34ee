"""The kernel-facing operations a Subtree is given: directories appear and go, the cgroupfs check, device programs.

`Kernel` is the protocol; `LinuxKernel` is the real one (mkdir(2)/rmdir(2),
statfs(2), bpf(2) through cgroups.bpf) and the default. A test hands the
Subtree a stand-in that fills a plain directory tree the way cgroupfs would
(tests/cgroups/fakefs.py), so production code never asks whether it is being
tested. Interface-file reads and writes are not here: they go through
cgroups.files in both cases.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence

from . import bpf, host
from .bpf_program import Insn
from .errors import CgroupError, NotCgroup2


class Kernel(Protocol):
    def check_cgroup2(self, path: Path) -> None:
        """Raise NotCgroup2 unless path (or its nearest existing ancestor) is on a cgroup2 filesystem."""

    def check_cgroup1(self, path: Path) -> None:
        """Raise CgroupError unless path (or its nearest existing ancestor) is on a cgroup v1 hierarchy."""

    def mkdir(self, path: Path) -> None: ...

    def rmdir(self, path: Path) -> None: ...

    def install_program(self, cgroup: Path, insns: Sequence[Insn]) -> int:
        """Make insns the one device program of the cgroup (idempotent); returns its id."""

    def programs(self, cgroup: Path) -> list[bpf.ProgramInfo]:
        """The device programs attached to the cgroup, in run order, with their tags."""

    def program_ids(self, cgroup: Path) -> list[int]: ...

    def detach_programs(self, cgroup: Path, ids: Sequence[int]) -> None: ...

    def expected_tag(self, insns: Sequence[Insn]) -> bytes:
        """The tag the kernel gives insns, without attaching anything."""


def _existing(path: Path) -> Path:
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


class LinuxKernel:
    """The real kernel."""

    def check_cgroup2(self, path: Path) -> None:
        probe = _existing(path)
        if not host.is_cgroup2(probe):
            raise NotCgroup2(path, host.describe_fs(probe))

    def check_cgroup1(self, path: Path) -> None:
        probe = _existing(path)
        if host.statfs_type(probe) != host.CGROUP_SUPER_MAGIC:
            raise CgroupError(f"{path} is not on a cgroup v1 hierarchy (found {host.describe_fs(probe)})", path=path)

    def mkdir(self, path: Path) -> None:
        os.mkdir(path, 0o755)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def install_program(self, cgroup: Path, insns: Sequence[Insn]) -> int:
        return bpf.install(cgroup, insns).id

    def programs(self, cgroup: Path) -> list[bpf.ProgramInfo]:
        return bpf.attached(cgroup)

    def program_ids(self, cgroup: Path) -> list[int]:
        return bpf.query_ids(cgroup)

    def detach_programs(self, cgroup: Path, ids: Sequence[int]) -> None:
        bpf.detach_ids(cgroup, ids)

    def expected_tag(self, insns: Sequence[Insn]) -> bytes:
        return bpf.expected_tag(insns)
