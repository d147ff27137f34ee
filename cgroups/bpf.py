"""The bpf(2) boundary for device programs: load, attach (BPF_F_ALLOW_MULTI), replace atomically, query, detach.

ctypes over syscall(SYS_bpf), no compiler and no libbpf. Every failure is a
BpfError at `_bpf`, the one place the syscall is made. The constants and the
union bpf_attr layouts are those of linux/bpf.h (checked against the uapi
header: BPF_PROG_LOAD=5, BPF_PROG_ATTACH=8, BPF_PROG_DETACH=9,
BPF_PROG_GET_FD_BY_ID=13, BPF_OBJ_GET_INFO_BY_FD=15, BPF_PROG_QUERY=16,
BPF_PROG_TYPE_CGROUP_DEVICE=15, BPF_CGROUP_DEVICE=6, BPF_F_ALLOW_MULTI=2,
BPF_F_REPLACE=4). A handle names a program by its kernel id, so it survives
the process: after a restart, `attached(dir)` finds the same programs again.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import platform
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .bpf_program import MOV32_K, EXIT, Insn, encode, program_tag
from .errors import BpfError, CgroupError

log = logging.getLogger(__name__)

BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16

BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 1 << 1
BPF_F_REPLACE = 1 << 2
BPF_OBJ_NAME_LEN = 16
PROGRAM_NAME = "berth_dev"
LICENSE = b"Apache-2.0"

_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _ProgLoad(ctypes.Structure):
    _fields_ = [("prog_type", _u32), ("insn_cnt", _u32), ("insns", _u64), ("license", _u64),
                ("log_level", _u32), ("log_size", _u32), ("log_buf", _u64), ("kern_version", _u32),
                ("prog_flags", _u32), ("prog_name", ctypes.c_char * BPF_OBJ_NAME_LEN), ("prog_ifindex", _u32),
                ("expected_attach_type", _u32)]


class _Attach(ctypes.Structure):
    _fields_ = [("target_fd", _u32), ("attach_bpf_fd", _u32), ("attach_type", _u32), ("attach_flags", _u32),
                ("replace_bpf_fd", _u32)]


class _Query(ctypes.Structure):
    _fields_ = [("target_fd", _u32), ("attach_type", _u32), ("query_flags", _u32), ("attach_flags", _u32),
                ("prog_ids", _u64), ("prog_cnt", _u32)]


class _GetId(ctypes.Structure):
    _fields_ = [("prog_id", _u32), ("next_id", _u32), ("open_flags", _u32)]


class _Info(ctypes.Structure):
    _fields_ = [("bpf_fd", _u32), ("info_len", _u32), ("info", _u64)]


class _ProgInfo(ctypes.Structure):  # the head of struct bpf_prog_info; the kernel fills what info_len allows
    _fields_ = [("type", _u32), ("id", _u32), ("tag", ctypes.c_ubyte * 8), ("jited_prog_len", _u32),
                ("xlated_prog_len", _u32), ("jited_prog_insns", _u64), ("xlated_prog_insns", _u64),
                ("load_time", _u64), ("created_by_uid", _u32), ("nr_map_ids", _u32), ("map_ids", _u64),
                ("name", ctypes.c_char * BPF_OBJ_NAME_LEN)]


def _sys_bpf() -> int:
    try:
        return _SYS_BPF[platform.machine()]
    except KeyError:
        raise CgroupError(f"no bpf(2) syscall number known for {platform.machine()}") from None


def _bpf(cmd: int, attr: ctypes.Structure, op: str, path: Path | None = None) -> int:
    ret = _libc.syscall(_sys_bpf(), cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if ret < 0:
        raise BpfError(op, ctypes.get_errno(), path=path)
    return ret


@functools.cache
def raise_memlock() -> None:
    """Lift RLIMIT_MEMLOCK, which kernels before 5.11 charge program memory to."""
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError) as exc:
        log.debug("cannot raise RLIMIT_MEMLOCK (%s); fine on kernels >= 5.11 (memcg accounting)", exc)


def load(insns: Sequence[Insn], name: str = PROGRAM_NAME) -> int:
    """BPF_PROG_LOAD a BPF_PROG_TYPE_CGROUP_DEVICE program; returns its fd. A refusal carries the verifier log."""
    raise_memlock()
    code = encode(insns)
    buf = ctypes.create_string_buffer(code)
    lic = ctypes.create_string_buffer(LICENSE)
    attr = _ProgLoad(prog_type=BPF_PROG_TYPE_CGROUP_DEVICE, insn_cnt=len(insns),
                     insns=ctypes.addressof(buf), license=ctypes.addressof(lic),
                     prog_name=name.encode()[:BPF_OBJ_NAME_LEN - 1], expected_attach_type=BPF_CGROUP_DEVICE)
    try:
        return _bpf(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD")
    except BpfError as exc:
        if exc.errno not in (errno.EINVAL, errno.EACCES):
            raise
        logbuf = ctypes.create_string_buffer(1 << 16)
        attr.log_level, attr.log_size, attr.log_buf = 1, len(logbuf), ctypes.addressof(logbuf)
        try:
            return _bpf(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD")
        except BpfError as again:
            raise BpfError("BPF_PROG_LOAD", again.errno or 0, log=logbuf.value.decode(errors="replace")) from None


def attach(cgroup_fd: int, prog_fd: int, replace_fd: int | None = None, *, path: Path | None = None) -> None:
    flags = BPF_F_ALLOW_MULTI | (BPF_F_REPLACE if replace_fd is not None else 0)
    attr = _Attach(target_fd=cgroup_fd, attach_bpf_fd=prog_fd, attach_type=BPF_CGROUP_DEVICE, attach_flags=flags,
                   replace_bpf_fd=replace_fd or 0)
    _bpf(BPF_PROG_ATTACH, attr, "BPF_PROG_ATTACH" + (" BPF_F_REPLACE" if replace_fd is not None else ""), path)


def detach(cgroup_fd: int, prog_fd: int, *, path: Path | None = None) -> None:
    attr = _Attach(target_fd=cgroup_fd, attach_bpf_fd=prog_fd, attach_type=BPF_CGROUP_DEVICE)
    _bpf(BPF_PROG_DETACH, attr, "BPF_PROG_DETACH", path)


def query(cgroup_fd: int, *, path: Path | None = None) -> list[int]:
    """Ids of the device programs attached directly to the cgroup (BPF_PROG_QUERY), in run order."""
    size = 8
    for _ in range(8):
        ids = (_u32 * size)()
        attr = _Query(target_fd=cgroup_fd, attach_type=BPF_CGROUP_DEVICE, prog_ids=ctypes.addressof(ids),
                      prog_cnt=size)
        try:
            _bpf(BPF_PROG_QUERY, attr, "BPF_PROG_QUERY", path)
        except BpfError as exc:
            if exc.errno == errno.ENOSPC:  # prog_cnt now holds the real count
                size = max(attr.prog_cnt, size * 2)
                continue
            raise
        return list(ids[: attr.prog_cnt])
    raise CgroupError(f"BPF_PROG_QUERY on {path}: the list kept growing", path=path)


def fd_by_id(prog_id: int) -> int:
    return _bpf(BPF_PROG_GET_FD_BY_ID, _GetId(prog_id=prog_id), f"BPF_PROG_GET_FD_BY_ID {prog_id}")


@dataclass(frozen=True)
class ProgramInfo:
    id: int
    tag: bytes
    name: str
    type: int


def info(prog_fd: int) -> ProgramInfo:
    out = _ProgInfo()
    attr = _Info(bpf_fd=prog_fd, info_len=ctypes.sizeof(out), info=ctypes.addressof(out))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, "BPF_OBJ_GET_INFO_BY_FD")
    return ProgramInfo(out.id, bytes(out.tag), out.name.decode(errors="replace"), out.type)


def info_by_id(prog_id: int) -> ProgramInfo:
    fd = fd_by_id(prog_id)
    try:
        return info(fd)
    finally:
        os.close(fd)


@functools.cache
def tag_algorithm() -> str | None:
    """Which hash this kernel's program tags use (sha1 before 6.18, sha256 since); probed once by loading a stub."""
    stub = [Insn(MOV32_K, 0, imm=0), Insn(EXIT)]
    fd = load(stub, name="berth_probe")
    try:
        tag = info(fd).tag
    finally:
        os.close(fd)
    for algorithm in ("sha256", "sha1"):
        if program_tag(stub, algorithm) == tag:
            return algorithm
    log.warning("bpf program tags match neither sha1 nor sha256; device programs will be compared by loading them")
    return None


def expected_tag(insns: Sequence[Insn]) -> bytes:
    """The tag the kernel will give insns, without attaching anything."""
    algorithm = tag_algorithm()
    if algorithm is not None:
        return program_tag(insns, algorithm)
    fd = load(insns)
    try:
        return info(fd).tag
    finally:
        os.close(fd)


@functools.cache
def has_prog_replace() -> bool:
    """Whether BPF_PROG_ATTACH takes BPF_F_REPLACE (Linux 5.6+); probed once, as runc does.

    A replace attach aimed at a non-cgroup fd fails with EBADF where the flag
    is known and EINVAL where it is not.
    """
    fd = load([Insn(MOV32_K, 0, imm=0), Insn(EXIT)], name="berth_probe")
    target = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        attach(target, fd, replace_fd=fd)
    except BpfError as exc:
        return exc.errno != errno.EINVAL
    finally:
        os.close(target)
        os.close(fd)
    return True  # pragma: no cover - attaching to /dev/null cannot succeed


def open_cgroup(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise CgroupError(f"opening cgroup {path}: [Errno {exc.errno}] {exc.strerror}", path=path,
                          errno=exc.errno) from None


@dataclass(frozen=True)
class AttachedProgram:
    """A device program attached to one cgroup, named by kernel id and tag (no fd is held)."""

    cgroup: Path
    id: int
    tag: bytes

    def detach(self) -> None:
        detach_ids(self.cgroup, [self.id])


def attached(cgroup: Path) -> list[ProgramInfo]:
    """The device programs attached to the cgroup, with their tags; what recovery reads after a restart."""
    fd = open_cgroup(cgroup)
    try:
        return [info_by_id(i) for i in query(fd, path=cgroup)]
    finally:
        os.close(fd)


def query_ids(cgroup: Path) -> list[int]:
    fd = open_cgroup(cgroup)
    try:
        return query(fd, path=cgroup)
    finally:
        os.close(fd)


def _detach_id(cfd: int, prog_id: int, cgroup: Path) -> None:
    pfd = fd_by_id(prog_id)
    try:
        detach(cfd, pfd, path=cgroup)
    finally:
        os.close(pfd)


def detach_ids(cgroup: Path, ids: Sequence[int]) -> None:
    cfd = open_cgroup(cgroup)
    try:
        for prog_id in ids:
            _detach_id(cfd, prog_id, cgroup)
    finally:
        os.close(cfd)


def install(cgroup: Path, insns: Sequence[Insn]) -> AttachedProgram:
    """Make insns the one device program of the cgroup, with no moment where none or both filters are missing.

    Idempotent: when exactly this program (same tag) is the only one attached,
    nothing is loaded or attached. Otherwise the new program replaces the old
    one in place (BPF_F_REPLACE) where the kernel can and there is one old
    program; else the new one is attached first and the old ones detached
    after (for a moment both run, and both must allow: never more open).
    """
    want = expected_tag(insns)
    cfd = open_cgroup(cgroup)
    try:
        old = query(cfd, path=cgroup)
        if len(old) == 1:
            current = info_by_id(old[0])
            if current.tag == want:
                return AttachedProgram(cgroup, current.id, current.tag)
        pfd = load(insns)
        try:
            new = info(pfd)
            if len(old) == 1 and has_prog_replace():
                ofd = fd_by_id(old[0])
                try:
                    attach(cfd, pfd, replace_fd=ofd, path=cgroup)
                finally:
                    os.close(ofd)
            else:
                attach(cfd, pfd, path=cgroup)
                for prog_id in old:
                    _detach_id(cfd, prog_id, cgroup)
        finally:
            os.close(pfd)
        return AttachedProgram(cgroup, new.id, new.tag)
    finally:
        os.close(cfd)
